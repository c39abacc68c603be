"""bench/engine/llama_cpp_bench.py: its rules, without llama.cpp (milliseconds)."""

import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.engine import llama_cpp_bench as bench


def _init(name, shape, dtype=np.float32):
    return numpy_helper.from_array(np.zeros(shape, dtype=dtype), name)


def test_onnx_weight_bytes_leave_out_only_a_table_read_by_gather():
    # given an embedding read only by Gather, a float matmul weight, a packed 4-bit weight with its
    # scales, and a table both gathered and multiplied (a tied embedding / LM head)
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["y"]),
        helper.make_node("MatMulNBits", ["y", "packed", "scales"], ["z"], domain="com.microsoft", K=32, N=6, bits=4, block_size=32),
        helper.make_node("Gather", ["tied", "ids"], ["t"]),
        helper.make_node("MatMul", ["z", "tied"], ["logits"]),
    ]
    inits = [_init("embed", (10, 4)), _init("w", (4, 32)), _init("packed", (6, 1, 16), np.uint8),
             _init("scales", (6,)), _init("tied", (6, 10))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits)
    # when counted, then: everything but the gathered-only table, each at its stored width
    assert bench.onnx_streamed_bytes(helper.make_model(graph)) == 4 * 32 * 4 + 6 * 16 + 6 * 4 + 6 * 10 * 4


def test_gguf_weight_bytes_leave_out_the_token_embedding():
    tensors = {"token_embd.weight": 1000, "output.weight": 300, "blk.0.attn_q.weight": 50, "blk.0.attn_norm.weight": 4}
    assert bench.gguf_streamed_bytes(tensors) == 354


def test_roofline_is_bytes_per_token_over_decode_time_against_the_measured_bandwidth():
    r = bench.roofline(100_000_000, 10.0, 40.0)  # 100 MB in 10 ms
    assert r["achieved_gb_s"] == pytest.approx(10.0)
    assert r["share"] == pytest.approx(0.25)


def test_comparisons_pair_like_for_like_and_mark_what_the_acceptance_covers():
    rows = {"ort_int8": {"decode_512_ms": 4.0, "prefill_128_ms": 90.0},
            "ort_int8_merged": {"decode_512_ms": 3.0, "prefill_128_ms": 70.0},
            "llama_q8_0": {"decode_512_ms": 3.5, "prefill_128_ms": 80.0},
            "llama_q8_0_lora": {"decode_512_ms": 5.0, "prefill_128_ms": 80.0},
            "ort_fp32": {"decode_512_ms": 12.0, "prefill_128_ms": 100.0},
            "llama_f32": {"decode_512_ms": 10.0, "prefill_128_ms": 200.0}}
    p10 = {k: {c: ms / 2 for c, ms in row.items()} for k, row in rows.items()} | {"ort_int8": {"decode_512_ms": 1.0, "prefill_128_ms": 45.0}}
    got = {(c["ours"], c["peer"], c["case"]): c for c in bench.compare(rows, p10, [512])}
    assert {k[:2] for k in got} == {("ort_int8", "llama_q8_0_lora"), ("ort_int8_merged", "llama_q8_0"),
                                    ("ort_int8", "llama_q8_0"), ("ort_fp32", "llama_f32")}  # no int4 rows: skipped
    with_adapter = got["ort_int8", "llama_q8_0_lora", "decode_512_ms"]
    assert with_adapter["ratio"] == pytest.approx(0.8) and with_adapter["pass"] and with_adapter["acceptance"]
    assert with_adapter["ratio_p10"] == pytest.approx(1.0 / 2.5)
    assert not got["ort_int8", "llama_q8_0_lora", "prefill_128_ms"]["pass"]
    assert got["ort_int8_merged", "llama_q8_0", "decode_512_ms"]["pass"]  # 3.0 vs 3.5: neither carries an adapter
    mismatched = got["ort_int8", "llama_q8_0", "decode_512_ms"]  # ours with the adapter, llama.cpp without
    assert not mismatched["pass"] and not mismatched["acceptance"]
    assert got["ort_fp32", "llama_f32", "prefill_128_ms"]["acceptance"]
    assert not got["ort_fp32", "llama_f32", "decode_512_ms"]["acceptance"]  # fp32 decode is reported, not judged
    # the figures it states: the bandwidth, then only the pairings the acceptance judges
    stated = bench.figures({"read_bandwidth": {"gb_s": 20.0}, "results": {"0.5b-width": {"comparisons": list(got.values())}}})
    assert [f.name for f in stated] == ["read bandwidth"] + [f"0.5b-width: {c['ours']} / {c['peer']} median, {c['case'][:-3]}"
                                                            for c in got.values() if c["acceptance"]]


def test_without_llama_cpp_the_bench_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(SystemExit, match=r"make bench-peer.*pip install -e '\.\[peer\]'"):
        bench.main(["--configs", "tiny"])
