"""The real-size bench's own parts: its params, its per-stage measurement, its size rules (nothing heavy runs)."""

import json
import os
import shutil
import subprocess
import sys

from bench.flow.scale_bench import (
    OPEN_GATES,
    PROTOBUF_CAP,
    STAGE_HOOK,
    figures,
    onnx_files,
    run_measured,
    targets,
    write_params,
)
from bench.lib.report import REPO


def test_params_run_the_local_backbone_on_a_short_schedule_with_open_quality_gates(tmp_path):
    # Given: the project's params.yaml and a backbone folder outside the pipeline's outputs
    from tasks.config import load_config

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "params.yaml", project / "params.yaml")
    model = tmp_path / "model"

    # When: the bench writes its params file
    write_params(project, model, tmp_path / "params.yaml")

    # Then: it is a valid config of the short month on that backbone, quality gates open, size gate kept
    cfg = load_config(tmp_path / "params.yaml")
    assert (cfg.base_model.source, cfg.base_model.path) == ("local", str(model))
    assert (cfg.data.train_size, cfg.data.test_size, cfg.train.steps, cfg.engine.weights) == (64, 32, 4, "int4")
    assert cfg.gates.min_accuracy_new == 0.0 and cfg.gates.max_decode_step_ratio == OPEN_GATES["max_decode_step_ratio"]
    assert cfg.gates.max_package_pct_of_base == load_config(REPO / "params.yaml").gates.max_package_pct_of_base


def test_stage_hook_records_each_stage_process_and_nothing_else(tmp_path):
    # Given: the hook on the path of two processes, one a stage command, one not
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(STAGE_HOOK)
    log = tmp_path / "stages.jsonl"
    env = os.environ | {"PYTHONPATH": str(tmp_path / "hook"), "SCALE_BENCH_STAGE_LOG": str(log)}

    # When: both run to their end
    subprocess.run([sys.executable, "-m", "tasks.stages.gates", "--help"], cwd=REPO, env=env, check=True, capture_output=True)
    subprocess.run([sys.executable, "-c", "pass"], cwd=REPO, env=env, check=True)

    # Then: only the stage wrote its line, with its wall time and a peak RSS of a real Python process
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["stage"] for r in records] == ["gates"]
    assert records[0]["seconds"] > 0 and records[0]["peak_rss_bytes"] > 10 * 2**20


def test_peak_rss_of_a_run_includes_its_descendants(tmp_path):
    # A child that holds 300 MB while its parent stays small: the run's peak is the child's
    child = "import numpy; a = numpy.ones(300 * 2**20 // 8)"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"

    run = run_measured([sys.executable, "-c", code], tmp_path, dict(os.environ), tmp_path / "log", timeout=120)

    assert run["returncode"] == 0 and not run["timed_out"]
    assert run["peak_rss_bytes"] > 300 * 2**20


def test_only_protobuf_graphs_count_against_the_2_gib_cap(tmp_path):
    # external data files are raw bytes: a 2.5 GB one is fine, a graph of that size is not
    (tmp_path / "model.onnx").write_bytes(b"x" * 100)
    with open(tmp_path / "model.onnx.data", "wb") as fh:
        fh.truncate(PROTOBUF_CAP + 1)
    (tmp_path / "interface.json").write_text("{}")

    info = onnx_files(tmp_path)

    assert info["files"] == {"model.onnx": 100, "model.onnx.data": PROTOBUF_CAP + 1}
    assert info["largest_protobuf_bytes"] == 100 and info["protobuf_under_cap"]


def test_the_figures_are_the_targets_then_every_engines_decode():
    payload = {"flow": {"returncode": 0, "seconds": 1800.0, "peak_rss_bytes": 6e9, "stages": {}}, "package": {},
               "decode": {"ort_int4": {"median_ms": 20.0}, "llama_q4_0_lora": {"median_ms": 25.0}},
               "comparisons": [{"ours": "ort_int4", "peer": "llama_q4_0_lora", "ratio": 0.8}], "past": 512}
    payload["targets"] = targets(payload)
    stated = {f.name: f.text for f in figures(payload)}
    assert stated["Qwen2-0.5B shape: flow_minutes (target <= 60.0)"] == "30.0 (met)"
    assert stated["Qwen2-0.5B shape: int4_vs_q4_0 (target <= 1.0)"] == "0.8 (met)"
    assert stated["Qwen2-0.5B shape: decode ms/token after a past of 512, llama_q4_0_lora"] == "25.0 ms"
