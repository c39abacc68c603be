"""The compile stage: one export per backbone, a verified interface, nothing half-written."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
from engine_testkit import make_model, tiny_engine, tiny_qwen  # noqa: F401  (fixtures)
from project_testkit import ENV, repeated_lines

import tasks.stages.compile as compile_stage
from runtime.engine.hashing import backbone_hash
from runtime.engine.interface import LOGIT_POSITIONS_INTERFACE_VERSION, read_interface
from tasks.stages.compile import compile_engine


def test_unchanged_backbone_is_a_cache_hit_with_no_export(tiny_qwen, tiny_engine, tmp_path, monkeypatch):
    def no_export(*args, **kwargs):
        raise AssertionError("export must not run on a cache hit")

    monkeypatch.setattr(compile_stage, "export_backbone", no_export)
    metrics = compile_engine(tiny_qwen, tiny_engine, metrics_path=tmp_path / "engine.json")

    assert metrics["engine_builds"] == 0 and metrics["cache_hit"] is True
    assert json.loads((tmp_path / "engine.json").read_text())["engine_builds"] == 0


def test_interface_records_the_contract(tiny_qwen, tiny_engine):
    iface = read_interface(tiny_engine)
    spec = json.loads((tiny_engine / "interface.json").read_text())
    graph = onnx.load(str(tiny_engine / "model.onnx"))

    assert spec["version"] == LOGIT_POSITIONS_INTERFACE_VERSION and spec["interface_hash"] == iface.interface_hash
    assert iface.backbone_hash == backbone_hash(tiny_qwen)
    assert iface.max_rank == 8 and iface.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert iface.kv_layout == "B,num_kv_heads,past_len,head_dim" and iface.kv_dtype == "float32"
    assert spec["exporter"]["torch"].startswith("2.13")
    shapes = {t.name: t.shape for t in iface.inputs}
    assert shapes["past_key.1"] == ("batch", 2, "past", 16)
    # q/k/v share one A (3 x rank 8) and one block-diagonal B over their 64 + 32 + 32 outputs; o_proj has its own
    assert shapes["lora_A.1.q_proj+k_proj+v_proj"] == (24, 64) and shapes["lora_B.1.q_proj+k_proj+v_proj"] == (128, 24)
    assert shapes["lora_A.0.o_proj"] == (8, 64) and shapes["lora_B.0.o_proj"] == (64, 8)
    assert [i.name for i in graph.graph.input] == iface.input_names
    past = next(i for i in graph.graph.input if i.name == "past_value.0").type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in past] == ["batch", 2, "past", 16]
    assert len(iface.inputs) == 3 + 2 * 2 + 2 * 2 * 2 + 1  # ids/positions/mask, K/V, LoRA A/B, logit positions


def test_changed_backbone_rebuilds_the_engine(tiny_qwen, tiny_engine, tmp_path):
    other = make_model(tmp_path / "other", "qwen2", seed=11)
    engine_dir = tmp_path / "engine"
    compile_engine(tiny_qwen, engine_dir, max_rank=4, target_modules=("q_proj", "v_proj"))

    metrics = compile_engine(other, engine_dir, max_rank=4, target_modules=("q_proj", "v_proj"))

    assert metrics["engine_builds"] == 1 and metrics["cache_hit"] is False
    assert read_interface(engine_dir).backbone_hash == backbone_hash(other)


def test_failed_export_leaves_no_half_written_engine(tiny_qwen, tmp_path, monkeypatch):
    def broken_export(model_dir, onnx_path, *args, **kwargs):
        onnx_path.write_bytes(b"partial")
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(compile_stage, "export_backbone", broken_export)
    with pytest.raises(RuntimeError, match="exporter crashed"):
        compile_engine(tiny_qwen, tmp_path / "engine")

    assert list(tmp_path.iterdir()) == []


def _locations(onnx_file) -> set[str]:
    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    return {e.value for i in graph.initializer for e in i.external_data if e.key == "location"}


def test_large_backbone_is_exported_with_its_weights_beside_every_graph(tiny_qwen, tiny_engine, tmp_path, monkeypatch):
    # Given: a size threshold every backbone exceeds, as the 0.5B shape exceeds the real one
    # (protobuf caps one file at 2 GiB; its float graph is 1.98 GB before ORT's optimization adds to it)
    import numpy as np

    from runtime.engine.backends import onnxruntime as ort_backend

    monkeypatch.setattr(ort_backend, "EXTERNAL_DATA_MIN_BYTES", 0)

    # When: the engine is compiled
    compile_engine(tiny_qwen, tmp_path / "engine")

    # Then: the exported graph and the optimized one each read their weights from their own data
    # file, the export passes the checker by path, and the engine computes what the one-file engine does
    engine_dir = tmp_path / "engine"
    assert _locations(engine_dir / "model.onnx") == {"model.onnx.data"}
    assert _locations(engine_dir / ort_backend.OPTIMIZED_ONNX) == {ort_backend.OPTIMIZED_ONNX_DATA}
    onnx.checker.check_model(str(engine_dir / "model.onnx"))
    ids = np.random.default_rng(3).integers(0, 96, (1, 7))
    args = (ids, np.arange(7)[None], np.ones((1, 7), np.int64), None)
    want = ort_backend.OrtEngine(tiny_engine).forward(*args)[0]
    np.testing.assert_array_equal(ort_backend.OrtEngine(engine_dir).forward(*args)[0], want)


# The stage as DVC runs it, then a warning from the exporter's optimizer after the stage set up its logging.
COMPILE_THEN_WARN = """
import logging, sys
from tasks.stages.compile import main
code = main(["--params", "params.yaml"])
logging.getLogger("onnxscript.rewriter").warning("a warning from onnxscript")
sys.exit(code)
"""


def test_the_compile_stage_prints_each_line_once_and_keeps_warnings(tiny_qwen, tmp_path):
    # Given: a release of the tiny backbone with the default serving engine: two exports (float, and quantized
    # pages with stacked adapters), as in `make release`
    (tmp_path / "params.yaml").write_text(f"base_model:\n  source: local\n  path: {tiny_qwen}\n")

    # When: the compile stage runs in its own process
    done = subprocess.run([sys.executable, "-c", COMPILE_THEN_WARN], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=600)

    # Then: every engine is built, no log line is printed twice (the exporter's per-export progress and the
    # optimizer's INFO chatter were), the stage's own lines are there, and a warning still gets through
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert repeated_lines(done.stderr) == {}, output[-4000:]  # stdout is the result's JSON, whose keys repeat per engine
    assert json.loads(done.stdout)["engine_builds"] == 2  # stdout: the stage's result alone
    assert sum(" engine built in " in line for line in output.splitlines()) == 2, output[-4000:]
    assert output.count("a warning from onnxscript") == 1, output[-4000:]


def test_the_cache_key_of_a_pages_engine_records_the_opset_it_is_built_at():
    from kernels.kv_spec import PageQuantSpec
    from kernels.page_quant import READ_OPSET

    pages = PageQuantSpec(k_bits=4, v_bits=4, v_group_size=16).to_dict()
    assert compile_stage.cache_key("h", 8, ("q_proj",), 18, 16, kv_pages=pages)["opset"] == READ_OPSET == 21
    assert compile_stage.cache_key("h", 8, ("q_proj",), 18, 16)["opset"] == 18  # a float paged engine: as asked
