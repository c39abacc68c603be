"""Serve the ``monthly-release`` deployment: a monthly schedule plus runs triggered by hand.

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.serve      # `make prefect` does this

The deployment's defaults are ``params.yaml`` as it is now (``flows.monthly_release.register_defaults``);
the UI (Deployments -> monthly-release -> Run -> Custom run) shows a form of four fields: month, dry
run, force, and overrides of any other setting by dotted key. Runs execute in this process's working
directory, one at a time (DVC holds one repository lock).
"""

from __future__ import annotations

import argparse
import sys

from prefect.schedules import Cron

from flows.monthly_release import monthly_release, register_defaults
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
    monthly_release.serve(
        name=DEPLOYMENT,
        schedules=[Cron(args.cron, timezone=args.timezone)],
        parameters=register_defaults(load_config(args.params)),
        description="Fine-tune, calibrate, evaluate on the engine, gate, package and publish this month's adapter.",
        tags=["adapter-release"],
        limit=1,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
