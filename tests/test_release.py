"""End to end: the monthly release on the embedded default, as `make release` runs it."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_monthly_release_on_the_embedded_default_learns_the_changed_rules(tmp_path):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"]["dir"] = str(tmp_path / "data")
    raw["base_model"]["path"] = str(tmp_path / "models" / "base")
    raw["train"]["output_dir"] = str(tmp_path / "artifacts")
    raw["engine"]["dir"] = str(tmp_path / "engine")
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw))

    result = subprocess.run(
        [sys.executable, "-m", "tasks.release", "--params", str(params)],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    release = tmp_path / "artifacts" / "2026-11"
    metrics = json.loads((release / "eval" / "metrics.json").read_text())
    base, adapted = metrics["base"], metrics["adapter"]
    assert metrics["changed_rules"] == ["crack", "tombstone"]
    assert base["count_new"] == 150 and base["count_regression"] == 450
    # The base learned last month's book: it gets the changed rules wrong.
    assert base["accuracy_new"] <= 0.60
    # The adapter learns them and keeps the unchanged ones.
    assert adapted["accuracy_new"] >= 0.95
    assert adapted["accuracy_regression"] >= 0.95
    assert adapted["perplexity"] < base["perplexity"]

    # The same adapter on the compiled engine: same answers, logits within fp32 tolerance.
    on_engine, parity = metrics["adapter_on_engine"], metrics["engine_parity"]
    assert on_engine["accuracy_new"] == adapted["accuracy_new"]
    assert parity["prompts"] == 600 and parity["greedy_identical"] is True
    assert parity["max_abs_logit_diff"] <= 1e-4
    compile_metrics = json.loads((release / "compile" / "metrics.json").read_text())
    assert compile_metrics["engine_builds"] == 1
    provenance = json.loads((release / "finetune" / "adapter" / "provenance.json").read_text())
    assert provenance["engine_interface_hash"] == compile_metrics["interface_hash"]

    seconds = json.loads((release / "stage_seconds.json").read_text())
    assert sorted(seconds) == ["base_model", "calibrate", "compile", "data", "evaluate", "finetune"]
    assert sum(seconds.values()) < 600  # the whole release on 2 cores, install excluded
    assert (release / "kv" / "kv_scales.safetensors").exists()

    train = json.loads((release / "finetune" / "train_metrics.json").read_text())
    assert train["adapter_fraction_of_base"] <= 0.02
    assert "| accuracy, new rules |" in (release / "eval" / "report.md").read_text()
