"""What the monthly flow does between DVC stages: read the gates, record the run, publish, summarize.

``flows/monthly_release.py`` only wires these together as Prefect tasks; every decision lives
here so it can be tested without Prefect. The stages themselves are ``dvc.yaml``'s.
"""

from __future__ import annotations

import contextlib
import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.adapter_config import ADAPTER_WEIGHTS
from runtime.engine.hashing import sha256_file
from runtime.release.contract import MANIFEST, release_tag
from tasks.config import ReleaseConfig
from tasks.gate_rules import accuracy_measure, gate_report, package_gates, render_gate_table, scored_metrics
from tasks.layout import KV_DISABLED_FILE, KV_PAGES_FILE
from tasks.models import CARD
from tasks.plots import KV_BITS_PNG, KV_GRID_CSV, LATENCY_CSV, LATENCY_PNG, LOSS_CSV, LOSS_PNG, VAL_LOSS_CSV
from tasks.release.stage_runner import StageRun, push_outputs

GATES_STAGE, PACKAGE_STAGE = "gates", "package"
SUMMARY_KEY = "monthly-release-summary"  # stable Prefect artifact key: the UI shows its history


@dataclass(frozen=True)
class Recorded:
    run_id: str
    experiment_id: str
    version: str | None  # registered model version; None when the candidate was not registered
    tracking_uri: str


def full_gate_report(cfg: ReleaseConfig) -> dict:
    """The evaluation gates (``gates/gates.json``), plus the package gates once the package exists."""
    evaluation = json.loads(cfg.layout.gates_file.read_text())
    check = cfg.layout.package_check_file
    if not check.exists():
        return evaluation | {"packaged": False}
    from tasks.gate_rules import Gate

    gates = [Gate(**g) for g in evaluation["gates"]] + package_gates(json.loads(check.read_text()), cfg.gates)
    carried = {key: evaluation.get(key) for key in ("champion", "accuracy_measure")}
    return gate_report(gates) | carried | {"packaged": True}


def engine_builds(cfg: ReleaseConfig, runs: list[StageRun]) -> int:
    """1 if this run compiled the engine, 0 if it reused the one built for this backbone before."""
    ran = any(r.name == "compile" and r.reproduced for r in runs)
    return int(ran and json.loads(cfg.layout.engine_build_file.read_text()).get("engine_builds", 0))


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def stage_outputs(cfg: ReleaseConfig, stage: str) -> tuple[dict[str, float], list[Path]]:
    """The metrics (numeric leaves of the stage's JSON outputs) and files to attach to a stage's MLflow run."""
    from tasks.release.tracking import flatten_numbers

    layout = cfg.layout
    finetune, evaluation = layout.finetune_dir, layout.eval_dir
    files = {
        "base_model": ([layout.base_model_dir / CARD], []),
        "compile": ([layout.engine_build_file], []),
        "finetune": ([finetune / "train_metrics.json"], [finetune / LOSS_PNG, finetune / LOSS_CSV, finetune / VAL_LOSS_CSV]),
        "calibrate": ([], [layout.kv_dir / KV_PAGES_FILE, layout.kv_dir / KV_DISABLED_FILE]),
        "evaluate": ([layout.metrics_file], [evaluation / "report.md", *(evaluation / name for name in (
            LATENCY_CSV, LATENCY_PNG, KV_GRID_CSV, KV_BITS_PNG))]),
        "gates": ([], [layout.gates_file]),
        "package": ([layout.package_check_file], [layout.package_release_dir / MANIFEST]),
    }
    json_files, artifacts = files.get(stage, ([], []))
    metrics: dict[str, float] = {}
    for path in json_files:
        metrics |= flatten_numbers(_read(path))
    return metrics, [p for p in artifacts if p.exists()]


def stage_tags(cfg: ReleaseConfig, stage: str) -> dict[str, str]:
    """Where a stage's PyTorch side ran (``tasks/device.py``), as tags of its MLflow run."""
    if stage == "finetune":
        trained = _read(cfg.layout.finetune_dir / "train_metrics.json")
        return {key: str(trained[key]) for key in ("device", "precision", "processes") if key in trained}
    if stage == "evaluate" and "torch_device" in (metrics := _read(cfg.layout.metrics_file)):
        return {"device": metrics["torch_device"]}
    return {}


