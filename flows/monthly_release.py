"""The monthly adapter release as a Prefect flow: DVC stages, gates, MLflow, then an atomic publish.

The flow takes what a person types: ``month``, ``dry_run``, ``force`` and ``overrides`` (dotted keys
of ``params.yaml``, e.g. ``{"gates.min_accuracy_new": 0.97}``), so the Prefect UI's form has four
fields and ``prefect deployment run monthly-release/monthly-release -p month=2026-12`` works. They
are set onto the run's defaults: a deployment's are ``params.yaml`` as it was when the deployment
was registered (kept in the Prefect variable ``DEFAULTS_VARIABLE``); a run outside a deployment
starts from ``ReleaseConfig``'s defaults, which the shipped ``params.yaml`` states. The flow only
wires things together: stages are ``dvc.yaml``'s, decisions are in ``tasks/release/steps.py``,
``tasks/release/registry.py`` and ``tasks/release/tracking.py``.

    python -m flows.monthly_release --params params.yaml      # ephemeral Prefect, what `make release` runs
"""


# No `from __future__ import annotations` here: Prefect builds the parameter form from the flow's
# annotations, and a served flow is loaded from its file, where a string annotation cannot be resolved.
import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task  # after flows/__init__.py set Prefect's environment
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext
from prefect.runtime import deployment, flow_run
from prefect.transactions import get_transaction, transaction
from prefect.variables import Variable

from flows import ServerStartupTimeout, naming_the_startup_timeout
from flows.progress_artifact import StageProgress
from tasks.config import (
    ConfigError,
    ReleaseConfig,
    StageError,
    changed_settings,
    load_config,
    parse_config,
    with_settings,
)
from tasks.gate_rules import GateFailed, failed_reason
from tasks.release import registry, stage_runner, steps, tracking, update_channel
from tasks.release.notes import describe_trigger

# A deployment's defaults: the registered params.yaml, as JSON (flows/serve.py and flows/deploy.py write it).
DEFAULTS_VARIABLE = "monthly-release-defaults"
# The settings that have a flow parameter of their own; ``overrides`` takes every other one.
OWN_PARAMETERS = {"month": "data.month", "dry_run": "publish.dry_run", "force": "publish.force"}


def register_defaults(config: ReleaseConfig) -> dict:
    """Keep ``config`` as the defaults of the deployment being registered; return its parameters
    (the form's initial values: ``config``'s month, dry run and force, no overrides)."""
    Variable.set(DEFAULTS_VARIABLE, config.model_dump(mode="json"), overwrite=True)
    return flow_parameters(config, config)


def flow_parameters(config: ReleaseConfig, defaults: ReleaseConfig) -> dict:
    """The flow's parameters that make a run starting from ``defaults`` use ``config``."""
    overrides = {key: value for key, value in changed_settings(config, defaults).items()
                 if key not in OWN_PARAMETERS.values()}
    return {"month": config.data.month, "dry_run": config.publish.dry_run, "force": config.publish.force,
            "overrides": overrides}


def settings_markdown(config: ReleaseConfig) -> str:
    """The run's resolved settings, for its summary: what to put in params.yaml to repeat it."""
    return (f"\n## Settings\n\nThe run's settings (params hash `{config.params_hash()[:12]}`):\n\n```yaml\n"
            f"{yaml.safe_dump(config.model_dump(mode='json'), sort_keys=False)}```\n")


def run_defaults() -> tuple[ReleaseConfig, str]:
    """The settings this run starts from, and where they come from."""
    if deployment.id:
        raw = Variable.get(DEFAULTS_VARIABLE)
        if raw is not None:
            source = f"the deployment's defaults (Prefect variable {DEFAULTS_VARIABLE})"
            return parse_config(raw, source=source), source
        get_run_logger().warning("Prefect variable %s is missing (a deployment registered other than by "
                                 "flows.serve or flows.deploy): the run starts from ReleaseConfig's defaults",
                                 DEFAULTS_VARIABLE)
    return ReleaseConfig(), "ReleaseConfig's defaults"


def resolve_config(defaults: ReleaseConfig, month: str | None, dry_run: bool | None, force: bool | None,
                   overrides: dict[str, Any] | None) -> ReleaseConfig:
    """``defaults`` with the run's parameters set; every key is validated and a bad one named."""
    overrides = dict(overrides or {})
    own = [key for key in overrides if key in OWN_PARAMETERS.values()]
    if own:
        names = {key: name for name, key in OWN_PARAMETERS.items()}
        raise ConfigError("overrides: " + "; ".join(f"{key} has a parameter of its own: set {names[key]}" for key in own))
    given = {"month": month, "dry_run": dry_run, "force": force}
    settings = overrides | {OWN_PARAMETERS[name]: value for name, value in given.items() if value is not None}
    return with_settings(defaults, settings, source="the run's parameters")


