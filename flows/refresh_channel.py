"""Keep the update channel fresh without a release: a new signed timestamp (and snapshot or targets
close to their expiry) every few hours, so devices can tell a live channel from a frozen one.

    python -m flows.refresh_channel --params params.yaml      # one refresh now (ephemeral Prefect)

Served beside ``monthly-release`` by ``flows.serve`` and deployed beside it by ``flows.deploy``
(deployment ``REFRESH_DEPLOYMENT``, cron ``REFRESH_CRON``). The timestamp lives
``publish.timestamp_expiry_days`` (1 by default): four runs a day leave 18 hours for a missed run
to be noticed before devices refuse the channel as stale.
"""


# No `from __future__ import annotations`: Prefect builds the parameter form from the annotations.
import argparse
import sys

from prefect import flow, get_run_logger, task  # after flows/__init__.py set Prefect's environment

from flows import ServerStartupTimeout, naming_the_startup_timeout
from flows.monthly_release import run_defaults
from tasks.config import StageError, load_config
from tasks.release import update_channel

REFRESH_DEPLOYMENT = "refresh-update-channel"
REFRESH_CRON = "0 */6 * * *"


@task(retries=2, retry_delay_seconds=30)
def sign_fresh_metadata(channel: update_channel.Channel) -> list[str]:
    return update_channel.refresh(channel)


@flow(name="refresh-update-channel", log_prints=True)
def refresh_update_channel(params: str | None = None) -> dict:
    """Sign a new timestamp (snapshot, targets when near their expiry) of the update channel.

    Args:
        params: A params file to read publish.tuf_dir, tuf_keys_dir and timestamp_expiry_days from
            (empty: the monthly-release deployment's defaults, as its runs see them).
    """
    config = load_config(params) if params else run_defaults()[0]
    channel = update_channel.Channel.from_config(config.publish)
    written = sign_fresh_metadata(channel)
    state = update_channel.load_state(channel)
    expires = state.timestamp.signed.expires.isoformat()
    get_run_logger().info("update channel %s: signed %s; timestamp v%d expires %s",
                          channel.repo, ", ".join(written), state.timestamp.signed.version, expires)
    return {"written": written, "timestamp_version": state.timestamp.signed.version, "timestamp_expires": expires}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    try:
        with naming_the_startup_timeout():
            result = refresh_update_channel(args.params)
    except StageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ServerStartupTimeout as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"timestamp v{result['timestamp_version']} expires {result['timestamp_expires']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
