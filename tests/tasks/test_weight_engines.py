"""Weight-quantized engine directories (tasks/weights/engines.py): records, cache keys, the compile stage's copy."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from engine_testkit import tiny_engine, tiny_qwen  # noqa: F401  (fixtures)
from onnx import numpy_helper
from weight_testkit import external_copy

from runtime.engine.backends.onnxruntime import OrtEngine
from tasks.weights.engines import ensure_quantized_engine, quantize_engine_dir
from tasks.weights.graph import DEFAULT_BLOCK_SIZE, WeightQuantError


def test_cache_key_and_record_separate_precisions(tiny_engine, tmp_path):
    keys = {}
    for name, weights, fold in (("fp32", "fp32", False), ("int8", "int8", False), ("int4", "int4", False), ("int4f", "int4", True)):
        quantize_engine_dir(tiny_engine, tmp_path / name, weights, fold_norms=fold)
        keys[name] = json.loads((tmp_path / name / "cache_key.json").read_text())
        assert json.loads((tmp_path / name / "weights.json").read_text())["weights"] == weights
    float_key = json.loads((tiny_engine / "cache_key.json").read_text())

    # A float copy keeps the float key (cached float builds stay valid); each precision gets its own.
    assert keys["fp32"]["key"] == float_key["key"]
    assert len({k["key"] for k in keys.values()}) == 4
    assert keys["int4f"]["weights_fold_norms"] is True and keys["int8"]["backbone_hash"] == float_key["backbone_hash"]
    # Same settings, same key: a rebuild is reproducible and a cache hit stays possible.
    quantize_engine_dir(tiny_engine, tmp_path / "again", "int8")
    assert json.loads((tmp_path / "again" / "cache_key.json").read_text())["key"] == keys["int8"]["key"]


def test_a_different_block_size_is_a_different_build(tiny_engine, tmp_path):
    # given an int4 copy built at the default block size; when the release asks for block 32; then the
    # cached copy is not reused, and asking again for 32 reuses the new one
    first = ensure_quantized_engine(tiny_engine, tmp_path / "engine-int4", "int4")
    assert first["weights_builds"] == 1 and first["weights_record"]["block_size"] == DEFAULT_BLOCK_SIZE == 128
    other = ensure_quantized_engine(tiny_engine, tmp_path / "engine-int4", "int4", block_size=32)
    assert other["weights_builds"] == 1 and other["weights_record"]["block_size"] == 32
    assert ensure_quantized_engine(tiny_engine, tmp_path / "engine-int4", "int4", block_size=32)["weights_builds"] == 0
    # and TensorRT's form of the same codes is another build again
    trt = ensure_quantized_engine(tiny_engine, tmp_path / "engine-int4", "int4", block_size=32, fmt="qdq_fp16")
    assert trt["weights_builds"] == 1 and trt["weights_record"]["format"] == "qdq_fp16"


def test_refuses_unknown_precision_and_bad_block(tiny_engine, tmp_path):
    with pytest.raises(WeightQuantError, match="weights must be one of"):
        quantize_engine_dir(tiny_engine, tmp_path / "a", "int3")
    with pytest.raises(WeightQuantError, match="block_size"):
        quantize_engine_dir(tiny_engine, tmp_path / "b", "int4", block_size=24)
    with pytest.raises(WeightQuantError, match="format must be one of"):
        quantize_engine_dir(tiny_engine, tmp_path / "c", "int4", fmt="gguf")


def test_compile_stage_builds_the_int8_serving_engine_once_inside_the_float_ones_folder(tiny_llama_dir, tmp_path):
    import yaml

    from runtime.engine.interface import read_interface
    from tasks.config import load_config
    from tasks.stages import compile as compile_stage

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "base_model": {"source": "local", "path": str(tiny_llama_dir)},
        "train": {"output_dir": str(tmp_path / "artifacts")},
        "engine": {"dir": str(tmp_path / "engine"), "weights": "int8", "mixed_adapters": False, "threads": 1},
    }))
    cfg = load_config(params)
    first = compile_stage.run_stage(cfg)
    # The float-cache engine (adapters bind to it), the quantized-pages engine, and its int8 copy.
    assert (first["engine_builds"], first["serving_engine"]["engine_builds"], first["weights_builds"]) == (2, 1, 1)
    pages, serving = tmp_path / "engine" / "kvpages-paged16", tmp_path / "engine" / "kvpages-paged16-int8"
    assert cfg.layout.serving_engine_dir == serving
    assert json.loads((serving / "weights.json").read_text())["weights"] == "int8"
    # Same LoRA contract: an adapter bound to the float engine runs on the int8 copy of the quantized-pages one.
    assert read_interface(serving).interface_hash == read_interface(pages).interface_hash
    assert read_interface(serving).float_interface_hash == read_interface(tmp_path / "engine").lora_contract_hash
    # and the interface records what the device runs, outside the hash
    assert read_interface(serving).weights == {"precision": "int8", "format": "matmulnbits", "block_size": 32}
    assert read_interface(serving).weight_precision == "int8" and read_interface(pages).weights is None
    # The codes are GPTQ's (the default method), on real prose and code, and the calibration is part of the key
    record = json.loads((serving / "weights.json").read_text())
    assert record["method"] == "gptq" and record["weights_calibration"]["tokens"] == 16384
    # so the next month reuses the copy as it is; another calibration (more tokens) is another build, and round to
    # nearest another again
    again = compile_stage.run_stage(cfg)
    assert (again["engine_builds"], again["weights_builds"]) == (0, 0)
    more = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"weight_calibration_tokens": 20000})})
    assert compile_stage.run_stage(more)["weights_builds"] == 1
    rtn = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"weight_method": "rtn"})})
    assert compile_stage.run_stage(rtn)["weights_builds"] == 1
    assert json.loads((serving / "weights.json").read_text())["method"] == "rtn"


def test_quantized_weights_are_refused_on_a_backend_that_cannot_run_them():
    from tasks.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"engine: Value error, weights int4 needs backend onnxruntime or tensorrt, not torch"):
        parse_config({"engine": {"weights": "int4", "backend": "torch", "kv_cache": "float"}})


def test_tensorrt_release_gets_the_qdq_serving_engine_from_the_compile_stage(tiny_llama_dir, tmp_path):
    import yaml

    from tasks.config import load_config
    from tasks.stages import compile as compile_stage

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "base_model": {"source": "local", "path": str(tiny_llama_dir)},
        "train": {"output_dir": str(tmp_path / "artifacts")},
        "engine": {"dir": str(tmp_path / "engine"), "weights": "int4", "backend": "tensorrt", "kv_cache": "float",
                   "kv_block_size": 0, "mixed_adapters": False, "threads": 1},
        "kv": {"enabled": False},
    }))
    cfg = load_config(params)
    metrics = compile_stage.run_stage(cfg)
    serving = tmp_path / "engine" / "int4-qdq_fp16"
    assert cfg.layout.serving_engine_dir == serving and metrics["weights_builds"] == 1
    record = json.loads((serving / "weights.json").read_text())
    assert (record["format"], record["symmetric"], record["block_size"]) == ("qdq_fp16", True, 128)
    assert not any(n.op_type == "MatMulNBits" for n in onnx.load(str(serving / "model.onnx")).graph.node)


def _locations(onnx_file) -> set[str]:
    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    return {e.value for i in graph.initializer for e in i.external_data if e.key == "location"}


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_copy_of_a_large_engine_keeps_its_weights_in_a_data_file(tiny_engine, tmp_path, monkeypatch, weights):
    # Given: an engine whose weights are in a data file, and a size threshold every graph exceeds
    # (as the 0.5B shape's do at the real one), beside the inline copy of the same engine
    from runtime.engine.backends import onnxruntime as ort_backend

    quantize_engine_dir(tiny_engine, tmp_path / "inline", weights)
    source = external_copy(tiny_engine, tmp_path / "source")
    monkeypatch.setattr(ort_backend, "EXTERNAL_DATA_MIN_BYTES", 0)

    # When: the copy is written from it
    quantize_engine_dir(source, tmp_path / "large", weights)

    # Then: its graph reads the weights from its own model.onnx.data and computes what the inline copy does
    assert _locations(tmp_path / "large" / "model.onnx") == {"model.onnx.data"}
    ids = np.random.default_rng(4).integers(0, 96, (1, 6))
    args = (ids, np.arange(6)[None], np.ones((1, 6), np.int64), None)
    want = OrtEngine(tmp_path / "inline").forward(*args)[0]
    np.testing.assert_array_equal(OrtEngine(tmp_path / "large").forward(*args)[0], want)


def test_a_mixed_int4_engine_keeps_its_bit_budget_in_stored_bytes_and_runs_its_parts_in_row_order(tiny_engine, tiny_qwen,
                                                                                                   tmp_path):
    from weight_testkit import prefill_and_decode

    from kernels.weight_quant import bits_per_weight

    # given GPTQ's calibration tokens and a budget of 4.7 stored bits per weight (uniform int4 at 64: 4.57)
    rng = np.random.default_rng(0)
    calibration = [rng.integers(0, 96, 96).tolist() for _ in range(4)]
    mixed = ensure_quantized_engine(tiny_engine, tmp_path / "mixed", "int4", 64, calibration_ids=calibration,
                                    threads=1, mixed_bits=4.7, model_dir=tiny_qwen)
    uniform = ensure_quantized_engine(tiny_engine, tmp_path / "uniform", "int4", 64, calibration_ids=calibration,
                                      threads=1)
    # then every part of every layer took an option, within the budget, some of them wider than int4 at 64
    plan = mixed["weights_record"]["mixed"]
    assert bits_per_weight(4, 64, 64) < plan["bits_per_weight"] <= 4.7
    assert len(plan["parts"]) == 7 * 2 and plan["options"]["int4/b64"] < 7 * 2
    assert "mixed" not in uniform["weights_record"]
    # and the bits it counts are the bytes the graph stores: codes, padding, scales and zero points of every part
    graph = onnx.load(str(tmp_path / "mixed" / "model.onnx")).graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    parts = [n for n in graph.node if n.op_type == "MatMulNBits" and "_r" in n.name.rsplit("_w", 1)[1]]
    shape = [{a.name: a.i for a in n.attribute} for n in parts]
    stored = sum(inits[i].nbytes for n in parts for i in n.input[1:])
    assert 8 * stored / sum(s["K"] * s["N"] for s in shape) == pytest.approx(plan["bits_per_weight"], abs=1e-3)
    # and the engine, its parts joined back in row order, is nearer the float engine than uniform int4 at 64
    ids = rng.integers(0, 96, (2, 24))
    reference = prefill_and_decode(OrtEngine(tiny_engine, threads=1), ids)

    def kl(engine_dir):
        logits = prefill_and_decode(OrtEngine(engine_dir, threads=1), ids)
        p, q = (np.exp(x - x.max(-1, keepdims=True)) for x in (reference, logits))
        p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
        return float((p * np.log(p / q)).sum(-1).mean())

    assert kl(tmp_path / "mixed") < kl(tmp_path / "uniform")
    # The budget is part of the cache key: the same settings reuse the build, another budget is another build.
    again = dict(calibration_ids=calibration, threads=1, model_dir=tiny_qwen)
    assert ensure_quantized_engine(tiny_engine, tmp_path / "mixed", "int4", 64, mixed_bits=4.7, **again)["weights_builds"] == 0
    assert ensure_quantized_engine(tiny_engine, tmp_path / "mixed", "int4", 64, mixed_bits=4.9, **again)["weights_builds"] == 1


def test_the_compile_stage_builds_int4_mixed_under_the_configured_budget_and_names_one_too_small(tiny_llama_dir,
                                                                                                  tmp_path):
    import yaml

    from tasks.config import load_config
    from tasks.stages import compile as compile_stage

    def stage(budget: float) -> dict:
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump({
            "base_model": {"source": "local", "path": str(tiny_llama_dir)},
            "train": {"output_dir": str(tmp_path / "artifacts")},
            "engine": {"dir": str(tmp_path / "engine"), "weights": "int4", "weight_mixed_bits": budget,
                       "weight_calibration_tokens": 512, "mixed_adapters": False, "threads": 1},
        }))
        return compile_stage.run_stage(load_config(params))

    # 32 and 64 channels wide: int4 at block 32 stores 5.13 bits per weight, at 64 4.56, so nothing fits 4.9
    with pytest.raises(WeightQuantError, match=r"engine.weight_mixed_bits 4.9: below the 5.111 stored bits per weight"):
        stage(4.9)
    record = stage(5.5)["weights_record"]
    assert record["method"] == "gptq" and record["weights_mixed_bits"] == 5.5
    assert 5.111 < record["mixed"]["bits_per_weight"] <= 5.5 and len(record["mixed"]["parts"]) == 7 * 2
