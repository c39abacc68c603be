"""A DVC stage's progress, forwarded to the Prefect task that runs it: what the run page shows.

``tasks/pipeline.reproduce_stage`` hands each progress record the stage writes (``tasks/progress.py``)
to a ``StageProgress``; it keeps one Prefect progress artifact per progress bar up to date and writes
the record as a line of the task run's log (step and loss, at the stage's steady reporting interval).
"""

from __future__ import annotations

from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.progress import describe


class StageProgress:
    """Call with each progress record of ``stage``; ``logger`` is the task run's (``get_run_logger()``)."""

    def __init__(self, stage: str, logger):
        self.stage, self.logger = stage, logger
        self.artifacts: dict[str, UUID] = {}  # progress bar -> its artifact

    def __call__(self, record: dict) -> None:
        pct = min(100.0, 100.0 * record["n"] / record["total"]) if record["total"] else 100.0
        text = describe(record)
        description = f"{self.stage}: {text}"
        if record["desc"] not in self.artifacts:
            self.artifacts[record["desc"]] = create_progress_artifact(pct, description=description)
        else:
            update_progress_artifact(self.artifacts[record["desc"]], pct, description=description)
        self.logger.info(text)
