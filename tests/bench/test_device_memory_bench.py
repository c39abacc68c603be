"""The device memory bench on the tiny shape: the world it serves (int4 weights, 4-bit quantized pages), prompts of
exact lengths, and a mixed-length load through ``python -m runtime serve`` and the openai SDK, with the server's
resident set and KV bytes read back (``/proc`` and its KV gauges). The world takes about 30 s to build, once."""

import argparse

import pytest

from bench.lib import worlds
from bench.serving import device_memory_bench as bench
from kernels.kv_spec import PageQuantSpec
from runtime.engine.interface import read_interface
from runtime.engine.tokenizer import DeviceTokenizer
from tasks.config import DEFAULT_KV_BLOCK_SIZE

PAGES = PageQuantSpec(v_group_size=16)  # the served pages on the tiny head of 16 channels
BLOCK = DEFAULT_KV_BLOCK_SIZE
FLOAT_PAGE = 2 * 2 * 2 * BLOCK * 16 * 4  # 2 layers x K and V x 2 KV heads x 16 slots x 16 channels, fp32
SEALED_PAGE = 2 * 2 * PAGES.sealed_page_bytes(16, BLOCK)  # 2 layers x 2 KV heads


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The default world: int4 weights and the served cache, 4-bit quantized pages."""
    return worlds.build_int4_world("tiny", tmp_path_factory.mktemp("device-memory") / "tiny", threads=1)


def test_the_world_serves_int4_weights_with_quantized_pages_and_stacked_adapters_and_no_release_scales(world):
    iface = read_interface(world["engine"])
    assert iface.weight_precision == "int4" and iface.kv_pages == PAGES.to_dict()
    assert (iface.kv_block_size, iface.stacked) == (BLOCK, True)
    assert iface.kv_bytes_per_token == SEALED_PAGE // BLOCK == 89  # what a long row holds per token
    assert not list(world["release"].glob("kv_scales*"))  # the device seals each page with its own scales
    assert worlds.build_int4_world("tiny", world["engine"].parent, threads=1) == world  # built once


def test_a_prompt_has_exactly_the_tokens_asked_and_no_two_rows_start_alike(world):
    tokenizer = DeviceTokenizer(world["tokenizer"])
    texts = [worlds.prompt_text(tokenizer, n, row) for row, n in enumerate((1, 17, 200, 200))]
    assert [len(tokenizer.encode(t)) for t in texts] == [1, 17, 200, 200]
    assert texts[2] != texts[3]


def test_loads_are_named_or_given_as_one_context_per_client():
    assert bench.parse_loads("mixed,long=300/20") == {"mixed": (128, 256, 512, 1024) * 2, "long": (300, 20)}
    assert bench.parse_loads("8x2048")["8x2048"] == (2048,) * 8
    with pytest.raises(SystemExit, match="unknown load 'mixd'"):
        bench.parse_loads("mixd")


def test_llama_cpps_q4_0_cache_costs_18_bytes_per_32_values():
    dims = {"num_hidden_layers": 24, "num_key_value_heads": 2, "hidden_size": 896, "num_attention_heads": 14}
    assert bench.llama_kv_bytes_per_token(dims) == 24 * 2 * (2 * 64) // 32 * 18  # 3,456 at the 0.5B shape


def test_llama_servers_kv_cells_are_its_slots_times_their_context_from_its_log(tmp_path):
    log = tmp_path / "llama-server.log"
    log.write_text("0.01.932.397 I srv    load_model: initializing, n_slots = 8, n_ctx_slot = 1024, kv_unified = 'false'\n")
    assert bench.llama_kv_allocated(log, 3456) == (8 * 1024 * 3456, 8 * 1024)
    log.write_text("0.01.9 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 4096, kv_unified = 'true'\n")
    assert bench.llama_kv_allocated(log, 3456) == (4096 * 3456, 4096)  # one buffer every slot shares
    log.write_text("0.00.004 I srv    load_model: loading model 'model-q4_0.gguf'\n")
    assert bench.llama_kv_allocated(log, 3456) is None


def test_a_mixed_length_load_reads_the_servers_resident_set_and_kv_bytes(world, tmp_path, capsys):
    args = argparse.Namespace(shape="tiny", max_tokens=16, threads=1, arrival="staggered", rss_limit_gb=8.0,
                              sample_s=0.005, report_s=0.05, llama_server=None, llama_cpp_src=None, ort_memory=None,
                              prefill_chunk=8)
    contexts = (32, 64, 96, 128) * 2

    result = bench.measure(world, {"mixed": contexts}, ["ours"], args, tmp_path)

    r = result["loads"]["mixed"]["ours"]
    assert (r["errors"], r["exit_code"], r["over_rss_limit_at_s"]) == (0, 0, None), r["error_examples"]
    assert r["prompt_tokens"] == [c - 16 for c in contexts] and 0 < r["completion_tokens"] <= 8 * 16
    assert r["sent_s"] == sorted(r["sent_s"])  # staggered: each sent once the row before it decoded
    assert 0 < r["ready_rss_bytes"] <= r["end_rss_bytes"] <= r["peak_rss_bytes"]
    assert r["max_sampled_rss_bytes"] <= r["peak_rss_bytes"]
    assert (result["ours"]["kv_cache"], result["ours"]["kv_pages"]) == ("quantized_pages", PAGES.to_dict())
    held, needed = r["kv_allocated_bytes"], r["kv_needed_bytes"]
    tokens = needed / result["ours"]["kv_bytes_per_token"]  # the gauge counts the rows' tokens at a sealed page's rate
    assert tokens == int(tokens) and 0 < tokens <= sum(contexts)
    # held: whole pages, each row's first and open one float, those between sealed; at most every row at its context
    assert any((held - f * FLOAT_PAGE) % SEALED_PAGE == 0 for f in range(1, 2 * len(contexts) + 1) if held >= f * FLOAT_PAGE)
    pages = [-(-c // BLOCK) for c in contexts]
    assert needed <= held <= sum(FLOAT_PAGE * min(n, 2) + SEALED_PAGE * max(n - 2, 0) for n in pages)
    assert r["kv_allocated_over_needed"] == held / needed
    judged = bench.judge(result)
    assert judged["kv_allocated_over_needed"] == r["kv_allocated_over_needed"]
    assert judged["rss_vs_llama_server"] is None and "not measured" in judged["rss_vs_llama_server_note"]
    assert (judged["mixed_adapters_vs_one"], judged["mixed_adapters_vs_one_note"]) == (None, bench.MIXED_ADAPTERS_NOTE)
    assert "[ours mixed] done" in capsys.readouterr().out  # the progress display
    # the server ran with the device config's prefill chunk (prompts of 16-112 tokens: 2-14 forwards each)
    assert (result["ours"]["prefill_chunk"], result["ours"]["ort_memory"]) == (8, "arena")
    assert '"prefill_chunk": 8' in (tmp_path / "device.json").read_text()
