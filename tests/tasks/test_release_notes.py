"""Release notes read from the stage outputs: the champion comparison, quantization, latency, package, provenance,
and for a refused candidate the gate that failed with its value and threshold."""

import uuid

import pytest

from tasks.artifacts import write_json
from tasks.config import ReleaseConfig
from tasks.gate_rules import Gate, gate_report
from tasks.release.notes import describe_trigger, render_release_notes

TRIGGER = {"by": "the deployment's schedule", "flow_run": "brave-otter (1234)", "url": "http://127.0.0.1:4200/runs/flow-run/1234"}


def write(path, payload):
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, payload)


@pytest.fixture
def cfg(tmp_path):
    cfg = ReleaseConfig.model_validate({"data": {"month": "2026-12", "dir": str(tmp_path / "data")},
                                        "train": {"output_dir": str(tmp_path / "artifacts")}})
    scored = {"accuracy": 0.99, "accuracy_new": 0.98, "accuracy_regression": 1.0,
              "decode_latency": {"p10_ms": 1.1, "p50_ms": 1.25, "p95_ms": 2.5, "steps": 256, "reference_p10_ms": 0.8,
                                 "step_ratio": 1.375, "loadavg_1m": [0.4, 0.6], "threads": 1}}
    write(cfg.layout.metrics_file, {
        "month": "2026-12", "changed_rules": ["bridge", "shift"], "adapter": {"count": 600, "perplexity": 5.25},
        "base": {"perplexity": 5.0}, "adapter_on_engine": scored,
        "kv_cache": {"accuracy_drop": 0.005, "ppl_increase_pct": 0.25, "bytes_per_token": 617.03, "compression_vs_fp16": 4.0,
                     "grid": [{"config": "release (K4/V4 pages g64)"}], "on_engine": {"accuracy_drop": 0.0, "ppl_increase_pct": -0.5}},
    })
    return cfg


def gates(passed: bool) -> dict:
    return gate_report([
        Gate("accuracy_new", 0.98, 0.95, ">=", True, "changed rules"),
        Gate("decode_p95_ms", 2.5, 1.0 if not passed else 50.0, "<=", passed, "one decode step"),
    ])


def test_published_notes_compare_with_the_champion_and_name_the_run(cfg, tmp_path):
    report = gates(True) | {"champion": {"month": "2026-11", "accuracy_new": 0.96, "accuracy_regression": 1.0,
                                         "accuracy": 0.985}}
    write(cfg.layout.package_check_file, {"package_bytes": 123_456, "pct_of_base": 1.5, "base_bytes": 8_230_400})
    notes = render_release_notes(cfg, tmp_path, report, "published as champion", TRIGGER, "run-abc", "deadbeef")
    assert notes.startswith("# Release notes 2026-12\n\n**published as champion**")
    assert "Rules changed since the base model's rule book (2026-10): bridge, shift." in notes
    assert "| metric | this candidate | champion 2026-11 | change |" in notes
    assert "| accuracy, changed rules | 98.0% | 96.0% | +2.0 points |" in notes
    assert "| accuracy, unchanged rules | 100.0% | 100.0% | +0.0 points |" in notes
    assert "KV cache, release (K4/V4 pages g64): accuracy -0.50 points, held-out perplexity +0.25%" in notes
    assert "(on the engine: +0.00 points, -0.50%); 617 bytes per token, 4.00x fewer than fp16." in notes and "Weights: fp32 (not quantized)." in notes
    assert "KV calibration" not in notes  # the pages calibrate nothing: a release ships no KV scales
    assert ("p50 1.25 ms, p95 2.50 ms over 256 steps (1-minute load average 0.4 -> 0.6); 10th percentiles 1.10 ms "
            "against 0.80 ms for the float engine's step timed beside it, 1.38x (gate: <= 2.5x).") in notes
    assert "Held-out perplexity 5.000 for the base, 5.250 with the adapter: +5.00% (gate: <= +10.0%)." in notes
    assert "123,456 bytes, 1.5% of the base model's 8,230,400 bytes." in notes
    assert f"Triggered by the deployment's schedule; flow run brave-otter (1234): {TRIGGER['url']}." in notes
    assert "MLflow run `run-abc`" in notes and "git revision `deadbeef`" in notes
    assert "Refused" not in notes


def test_the_notes_name_the_rules_changed_since_the_champions_month(cfg, tmp_path):
    from tasks.config import DataConfig
    from tasks.inspection import rulebook
    from tasks.stages.data import generate_month

    small = {"train_size": 16, "val_size": 8, "calib_size": 8, "test_size": 16, "heldout_lines": 4}
    for month in ("2026-11", "2026-12"):
        generate_month(DataConfig(month=month, **small), "2026-10", tmp_path / "data" / month)
    before, after = (rulebook(m, DataConfig().seed, DataConfig().rules_changed_per_month) for m in ("2026-11", "2026-12"))
    changed = sorted(name for name in after if after[name] != before[name])
    assert changed  # each month edits some rules
    report = gates(True) | {"champion": {"month": "2026-11", "accuracy_new": 0.96}}
    notes = render_release_notes(cfg, tmp_path, report, "published", TRIGGER, "run-abc", "deadbeef")
    line = next(x for x in notes.splitlines() if x.startswith("- Rules changed since the champion (2026-11): "))
    assert [part.split(":")[0] for part in line.split(": ", 1)[1].rstrip(".").split("; ")] == changed