def placement_line(cfg: ReleaseConfig, stage: str) -> str | None:
    """Where a stage's PyTorch side ran, as a line of the flow's log; None for a stage without one.

    The fine-tune stage prints its choice and the reason to the console only, which a deployment's run
    page does not show."""
    tags = stage_tags(cfg, stage)
    return f"{stage} ran on " + ", ".join(f"{key} {value}" for key, value in tags.items()) if tags else None


def _steps(path: Path) -> list[tuple[int, float]]:
    """(step, value) rows of a loss CSV: the step column, then the value column."""
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))[1:]
    return [(int(step), float(value)) for step, value in rows]


def stage_histories(cfg: ReleaseConfig, stage: str) -> dict[str, list[tuple[int, float]]]:
    """Per-step metric histories of a stage's run: the training losses its CSVs hold."""
    if stage == "finetune":
        found = {"train_loss": _steps(cfg.layout.finetune_dir / LOSS_CSV),
                 "val_loss": _steps(cfg.layout.finetune_dir / VAL_LOSS_CSV)}
    elif stage == "base_model":  # the embedded base's pre-training; a user's checkpoint has none
        found = {"pretrain_loss": _steps(Path(cfg.base_model.path) / f"pretrain_{LOSS_CSV}")}
    else:
        found = {}
    return {name: points for name, points in found.items() if points}


def headline_metrics(cfg: ReleaseConfig, runs: list[StageRun], report: dict) -> dict[str, float]:
    """The numbers a reviewer compares month to month, on the parent run."""
    metrics = _read(cfg.layout.metrics_file)
    scored = scored_metrics(metrics)
    kv = metrics.get("kv_cache", {})
    latency = scored.get("decode_latency", {})
    check = _read(cfg.layout.package_check_file)
    out = {
        "accuracy": scored.get("accuracy"),
        "accuracy_new": scored.get("accuracy_new"),
        "accuracy_regression": scored.get("accuracy_regression"),
        "perplexity": scored.get("perplexity"),
        "base_accuracy_new": metrics.get("base", {}).get("accuracy_new"),
        "kv_accuracy_drop": kv.get("accuracy_drop"),
        "kv_ppl_increase_pct": kv.get("ppl_increase_pct"),
        "kv_bytes_per_token": kv.get("bytes_per_token"),
        "kv_compression_vs_fp16": kv.get("compression_vs_fp16"),
        "decode_p50_ms": latency.get("p50_ms"),
        "decode_p95_ms": latency.get("p95_ms"),
        "decode_step_ratio": latency.get("step_ratio"),
        "engine_max_abs_logit_diff": metrics.get("engine_parity", {}).get("max_abs_logit_diff"),
        "engine_max_logit_error": metrics.get("engine_parity", {}).get("max_logit_error"),
        "engine_max_kl": metrics.get("engine_parity", {}).get("max_kl"),
        "package_bytes": check.get("package_bytes"),
        "package_pct_of_base": check.get("pct_of_base"),
        "engine_builds": engine_builds(cfg, runs),
        "stages_reproduced": sum(r.reproduced for r in runs),
        "gates_passed": float(report["passed"]),
    }
    return {k: float(v) for k, v in out.items() if v is not None}


