"""Deploy ``monthly-release`` to a process work pool: production mode, run by a long-lived worker.

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.deploy      # `make deploy` does this
    prefect worker start --pool adapter-release --type process --limit 1  # `make worker`: runs the deployment

Unlike ``flows/serve.py`` (the deployment lives as long as that process), this registers the
deployment with the Prefect server once; any worker polling the work pool runs it, on the same
monthly schedule (``flows.serve``'s cron and time zone) and whenever it is triggered from the UI or API.
The work pool (type ``process``) is created if it does not exist; ``refresh-update-channel``
(``flows/refresh_channel.py``, every six hours) is deployed beside it on the same pool. The flow is loaded from
``--source`` (this checkout by default) and each run executes with that directory as its working
directory (a ``set_working_directory`` pull step): the flow's project root is ``Path.cwd()``.

The deployment's defaults are ``--params`` with ``publish.tracking_uri`` pointing at the MLflow
tracking server (``--set`` changes that or any other key, e.g. the shared DVC remote), kept as
``flows.monthly_release.register_defaults`` keeps them; a run's parameters are set onto them:

    python -m flows.deploy --set publish.tracking_uri=http://127.0.0.1:5000 --set publish.remote_dir=/srv/dvc-remote
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flows.monthly_release import register_defaults
from flows.refresh_channel import REFRESH_CRON, REFRESH_DEPLOYMENT
from flows.serve import DEFAULT_CRON, DEFAULT_TIMEZONE, DEPLOYMENT
from tasks.config import ConfigError, ReleaseConfig, load_config, parse_assignments, with_settings

WORK_POOL = "adapter-release"
ENTRYPOINT = "flows/monthly_release.py:monthly_release"
REFRESH_ENTRYPOINT = "flows/refresh_channel.py:refresh_update_channel"
# `make mlflow-server` listens here; a tracking server chooses where artifacts go (tasks/tracking.py).
TRACKING_URI = "http://127.0.0.1:5000"


def ensure_process_pool(name: str) -> None:
    """Create the work pool (type process, the worker's default job template) unless it exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type=ProcessWorker.type,
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
            print(f"work pool {name!r} (process) created")
            return
    if pool.type != ProcessWorker.type:
        raise SystemExit(f"error: work pool {name!r} exists with type {pool.type!r}, not 'process'")


def deploy(config: ReleaseConfig, source: Path, work_pool: str, cron: str, timezone: str) -> str:
    """Register the deployment; return its id."""
    from prefect import flow
    from prefect.schedules import Cron

    ensure_process_pool(work_pool)
    # from_source with a local directory: the deployment's pull step is set_working_directory(source).
    remote = flow.from_source(source=str(source.resolve()), entrypoint=ENTRYPOINT)
    deployment_id = remote.deploy(
        name=DEPLOYMENT,
        work_pool_name=work_pool,
        schedules=[Cron(cron, timezone=timezone)],
        parameters=register_defaults(config),
        description="Fine-tune, calibrate, evaluate on the engine, gate, package and publish this month's adapter.",
        tags=["adapter-release"],
        concurrency_limit=1,  # DVC holds one repository lock: runs of the month never overlap
        print_next_steps=False,
        ignore_warnings=True,  # the process-pool hint to use .serve: production mode wants a worker
    )
    flow.from_source(source=str(source.resolve()), entrypoint=REFRESH_ENTRYPOINT).deploy(
        name=REFRESH_DEPLOYMENT, work_pool_name=work_pool, schedules=[Cron(REFRESH_CRON, timezone=timezone)],
        description="Re-sign the update channel's timestamp (snapshot, targets near expiry) without a release.",
        tags=["adapter-release"], concurrency_limit=1, print_next_steps=False, ignore_warnings=True,
    )
    return str(deployment_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="default parameters of the deployment")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a parameter (repeatable); publish.tracking_uri defaults to {TRACKING_URI}")
    parser.add_argument("--source", type=Path, default=Path.cwd(),
                        help="project directory the worker loads the flow from and runs it in (default: here)")
    parser.add_argument("--work-pool", default=WORK_POOL)
    parser.add_argument("--cron", default=DEFAULT_CRON)
    parser.add_argument("--timezone", default=DEFAULT_TIMEZONE)
    args = parser.parse_args(argv)
    try:
        settings = parse_assignments([f"publish.tracking_uri={TRACKING_URI}", *args.overrides], source="--set")
        config = with_settings(load_config(args.params), settings, source="--set")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    deployment_id = deploy(config, args.source, args.work_pool, args.cron, args.timezone)
    print(f"deployment {DEPLOYMENT}/{DEPLOYMENT} ({deployment_id}) on work pool {args.work_pool!r}, "
          f"cron {args.cron!r} {args.timezone}; MLflow {config.publish.tracking_uri}; "
          f"runs in {args.source.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