def test_a_refused_candidate_names_the_failed_gate_its_value_and_threshold(cfg, tmp_path):
    notes = render_release_notes(cfg, tmp_path, gates(False) | {"champion": None}, "refused", TRIGGER, "run-abc", "deadbeef")
    assert "Refused by the gates: decode_p95_ms = 2.5 (needs <= 1: one decode step)." in notes
    assert "No champion before this one" in notes and "## Package" not in notes


def test_the_trigger_says_schedule_person_or_local_run():
    from prefect.client.schemas.objects import CreatedBy, FlowRun

    def run(**fields):
        return FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4(), **fields)

    scheduled = run(auto_scheduled=True, deployment_id=uuid.uuid4())
    assert describe_trigger(scheduled, "http://ui/runs/1") == {
        "by": "the deployment's schedule", "flow_run": f"brave-otter ({scheduled.id})", "url": "http://ui/runs/1"}
    assert describe_trigger(run(deployment_id=uuid.uuid4()), None)["by"].startswith("a person: a run of the deployment")
    assert describe_trigger(scheduled, "None/flow-runs/flow-run/1")["url"] is None  # ephemeral Prefect has no UI
    by_user = run(deployment_id=uuid.uuid4(), created_by=CreatedBy(type="USER", display_value="ana@example.com"))
    assert describe_trigger(by_user, None)["by"] == "ana@example.com (user), by hand"
    assert "make release" in describe_trigger(run(), None)["by"]


def test_the_summary_artifact_carries_the_notes_as_its_last_section(cfg, tmp_path):
    from tasks.release.steps import summary_markdown

    report = gates(False) | {"champion": None}
    notes = render_release_notes(cfg, tmp_path, report, "refused", TRIGGER, "run-abc", "deadbeef")
    summary = summary_markdown(cfg, [], report, None, "FAILED: a gate did not pass", notes)
    assert summary.startswith("# Monthly release 2026-12: FAILED: a gate did not pass\n")
    notes_section = summary[summary.index("## Release notes 2026-12"):]
    assert "### Against the champion" in notes_section and "Refused by the gates: decode_p95_ms = 2.5" in notes_section


def test_the_notes_say_how_a_mixed_int4_engine_stores_its_weights(cfg, tmp_path):
    import json

    metrics = json.loads(cfg.layout.metrics_file.read_text())
    metrics["weights_gate"] = {"weights": "int4", "max_drop": 0.02, "drops": {"accuracy": 0.0}, "perplexity_ratio": 1.05,
                               "mixed": {"budget_bits": 4.6, "bits_per_weight": 4.5981,
                                         "options": {"int4/b128": 60, "int4/b64": 80, "int4/b32": 0, "int8/b64": 70}}}
    write(cfg.layout.metrics_file, metrics)
    notes = render_release_notes(cfg, tmp_path, gates(True), "published", TRIGGER, None, "deadbeef")
    assert "- Weights int4: accuracy +0.00 points against the float adapter (limit 2.00); perplexity x1.0500." in notes
    assert ("  Stored at 4.60 bits per weight (budget 4.6): parts 60 int4/b128, 80 int4/b64, 70 int8/b64." in notes)


def test_the_notes_name_the_layers_whose_kv_widths_calibration_widened(cfg, tmp_path):
    import json

    metrics = json.loads(cfg.layout.metrics_file.read_text())
    metrics["kv_cache"] |= {"spec": {"k_bits": 2, "v_bits": 2, "v_group_size": 64, "layer_bits": [[2, 2], [4, 2], [2, 3]]},
                            "layer_widths": {"budget": 0.06, "share": 0.01, "kl_sum": 0.021, "tokens": 2048,
                                             "layers": {"0": {"k_bits": 2, "v_bits": 2, "key_kl": 0.004, "value_kl": 0.003},
                                                        "1": {"k_bits": 4, "v_bits": 2, "key_kl": 0.002, "value_kl": 0.006},
                                                        "2": {"k_bits": 2, "v_bits": 3, "key_kl": 0.001, "value_kl": 0.005}}}}
    write(cfg.layout.metrics_file, metrics)
    notes = render_release_notes(cfg, tmp_path, gates(True), "published", TRIGGER, None, "deadbeef")
    assert ("  Widths per layer calibrated on 2,048 tokens of real text, KL budget 6.00e-02 (each layer's keys and values "
            "1.00e-02 alone; summed 2.10e-02): wider in layers 1 K4/V2, 2 K2/V3.") in notes
