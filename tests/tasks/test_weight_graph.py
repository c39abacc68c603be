"""The graph rewrite of tasks/weights/graph.py: what the quantized graphs hold, and the activation calibration."""

from __future__ import annotations

import json

import numpy as np
import onnx
from engine_testkit import qwen_adapter, tiny_engine, tiny_qwen  # noqa: F401  (fixtures)
from weight_testkit import external_copy, prefill_and_decode

from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from tasks.weights.engines import open_on_cpu, quantize_engine_dir
from tasks.weights.graph import calibrate_activations


def test_tensorrt_qdq_graph_holds_only_what_its_onnx_parser_takes(tiny_engine, qwen_adapter, tmp_path):
    from onnx import TensorProto, numpy_helper

    # Given the int4 weights in the fp16-GEMM form (TensorRT's W4A16 weight-only kernels)
    record = quantize_engine_dir(tiny_engine, tmp_path / "q", "int4", 32, fmt="qdq_fp16")
    model = onnx.load(str(tmp_path / "q" / "model.onnx"))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    dqs = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    # Then: standard ops at opset 21, one DequantizeLinear per projection (2 layers x qkv, o, gate_up, down)
    assert {n.domain for n in graph.node} == {""} and max(o.version for o in model.opset_import if o.domain == "") == 21
    assert len(dqs) == len(record["quantized"]) == 8
    for dq in dqs:
        weight, scale = (inits[name] for name in dq.input)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
        # a constant signed int4 weight (K, N), no zero point, positive fp16 scales blocked along K
        assert len(dq.input) == 2 and weight.data_type == TensorProto.INT4 and scale.data_type == TensorProto.FLOAT16
        assert attrs == {"axis": 0, "block_size": 32} and list(scale.dims) == [weight.dims[0] // 32, weight.dims[1]]
        assert (numpy_helper.to_array(scale) > 0).all()
        codes = numpy_helper.to_array(weight).astype(np.int8)
        assert codes.min() >= -7 and codes.max() <= 7 and codes.min() < 0 < codes.max()
    # each MatMul reading a dequantized weight runs in fp16 between two Casts; the LoRA inputs are untouched
    consumers = {i: n for n in graph.node for i in n.input}
    for dq in dqs:
        matmul = consumers[dq.output[0]]
        assert matmul.op_type == "MatMul" and consumers[matmul.output[0]].op_type == "Cast"
    assert not any(i.startswith("lora_") for dq in dqs for i in dq.input)
    # and its logits stay within fp16 rounding of the same codes with fp32 GEMMs
    quantize_engine_dir(tiny_engine, tmp_path / "q32", "int4", 32, fmt="qdq")
    lora = load_adapter(qwen_adapter, open_on_cpu(tmp_path / "q").interface)
    ids = np.random.default_rng(2).integers(0, 96, (2, 9))
    got = {}
    for name in ("q", "q32"):
        engine = open_on_cpu(tmp_path / name)
        engine.set_adapter(lora)
        got[name] = prefill_and_decode(engine, ids)
    diff = np.abs(got["q"] - got["q32"]).max()
    assert 0 < diff < 1e-2 * np.abs(got["q32"]).max()


def test_lora_stays_a_float_input_of_the_quantized_graph(tiny_engine, qwen_adapter, tmp_path):
    quantize_engine_dir(tiny_engine, tmp_path / "q", "int4", fold_norms=True)
    graph = onnx.load(str(tmp_path / "q" / "model.onnx")).graph
    engine = OrtEngine(tmp_path / "q")

    assert [i.name for i in graph.input] == engine.interface.input_names
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert not any(i.startswith("lora_") for n in nbits for i in n.input)
    assert {n.op_type for n in graph.node if n.op_type.startswith("MatMul")} == {"MatMul", "MatMulNBits"}
    # A swapped qwen_adapter changes the output: the LoRA path is live, not folded into constants.
    ids = np.arange(6)[None]
    base = prefill_and_decode(engine, ids)
    engine.set_adapter(load_adapter(qwen_adapter, engine.interface))
    assert np.abs(prefill_and_decode(engine, ids) - base).max() > 1e-3


def test_calibration_reads_every_projection_input_from_the_float_graph(tiny_engine, tiny_qwen, qwen_adapter, tmp_path):
    stats = calibrate_activations(tiny_engine / "model.onnx", [[1, 2, 3, 4, 5], [7, 8, 9]])
    # 2 layers x (qkv, o, gate_up, down) + the LM head
    assert len(stats) == 9 and all(v.ndim == 1 and (v >= 0).all() and np.isfinite(v).all() for v in stats.values())
    assert sorted(v.shape[0] for v in stats.values()) == [64] * 7 + [128] * 2  # down_proj reads the 128-wide MLP
    record = quantize_engine_dir(tiny_engine, tmp_path / "c", "int4", act_sq=stats)
    key = json.loads((tmp_path / "c" / "cache_key.json").read_text())
    assert record["clip_search"] is True and len(key["weights_calibration"]) == 64
    engine = OrtEngine(tmp_path / "c")
    engine.set_adapter(load_adapter(qwen_adapter, engine.interface))
    assert np.isfinite(prefill_and_decode(engine, np.arange(5)[None])).all()


def test_calibration_reads_a_graph_whose_weights_are_in_a_data_file(tiny_engine, tmp_path):
    source = external_copy(tiny_engine, tmp_path / "source")
    ids = [[1, 5, 9, 2], [7, 3]]

    got = calibrate_activations(source / "model.onnx", ids)

    want = calibrate_activations(tiny_engine / "model.onnx", ids)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_the_embedding_table_becomes_a_gather_block_quantized_with_the_float_tables_rows(tiny_engine, tmp_path):
    # Given the int8 copy with the table kept fp32 and two with it quantized (MatMulNBits' asymmetric codes,
    # and symmetric ones, whose zero point GatherBlockQuantized defaults like MatMulNBits)
    ids = np.random.default_rng(4).integers(0, 96, (2, 9))
    float_graph = onnx.load(str(tiny_engine / "model.onnx")).graph
    table = next(n.input[0] for n in float_graph.node if n.op_type == "Gather"
                 and n.input[0] in {i.name for i in float_graph.initializer})
    logits = {}
    for name, keep, symmetric in (("fp32", ("lm_head", "embed"), False), ("int8", ("lm_head",), False),
                                  ("int8-sym", ("lm_head",), True)):
        out = tmp_path / name
        if symmetric:  # the engine-dir writer takes the serving settings; the graph rewrite takes symmetry
            from tasks.weights.graph import quantize_engine_weights

            quantize_engine_dir(tiny_engine, out, "int8", 32, keep=keep)
            record = quantize_engine_weights(tiny_engine / "model.onnx", out / "model.onnx", 8, 32, keep=keep, symmetric=True)
        else:
            record = quantize_engine_dir(tiny_engine, out, "int8", 32, keep=keep)
        graph = onnx.load(str(out / "model.onnx")).graph
        gathers = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
        # Then the table is one GatherBlockQuantized of 8-bit codes blocked along the hidden axis, no fp32 copy left
        if name == "fp32":
            assert not gathers and record["embed_bits"] is None and "embedding table (Gather)" in record["kept_fp32"]
        else:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gathers[0].attribute}
            assert len(gathers) == 1 and attrs == {"gather_axis": 0, "quantize_axis": 1, "block_size": 32, "bits": 8}
            assert record["embed_bits"] == 8 and len(gathers[0].input) == (3 if symmetric else 4)
            assert table not in {i.name for i in graph.initializer}
        logits[name] = prefill_and_decode(OrtEngine(out), ids)
    # and the logits are the fp32 table's within 8-bit rounding (measured 2.0% and 2.5% of the largest logit:
    # a wrong zero point shifts every row by a block's range, tens of %), not equal (the codes are used)
    scale = np.abs(logits["fp32"]).max()
    for name in ("int8", "int8-sym"):
        assert 0 < np.abs(logits[name] - logits["fp32"]).max() < 4e-2 * scale