def record_in_mlflow(cfg: ReleaseConfig, root: Path, runs: list[StageRun], report: dict, flow_run: str | None) -> Recorded:
    """Parent run, nested stage runs, gate metrics, and a candidate model version (packaged candidates)."""
    from tasks.provenance import git_revision
    from tasks.release import tracking

    client, experiment_id = tracking.client_for(cfg.publish, root)
    parent = tracking.start_release_run(client, experiment_id, cfg, git_revision(root)["git_revision"], flow_run)
    for run in runs:
        metrics, artifacts = stage_outputs(cfg, run.name)
        tracking.log_stage_run(client, experiment_id, parent, run.name, run.reproduced, run.seconds, metrics, artifacts,
                               stage_histories(cfg, run.name), run.started, run.ended, stage_tags(cfg, run.name))
    gate_metrics = {}
    for g in report["gates"]:
        gate_metrics[f"gate.{g['name']}.passed"] = float(g["passed"])
        if isinstance(g["value"], (int, float)):
            gate_metrics[f"gate.{g['name']}.value"] = float(g["value"])
        if isinstance(g["threshold"], (int, float)):
            gate_metrics[f"gate.{g['name']}.threshold"] = float(g["threshold"])
    tracking.log_metrics(client, parent, headline_metrics(cfg, runs, report) | gate_metrics)
    # The fine-tuning curves on the parent too, where a reviewer opens the release (once: a retry adds no point).
    for name, points in stage_histories(cfg, "finetune").items():
        if not client.get_metric_history(parent, name):
            tracking.log_history(client, parent, name, points)
    client.log_text(parent, render_gate_table(report), "gate_report.md")
    client.log_dict(parent, report, "gate_report.json")
    version = None
    if report.get("packaged"):
        client.log_artifacts(parent, str(cfg.layout.package_release_dir), "package")
        source = f"{client.get_run(parent).info.artifact_uri}/package"
        manifest = _read(cfg.layout.package_release_dir / MANIFEST)
        version = tracking.register_candidate(client, cfg.publish.model_name, parent, source, {
            "month": cfg.data.month,
            "release_id": str(manifest.get("release_id")),
            "gates_passed": str(report["passed"]),
        })
        client.set_tag(parent, "model_version", version)
    client.set_tag(parent, "gates_passed", str(report["passed"]))
    if "accuracy_measure" in report:  # which accuracy the gates read: changed_rules or overall
        client.set_tag(parent, "accuracy_measure", report["accuracy_measure"])
    return Recorded(parent, experiment_id, version, client.tracking_uri)


@contextlib.contextmanager
def live_run(cfg: ReleaseConfig, root: Path, flow_run: str | None) -> Iterator[Recorded]:
    """The release's parent MLflow run, open (RUNNING, with system metrics) while the block runs.

    Opened when the flow starts, so the MLflow UI shows a run in progress; ``record_in_mlflow``
    finds it again by the flow run's tag. A block that raises leaves it FAILED with the error; one
    that returns without finishing it (nothing to record) leaves it FINISHED.
    """
    from tasks.provenance import git_revision
    from tasks.release import tracking

    client, experiment_id = tracking.client_for(cfg.publish, root)
    run_id = tracking.start_release_run(client, experiment_id, cfg, git_revision(root)["git_revision"], flow_run)
    opened = Recorded(run_id, experiment_id, None, client.tracking_uri)
    try:
        with tracking.system_metrics(run_id, client.tracking_uri):
            yield opened
    except BaseException as err:
        if client.get_run(run_id).info.status == "RUNNING":
            finish_mlflow_run(cfg, root, opened, "FAILED", f"{type(err).__name__}: {err}")
        raise
    if client.get_run(run_id).info.status == "RUNNING":
        finish_mlflow_run(cfg, root, opened, "FINISHED", "nothing recorded")


def finish_mlflow_run(cfg: ReleaseConfig, root: Path, recorded: Recorded, status: str, note: str) -> None:
    from tasks.release import tracking

    client, _ = tracking.client_for(cfg.publish, root)
    client.set_tag(recorded.run_id, "outcome", note[:5000])
    client.set_terminated(recorded.run_id, status)


def registry_entry(cfg: ReleaseConfig, recorded: Recorded | None) -> dict:
    """What ``releases/index.json`` says of this release (and the champion gate reads next month)."""
    release = cfg.layout.package_release_dir
    manifest = _read(release / MANIFEST)
    headline = _read(cfg.layout.metrics_file)
    scored = scored_metrics(headline)
    return {
        "release_id": manifest.get("release_id", cfg.data.month),
        "adapter_sha256": sha256_file(release / ADAPTER_WEIGHTS),
        "accuracy_measure": accuracy_measure(scored),
        "accuracy": scored.get("accuracy"),
        "accuracy_new": scored.get("accuracy_new"),
        "accuracy_regression": scored.get("accuracy_regression"),
        "mlflow_run_id": recorded.run_id if recorded else None,
        "mlflow_version": recorded.version if recorded else None,
    }