@task(retries=2, retry_delay_seconds=5)
def set_up(config: ReleaseConfig) -> None:
    stage_runner.ensure_dvc_repo(Path.cwd(), config.publish.remote_dir)
    registry.ensure_registry(Path(config.publish.registry_dir), config.publish.remote_dir)


@task(task_run_name="dvc-repro-{name}")
def reproduce(name: str, force: bool = False) -> stage_runner.StageRun:
    logger = get_run_logger()
    # The stage's progress bars and losses reach this task's page as progress artifacts and log lines.
    run = stage_runner.reproduce_stage(Path.cwd(), name, force=force, on_progress=StageProgress(name, logger))
    logger.info(run.describe())
    return run


@task(retries=2, retry_delay_seconds=5)
def record(config: ReleaseConfig, runs: list[stage_runner.StageRun], report: dict) -> steps.Recorded:
    return steps.record_in_mlflow(config, Path.cwd(), runs, report, str(flow_run.id))


@task
def summarize(config: ReleaseConfig, runs: list[stage_runner.StageRun], report: dict, recorded: steps.Recorded | None,
              outcome: str, notes: str | None = None) -> str:
    text = steps.summary_markdown(config, runs, report, recorded, outcome, notes) + settings_markdown(config)
    create_markdown_artifact(text, key=steps.SUMMARY_KEY, description=f"release {config.data.month}: {outcome}")
    return text


@task(retries=2, retry_delay_seconds=5)
def reconcile(config: ReleaseConfig, entry: dict) -> list[str]:
    return steps.reconcile_published(config, Path.cwd(), entry)


@task
def publish_to_registry(config: ReleaseConfig, recorded: steps.Recorded, notes: str) -> registry.Published:
    published = registry.publish_release(
        Path(config.publish.registry_dir), config.layout.package_release_dir, config.data.month,
        steps.registry_entry(config, recorded), champion=True, force=config.publish.force,
        lineage=Path.cwd() / "dvc.lock", notes=notes, product=config.data.product,
    )
    get_transaction().set("published", published)
    return published


@publish_to_registry.on_rollback
def _unpublish(txn) -> None:
    published = txn.get("published")
    registry.rollback(Path.cwd() / txn.get("registry"), published.previous_head, published.month, published.previous_tag,
                     published.product)


@task(retries=2, retry_delay_seconds=5)
def sign_update_channel(config: ReleaseConfig) -> list[str]:
    """After the registry committed: the release and its champion signed into the TUF repository devices pull."""
    return update_channel.publish_from_registry(config.publish, config.data.month, product=config.data.product)


@task(retries=2, retry_delay_seconds=5)
def push_pipeline_outputs() -> int:
    return stage_runner.push_outputs(Path.cwd())


@task
def promote(config: ReleaseConfig, recorded: steps.Recorded) -> str | None:
    client, _ = tracking.client_for(config.publish, Path.cwd())
    previous = tracking.move_champion(client, config.publish.model_name, recorded.version)
    get_transaction().set("previous_champion", previous)
    return previous


@promote.on_rollback
def _demote(txn) -> None:
    config = txn.get("config")
    client, _ = tracking.client_for(config.publish, Path.cwd())
    tracking.restore_champion(client, config.publish.model_name, txn.get("previous_champion"), txn.get("version"))


@flow(name="monthly-release", log_prints=True)
def monthly_release(month: str | None = None, dry_run: bool | None = None, force: bool | None = None,
                    overrides: dict[str, Any] | None = None) -> dict:
    """Reproduce this month's stages, gate the candidate, record it, and publish it if every gate passed.

    DVC stages read ``params.yaml``: a run with other parameters states them there while it runs.

    Args:
        month: The release month, YYYY-MM (empty: the deployment's).
        dry_run: Run and gate everything, publish nothing, move no alias.
        force: Publish again a month that is already published.
        overrides: Other settings of params.yaml by dotted key, e.g. {"gates.min_accuracy_new": 0.97};
            every setting not named keeps the deployment's default.
    """
    defaults, source = run_defaults()
    config = resolve_config(defaults, month, dry_run, force, overrides)  # before any stage: a bad key fails here
    changes = changed_settings(config, defaults)
    get_run_logger().info("settings: %s%s", source,
                          "".join(f"; {key} = {value!r}" for key, value in changes.items()) or ", unchanged")
    with stage_runner.release_lock(Path.cwd()), stage_runner.params_for_run(config, Path.cwd() / stage_runner.PARAMS_FILE) as changed:
        if changed:
            get_run_logger().info("params.yaml states this run's parameters until it ends: %s", ", ".join(changed))
        return _release(config)


