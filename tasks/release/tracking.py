"""MLflow record of a release: one parent run, a nested run per stage, the registered model and its aliases.

Every call names its run id: MLflow's "active run" is per thread, and Prefect may run tasks on
other threads. Tracking is on SQLite (the file store is deprecated); artifacts go under
``publish.artifacts_dir``. Each candidate becomes a new version of ``publish.model_name`` with
the alias ``candidate``; only a release that passed every gate and was published moves ``champion``.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

from tasks.config import PublishConfig, ReleaseConfig

CANDIDATE, CHAMPION = "candidate", "champion"
FLOW_RUN_TAG = "prefect_flow_run_id"  # names the parent run of one Prefect flow run: retries find it
PARENT_TAG = "mlflow.parentRunId"
SYSTEM_METRICS_INTERVAL_S = 10.0
# MLflow keeps long parameter values, but the UI truncates; config values are short here.
_PARAM_LIMIT = 6000


def client_for(publish: PublishConfig, root: Path):
    """An MlflowClient on ``publish.tracking_uri`` and the experiment id (created with its artifact folder)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = publish.tracking_uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str((Path(root) / uri[len("sqlite:///"):]).resolve())  # relative to the project
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(publish.experiment)
    if experiment is not None:
        return client, experiment.experiment_id
    if not uri.startswith("sqlite:"):  # a tracking server decides where artifacts go (--artifacts-destination)
        return client, client.create_experiment(publish.experiment)
    artifacts = (Path(root) / publish.artifacts_dir).resolve()
    artifacts.mkdir(parents=True, exist_ok=True)
    return client, client.create_experiment(publish.experiment, artifact_location=artifacts.as_uri())


def flatten_numbers(payload: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON object as dotted metric names (lists and strings are skipped)."""
    out: dict[str, float] = {}
    for key, value in payload.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
        elif isinstance(value, dict):
            out |= flatten_numbers(value, name + ".")
    return out


def _flatten_params(cfg: ReleaseConfig) -> dict[str, str]:
    params = {}
    for section, values in cfg.model_dump(mode="json").items():
        for key, value in values.items():
            params[f"{section}.{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return {k: v[:_PARAM_LIMIT] for k, v in params.items()}


def log_metrics(client, run_id: str, metrics: dict[str, float]) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, 0) for k, v in sorted(metrics.items()) if v is not None]
    for start in range(0, len(items), 900):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(run_id, metrics=items[start : start + 900])


def _find_runs(client, experiment_id: str, tags: dict[str, str]) -> list:
    query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in sorted(tags.items()))
    return client.search_runs([experiment_id], query, order_by=["attributes.start_time ASC"])


def start_release_run(client, experiment_id: str, cfg: ReleaseConfig, git_revision: str, flow_run: str | None) -> str:
    """The parent run of this flow run: the one it already opened (found by the flow run's tag), else a new one."""
    from mlflow.entities import Param

    if flow_run:
        found = [r for r in _find_runs(client, experiment_id, {FLOW_RUN_TAG: flow_run})
                 if PARENT_TAG not in r.data.tags]
        if found:
            return found[0].info.run_id
    tags = {"month": cfg.data.month, "git_revision": git_revision, "params_hash": cfg.params_hash(),
            "dry_run": str(cfg.publish.dry_run)}
    if flow_run:
        tags[FLOW_RUN_TAG] = flow_run
    run = client.create_run(experiment_id, run_name=f"release-{cfg.data.month}", tags=tags)
    params = [Param(k, v) for k, v in _flatten_params(cfg).items()]
    for start in range(0, len(params), 90):  # at most 100 params per batch
        client.log_batch(run.info.run_id, params=params[start : start + 90])
    return run.info.run_id


def log_history(client, run_id: str, name: str, points: list[tuple[int, float]]) -> None:
    """One metric point per (step, value): what MLflow's UI charts against the step."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    items = [Metric(name, float(value), now, int(step)) for step, value in points]
    for start in range(0, len(items), 900):
        client.log_batch(run_id, metrics=items[start : start + 900])


def log_stage_run(client, experiment_id: str, parent_run_id: str, stage: str, reproduced: bool, seconds: float,
                  metrics: dict[str, float], artifacts: list[Path], histories: dict[str, list[tuple[int, float]]] | None = None,
                  started: float | None = None, ended: float | None = None, tags: dict[str, str] | None = None) -> str:
    """A nested run for one stage: whether DVC ran it, its real start and end (Unix seconds), its
    metrics, per-step histories, files and ``tags`` (where it ran: device, precision).

    Idempotent: a stage run this parent already finished is kept as it is (a retried ``record``
    logs no point twice); one left half-logged is replaced.
    """
    for existing in _find_runs(client, experiment_id, {PARENT_TAG: parent_run_id, "stage": stage}):
        if existing.info.status == "FINISHED":
            return existing.info.run_id
        client.delete_run(existing.info.run_id)
    run = client.create_run(experiment_id, run_name=stage, start_time=None if started is None else int(started * 1000),
                            tags={**(tags or {}), PARENT_TAG: parent_run_id, "stage": stage, "reproduced": str(reproduced)})
    run_id = run.info.run_id
    log_metrics(client, run_id, metrics | {"seconds": seconds, "reproduced": float(reproduced)})
    for name, points in (histories or {}).items():
        log_history(client, run_id, name, points)
    for path in artifacts:
        if Path(path).is_dir():
            client.log_artifacts(run_id, str(path), Path(path).name)
        elif Path(path).exists():
            client.log_artifact(run_id, str(path))
    client.set_terminated(run_id, "FINISHED", end_time=None if ended is None else int(ended * 1000))
    return run_id


@contextlib.contextmanager
def system_metrics(run_id: str, tracking_uri: str) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory, disk, network; psutil) on ``run_id`` while the block runs."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, tracking_uri=tracking_uri)
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def register_candidate(client, model_name: str, run_id: str, source: str, tags: dict[str, str]) -> str:
    """The version of ``model_name`` for this candidate run, aliased ``candidate``; returns the version.

    Idempotent: the version already registered from ``run_id`` (a retried ``record``) is reused.
    """
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(model_name)
    except MlflowException:
        client.create_registered_model(model_name, description="Monthly LoRA adapter releases for the compiled backbone")
    existing = client.search_model_versions(f"name = '{model_name}' and run_id = '{run_id}'")
    if existing:
        version = min(int(v.version) for v in existing)
    else:
        version = client.create_model_version(model_name, source, run_id=run_id, tags=tags).version
    client.set_registered_model_alias(model_name, CANDIDATE, version)
    return str(version)


def alias_version(client, model_name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(model_name, alias).version)
    except MlflowException:
        return None


def move_champion(client, model_name: str, version: str) -> str | None:
    """Point ``champion`` at ``version``; return the version it named before (None: none)."""
    previous = alias_version(client, model_name, CHAMPION)
    client.set_registered_model_alias(model_name, CHAMPION, version)
    client.set_model_version_tag(model_name, version, "published", "true")
    return previous


def restore_champion(client, model_name: str, previous: str | None, version: str) -> None:
    """Undo ``move_champion``."""
    if previous is None:
        client.delete_registered_model_alias(model_name, CHAMPION)
    else:
        client.set_registered_model_alias(model_name, CHAMPION, previous)
    client.delete_model_version_tag(model_name, version, "published")