def already_published(cfg: ReleaseConfig) -> dict | None:
    """The registry's entry for this month if it holds this very package (same adapter bytes)."""
    from tasks.release.registry import read_index, tag_exists

    registry = Path(cfg.publish.registry_dir)
    entry = read_index(registry, cfg.data.product).get(cfg.data.month)
    adapter = cfg.layout.package_release_dir / ADAPTER_WEIGHTS
    if entry is None or not adapter.exists() or not tag_exists(registry.resolve(),
                                                               release_tag(cfg.data.month, cfg.data.product)):
        return None
    return entry if entry.get("adapter_sha256") == sha256_file(adapter) else None


def reconcile_published(cfg: ReleaseConfig, root: Path, entry: dict) -> list[str]:
    """Finish what a run killed mid-publication left undone; return what was repaired.

    The registry commit is the point of no return: once it names the month, a rerun pushes its
    files again (idempotent) and moves the MLflow ``champion`` to the version the registry names.
    """
    from tasks.release import registry, tracking, update_channel

    repairs = []
    registry_dir = Path(cfg.publish.registry_dir)
    registry.push_release(registry_dir, cfg.data.month, cfg.data.product)
    push_outputs(root)
    if update_channel.publish_from_registry(cfg.publish, cfg.data.month, product=cfg.data.product):
        repairs.append(f"{cfg.data.month} and the registry's champion signed into the update channel {cfg.publish.tuf_dir}")
    version = entry.get("mlflow_version")
    if registry.read_channels(registry_dir, cfg.data.product).get("champion") == cfg.data.month and version:
        client, _ = tracking.client_for(cfg.publish, root)
        if tracking.alias_version(client, cfg.publish.model_name, tracking.CHAMPION) != str(version):
            tracking.move_champion(client, cfg.publish.model_name, str(version))
            repairs.append(f"MLflow champion moved to version {version}, as the registry names it")
    return repairs


def release_notes(cfg: ReleaseConfig, root: Path, report: dict, recorded: Recorded, trigger: dict, outcome: str) -> str:
    """This month's release notes (``tasks/release/notes.py``) with the run's MLflow run and git revision."""
    from tasks.provenance import git_revision
    from tasks.release.notes import render_release_notes

    return render_release_notes(cfg, root, report, outcome, trigger, recorded.run_id, git_revision(root)["git_revision"])


def summary_markdown(cfg: ReleaseConfig, runs: list[StageRun], report: dict, recorded: Recorded | None,
                     outcome: str, notes: str | None = None) -> str:
    """The run summary Prefect shows as an artifact: outcome, gates, metrics, where things are, the release notes."""
    lines = [f"# Monthly release {cfg.data.month}: {outcome}", ""]
    lines += ["## Gates", ""]
    if report.get("accuracy_measure") == "overall":
        lines += ["Accuracy is gated overall: the month's rows carry no `changed` field.", ""]
    elif report.get("accuracy_measure") == "changed_rules":
        lines += ["Accuracy is gated on the rules changed this month and on the unchanged ones (regression).", ""]
    lines += [render_gate_table(report)]
    metrics = headline_metrics(cfg, runs, report)
    lines += ["## Metrics", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.6g} |" for k, v in sorted(metrics.items())]
    lines += ["", "## Stages", "", "| stage | ran | seconds |", "|---|---|---|"]
    lines += [f"| {r.name} | {'yes' if r.reproduced else 'up to date'} | {r.seconds:.1f} |" for r in runs]
    lines += ["", "## Where", ""]
    if recorded is not None:
        lines.append(f"- MLflow run `{recorded.run_id}` (experiment {recorded.experiment_id}) in `{recorded.tracking_uri}`; "
                     f"browse with `mlflow ui --backend-store-uri {recorded.tracking_uri}`")
        if recorded.version:
            lines.append(f"- model `{cfg.publish.model_name}` version {recorded.version}")
    lines.append(f"- release directory `{cfg.layout.package_release_dir}`; registry `{Path(cfg.publish.registry_dir).resolve()}` "
                 f"tag `{release_tag(cfg.data.month, cfg.data.product)}`")
    if notes is not None:
        lines += ["", re.sub(r"^(#+) ", r"#\1 ", notes, flags=re.MULTILINE)]  # a section of the summary
    return "\n".join(lines) + "\n"