def _release(config: ReleaseConfig) -> dict:
    set_up(config)
    # The parent MLflow run opens now, so the MLflow UI shows the release while it runs; `record` finds it.
    with steps.live_run(config, Path.cwd(), str(flow_run.id)) as opened:
        return _stages_gates_publish(config, opened)


def _stages_gates_publish(config: ReleaseConfig, opened: steps.Recorded) -> dict:
    trigger = describe_trigger(FlowRunContext.get().flow_run, flow_run.ui_url)
    runs = []
    for name in stage_runner.stage_names(Path.cwd()):
        if name == steps.PACKAGE_STAGE and not steps.full_gate_report(config)["passed"]:
            break  # the package stage would refuse: nothing is packaged for a failed candidate
        # The gates read the registry's champion, which DVC does not track: always re-evaluate them.
        runs.append(reproduce(name, force=name == steps.GATES_STAGE))
        if runs[-1].reproduced and (placement := steps.placement_line(config, name)):
            get_run_logger().info(placement)
    report = steps.full_gate_report(config)

    existing = steps.already_published(config) if report["passed"] and not config.publish.force else None
    if existing is not None:
        repairs = reconcile(config, existing)
        outcome = f"already published as {existing['release_id']}; " + ("; ".join(repairs) or "nothing to do")
        steps.finish_mlflow_run(config, Path.cwd(), opened, "FINISHED", outcome)
        summarize(config, runs, report, None, outcome)
        return {"outcome": outcome, "release_id": existing["release_id"], "published": False}

    recorded = record(config, runs, report)
    if not report["passed"]:
        reason = failed_reason(report)
        steps.finish_mlflow_run(config, Path.cwd(), recorded, "FAILED", f"gates failed: {reason}")
        outcome = "FAILED: a gate did not pass"
        summarize(config, runs, report, recorded, outcome, steps.release_notes(config, Path.cwd(), report, recorded, trigger,
                                                                               "refused: a gate did not pass"))
        raise GateFailed(f"release {config.data.month} not published: {reason}")
    if config.publish.dry_run:
        outcome = "dry run: gates passed, nothing published"
        steps.finish_mlflow_run(config, Path.cwd(), recorded, "FINISHED", outcome)
        summarize(config, runs, report, recorded, outcome, steps.release_notes(config, Path.cwd(), report, recorded,
                                                                                trigger, outcome))
        return {"outcome": "dry run", "mlflow_run_id": recorded.run_id, "published": False}

    # Registry commit + tag + remote push, pipeline outputs pushed, champion moved: all or nothing.
    notes = steps.release_notes(config, Path.cwd(), report, recorded, trigger,
                                  f"published as champion (MLflow model version {recorded.version})")
    with transaction() as txn:
        txn.set("config", config)
        txn.set("registry", config.publish.registry_dir)
        txn.set("version", recorded.version)
        published = publish_to_registry(config, recorded, notes)
        push_pipeline_outputs()
        if not published.already:  # the registry already names an identical release: its version stays champion
            promote(config, recorded)
    sign_update_channel(config)  # idempotent; a rerun after a crash here signs it (``steps.reconcile_published``)
    steps.finish_mlflow_run(config, Path.cwd(), recorded, "FINISHED", f"published {published.release_id}")
    summarize(config, runs, report, recorded, f"published {published.release_id} as champion", notes)
    return {"outcome": "published", "release_id": published.release_id, "mlflow_run_id": recorded.run_id,
            "model_version": recorded.version, "tag": published.tag, "published": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the monthly adapter release (ephemeral Prefect).")
    parser.add_argument("--params", default="params.yaml",
                        help="the run's parameters; written into ./params.yaml, which the DVC stages read")
    args = parser.parse_args(argv)
    try:
        with naming_the_startup_timeout():
            result = monthly_release(**flow_parameters(load_config(args.params), ReleaseConfig()))
    except (GateFailed, StageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ServerStartupTimeout as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(result["outcome"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
