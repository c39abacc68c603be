"""Serve the ``monthly-release`` deployment: a monthly schedule plus runs triggered by hand.

Beside it, ``refresh-update-channel`` (``flows/refresh_channel.py``) re-signs the update channel's
timestamp every six hours, so devices never see it go stale between releases.

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.serve      # `make prefect` does this

The deployment's defaults are ``params.yaml`` as it is now (``flows.monthly_release.register_defaults``);
the UI (Deployments -> monthly-release -> Run -> Custom run) shows a form of four fields: month, dry
run, force, and overrides of any other setting by dotted key. Runs execute in this process's working
directory, one at a time (DVC holds one repository lock).
"""

from __future__ import annotations

import argparse
import sys

from prefect import serve
from prefect.schedules import Cron

from flows.monthly_release import monthly_release, register_defaults
from flows.refresh_channel import REFRESH_CRON, REFRESH_DEPLOYMENT, refresh_update_channel
from tasks.config import load_config

DEPLOYMENT = "monthly-release"
# 06:00 on the 1st, plant time: the month's data lands the evening before.
DEFAULT_CRON = "0 6 1 * *"
DEFAULT_TIMEZONE = "Europe/Berlin"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="default parameters of the deployment")
    parser.add_argument("--cron", default=DEFAULT_CRON)
    parser.add_argument("--timezone", default=DEFAULT_TIMEZONE)
    args = parser.parse_args(argv)
    serve(
        monthly_release.to_deployment(
            name=DEPLOYMENT,
            schedules=[Cron(args.cron, timezone=args.timezone)],
            parameters=register_defaults(load_config(args.params)),
            description="Fine-tune, calibrate, evaluate on the engine, gate, package and publish this month's adapter.",
            tags=["adapter-release"],
            concurrency_limit=1,
        ),
        refresh_update_channel.to_deployment(
            name=REFRESH_DEPLOYMENT, schedules=[Cron(REFRESH_CRON, timezone=args.timezone)],
            description="Re-sign the update channel's timestamp (snapshot, targets near expiry) without a release.",
            tags=["adapter-release"], concurrency_limit=1,
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