def test_only_the_lm_head_is_written_in_slices_and_the_engine_computes_the_same_logits(tiny_engine, tmp_path,
                                                                                        monkeypatch):
    import tasks.weights.graph as weight_graph

    # Given the int4 engine with an 8-bit head written whole, and again with slices of at most 4 kB of codes
    ids = np.random.default_rng(5).integers(0, 96, (2, 9))
    whole = quantize_engine_dir(tiny_engine, tmp_path / "whole", "int4", 32, keep=("embed",), head_bits=8)
    monkeypatch.setattr(weight_graph, "HEAD_SLICE_MAX_BYTES", 4096)
    sliced = quantize_engine_dir(tiny_engine, tmp_path / "sliced", "int4", 32, keep=("embed",), head_bits=8)
    graph = onnx.load(str(tmp_path / "sliced" / "model.onnx")).graph
    (head,) = weight_graph._lm_head_nodes(onnx.load(str(tiny_engine / "model.onnx")).graph)
    heads = [n for n in graph.node if n.op_type == "MatMulNBits" and n.name.startswith(f"{head}_w8_s")]
    # Then the head, and nothing else, is several MatMulNBits of at most 4 kB of codes joined into the logits
    inits = {i.name: i for i in graph.initializer}
    assert len(heads) > 1 and all(np.prod(inits[n.input[1]].dims) <= 4096 for n in heads)
    assert sum(n.op_type == "MatMulNBits" for n in graph.node) == len(whole["quantized"]) - 1 + len(heads)
    assert sliced["quantized"][-1].endswith(f"(lm_head, 8 bits) in {len(heads)} slices")
    assert sliced["quantized_weight_bytes"] == whole["quantized_weight_bytes"]
    # and the engine's logits are the whole head's
    got, want = (prefill_and_decode(OrtEngine(tmp_path / name), ids) for name in ("sliced", "whole"))
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
