"""MLflow record of a release: one parent run, a nested run per stage, the registered model and its aliases.

Every call names its run id: MLflow's "active run" is per thread, and Prefect may run tasks on
other threads. Tracking is on SQLite (the file store is deprecated); artifacts go under
``publish.artifacts_dir``. Each candidate becomes a new version of ``publish.model_name`` with
the alias ``candidate``; only a release that passed every gate and was published moves ``champion``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tasks.config import PublishConfig, ReleaseConfig

CANDIDATE, CHAMPION = "candidate", "champion"
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


def start_release_run(client, experiment_id: str, cfg: ReleaseConfig, git_revision: str, flow_run: str | None) -> str:
    from mlflow.entities import Param

    tags = {"month": cfg.data.month, "git_revision": git_revision, "params_hash": cfg.params_hash(),
            "dry_run": str(cfg.publish.dry_run)}
    if flow_run:
        tags["prefect_flow_run_id"] = flow_run
    run = client.create_run(experiment_id, run_name=f"release-{cfg.data.month}", tags=tags)
    params = [Param(k, v) for k, v in _flatten_params(cfg).items()]
    for start in range(0, len(params), 90):  # at most 100 params per batch
        client.log_batch(run.info.run_id, params=params[start : start + 90])
    return run.info.run_id


def log_stage_run(client, experiment_id: str, parent_run_id: str, stage: str, reproduced: bool, seconds: float,
                  metrics: dict[str, float], artifacts: list[Path]) -> str:
    """A nested run for one stage: whether DVC ran it, how long it took, its metrics and files."""
    run = client.create_run(experiment_id, run_name=stage,
                            tags={"mlflow.parentRunId": parent_run_id, "stage": stage, "reproduced": str(reproduced)})
    run_id = run.info.run_id
    log_metrics(client, run_id, metrics | {"seconds": seconds, "reproduced": float(reproduced)})
    for path in artifacts:
        if Path(path).is_dir():
            client.log_artifacts(run_id, str(path), Path(path).name)
        elif Path(path).exists():
            client.log_artifact(run_id, str(path))
    client.set_terminated(run_id, "FINISHED")
    return run_id


def register_candidate(client, model_name: str, run_id: str, source: str, tags: dict[str, str]) -> str:
    """A new version of ``model_name`` for this candidate, aliased ``candidate``; returns the version."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(model_name)
    except MlflowException:
        client.create_registered_model(model_name, description="Monthly LoRA adapter releases for the compiled backbone")
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
