"""The paged KV cache (interface version 6): the padded engine's tokens and integers, blocks taken and given
back, the KV budget's waits and 503s through the real server and the openai SDK; and the batcher serving rows of an
engine with quantized pages (version 9; its own tests: ``test_quantized_pages.py``).

Engines are compiled from the tiny test backbone (``engine_testkit``) and the tiny release world
(``release_testkit``) with blocks of 4 tokens, so rows cross block boundaries every few steps.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
from engine_testkit import TARGETS, engine_run
from release_testkit import world
from server_testkit import PROMPT, running_server

from kernels.kv_spec import PageQuantSpec
from runtime.__main__ import main as runtime_main
from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import greedy_generate, prefill_by_position
from runtime.engine.interface import LOGIT_POSITIONS_INTERFACE_VERSION, SUPPORTED_VERSIONS, read_interface
from runtime.engine.kv_blocks import BlockPool, KVBudgetExceeded, PagedCache, PoolTensor
from runtime.engine.kv_prefix import release_scope
from runtime.engine.kv_swap import SPILL_PREFIX, SpillFile
from runtime.engine.tokenizer import DeviceTokenizer
from tasks.stages.compile import CompileError, compile_engine

BLOCK = 4
OTHER_PROMPT = "inspect board=PCB-1201 line=L2 part=C7 temp_c=244 defect=lifted lift_um=40 verdict:"


@pytest.fixture(scope="module")
def float_pair(tiny_engine, tiny_qwen, qwen_adapter, tmp_path_factory):
    """(padded, paged) float-cache engines of the tiny backbone with the same adapter bound."""
    engine_dir = tmp_path_factory.mktemp("paged") / "float"
    compile_engine(tiny_qwen, engine_dir, max_rank=8, target_modules=TARGETS, kv_block_size=BLOCK)
    engines = (OrtEngine(tiny_engine, threads=2), OrtEngine(engine_dir, threads=2))
    lora = load_adapter(qwen_adapter, engines[0].interface)
    for engine in engines:
        engine.set_adapter(lora)
    return engines


def test_the_paged_engine_computes_the_padded_engines_logits_and_stores_its_cache(float_pair):
    padded, paged = float_pair
    ids = np.random.default_rng(0).integers(0, 96, (2, 14))

    want, padded_cache = engine_run(padded, ids, split=7)
    got, paged_cache = engine_run(paged, ids, split=7)

    assert np.abs(got - want).max() <= 1e-5
    stored, expected = paged.cache_to_numpy(paged_cache), padded.cache_to_numpy(padded_cache)
    assert len(stored) == len(expected) == 2 * paged.interface.num_layers
    for got_kv, want_kv in zip(stored, expected):  # up to rounding: the paged attention sums past and new tokens apart
        np.testing.assert_allclose(got_kv, want_kv, rtol=1e-5, atol=1e-6)
    assert paged_cache.lengths.tolist() == [14, 14] and [len(b) for b in paged_cache.blocks] == [4, 4]  # ceil(14 / 4)


def test_greedy_answers_through_the_paged_engine_equal_the_padded_engines_batched_and_alone(float_pair):
    padded, paged = float_pair
    prompts = [[3, 14, 15, 92, 65, 35, 89, 7, 9], [35, 89, 7], [5] * 13]  # left-padded to 13 together

    want = greedy_generate(padded, prompts, max_new_tokens=12)
    batched, alone = greedy_generate(paged, prompts, max_new_tokens=12), greedy_generate(paged, prompts, 12, batch_size=1)

    assert [len(t) for t in want] == [12, 12, 12] and len({tuple(t) for t in want}) == 3
    assert batched == want and alone == want
    assert paged.pool.used_blocks == 0  # every generation's rows gave their blocks back


def test_rows_take_blocks_as_they_grow_move_between_caches_and_give_them_back(float_pair):
    _, engine = float_pair
    pool = engine.pool
    before = pool.used_blocks
    caches = []
    for n in (5, 9):  # prefilled alone: 2 and 3 blocks of 4 tokens
        ids = np.arange(n, dtype=np.int64)[None] % 90
        caches.append(engine.forward(ids, np.arange(n)[None], np.ones((1, n), np.int64), None)[1])
    assert pool.used_blocks - before == 5

    merged = engine.concat_caches(caches)  # no padding, no copy: the rows' blocks move
    assert merged.lengths.tolist() == [5, 9] and caches[0].blocks == [] and pool.used_blocks - before == 5
    for step in range(3):  # 5 -> 8 tokens: row 0 stays in 2 blocks; 9 -> 12: row 1 too
        _, merged = engine.forward(np.array([[7], [8]]), merged.lengths[:, None], np.ones((2, 10 + step), np.int64), merged)
    assert [len(b) for b in merged.blocks] == [2, 3]
    _, merged = engine.forward(np.array([[7], [8]]), merged.lengths[:, None], np.ones((2, 13), np.int64), merged)
    assert [len(b) for b in merged.blocks] == [3, 4] and pool.used_blocks - before == 7  # both crossed a block

    short = engine.take_cache_rows(merged, np.array([0]))
    assert pool.used_blocks - before == 3 and short.lengths.tolist() == [9]
    del short, merged, caches
    assert pool.used_blocks == before  # a cache collected gives its rows back


def test_a_pool_without_budget_grows_keeping_its_rows_and_one_with_a_budget_refuses():
    tensors = [PoolTensor("pool_key.0", (2, 4, 3), "uint8")]
    pool = BlockPool(tensors, None, block_size=4)
    cache = PagedCache(pool, [[]], np.zeros(1, dtype=np.int64))
    tokens = pool.capacity * 4 + 5  # past the initial capacity
    new = (np.arange(tokens * 6, dtype=np.int64) % 251).astype(np.uint8).reshape(1, tokens, 2, 3).transpose(0, 2, 1, 3)
    cache.append({"pool_key.0": new[:, :, :-5]}, np.ones((1, tokens - 5), dtype=bool))
    cache.append({"pool_key.0": new[:, :, -5:]}, np.ones((1, 5), dtype=bool))
    rows = pool.arrays["pool_key.0"][cache.block_table()[0]].transpose(1, 0, 2, 3).reshape(2, -1, 3)  # (nkv, slots, w)
    assert pool.capacity >= pool.blocks_for(tokens) and np.array_equal(rows[:, :tokens], new[0])

    budget = BlockPool.for_budget(tensors, 4, 3 * tensors[0].block_bytes)
    assert budget.capacity == 3
    with pytest.raises(KVBudgetExceeded, match="4 KV blocks needed, 3 of 3 free"):
        PagedCache(budget, [[]], np.zeros(1, dtype=np.int64)).append({"pool_key.0": new[:, :, :13]}, np.ones((1, 13), bool))
    assert budget.used_blocks == 0  # refused before any block was taken
    with pytest.raises(KVBudgetExceeded, match="less than one block"):
        BlockPool.for_budget(tensors, 4, tensors[0].block_bytes - 1)


def resident_anonymous_bytes() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon:"))


def _mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry (its fields, ``VmFlags`` split) of the mapping that holds ``address``."""
    entry = None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:  # a mapping's first line: its address range
            if entry is not None:
                break
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            entry = {} if lo <= address < hi else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.split()
    return entry


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_pools_resident_memory_is_the_blocks_written_in_small_pages():
    # 48 pools of 64 MiB each, the first 1 MiB of each written: numpy's own zeros would ask for 2 MiB huge pages
    tensors = [PoolTensor(f"pool_key.{i}", (2, 16, 32), "uint8") for i in range(48)]
    pool = BlockPool(tensors, 65536, block_size=16)
    array = pool.arrays["pool_key.0"]
    assert "nh" in _mapping_of(array.ctypes.data)["VmFlags"]  # madvise(MADV_NOHUGEPAGE) on the pool's memory
    assert not array.any() and array.flags.writeable and array.flags.c_contiguous
    before = resident_anonymous_bytes()
    for a in pool.arrays.values():
        a[:1024] = 1  # 1,024 blocks of 1 KiB
    grown = resident_anonymous_bytes() - before
    assert 40 << 20 <= grown < 72 << 20  # the 48 MiB written (the kernel counts loosely), not 96 MiB of huge pages


def test_the_paged_interface_keeps_the_float_contract_and_padded_engines_still_load(float_pair, tiny_engine):
    padded, paged = float_pair
    iface = paged.interface
    assert iface.version == LOGIT_POSITIONS_INTERFACE_VERSION and iface.kv_block_size == BLOCK
    assert iface.float_interface_hash == read_interface(tiny_engine).float_interface_hash  # releases bind unchanged
    assert [n for n in iface.input_names if n.startswith("pool_")] == [f"pool_{k}.{i}" for i in range(2) for k in ("key", "value")]
    assert iface.output_names[1:] == [f"new_{k}.{i}" for i in range(2) for k in ("key", "value")]
    assert padded.interface.version in SUPPORTED_VERSIONS and padded.pool is None  # the padded engine serves padded
    assert "kv_block_size" not in json.loads((tiny_engine / "interface.json").read_text())


def test_a_paged_cache_of_blocks_under_one_token_is_refused_at_compile(tiny_qwen, tmp_path):
    with pytest.raises(CompileError, match=r"kv_block_size 0: a paged cache needs blocks of at least one token"):
        compile_engine(tiny_qwen, tmp_path / "e", max_rank=8, target_modules=TARGETS, kv_block_size=0)
    assert not (tmp_path / "e").exists()


# ---------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    return world(tmp_path_factory)


@pytest.fixture(scope="module")
def paged_world_engine(w, tmp_path_factory):
    """The tiny world's float engine compiled paged: the world's releases bind to it unchanged."""
    engine_dir = tmp_path_factory.mktemp("paged-world") / "engine"
    compile_engine(w["base"], engine_dir, max_rank=8, target_modules=TARGETS, ort_threads=1, kv_block_size=BLOCK)
    return engine_dir


@pytest.fixture(scope="module")
def pages_world_engine(w, tmp_path_factory):
    """The tiny world's engine with quantized pages (K4/V4, values in groups of 8 channels) in blocks of 4 tokens, so
    rows seal a page every 4 steps: the world's releases bind unchanged (no release scales)."""
    engine_dir = tmp_path_factory.mktemp("pages-world") / "engine"
    compile_engine(w["base"], engine_dir, max_rank=8, target_modules=TARGETS, ort_threads=1, kv_block_size=BLOCK,
                   kv_pages=PageQuantSpec(v_group_size=8).to_dict())
    return engine_dir


def block_bytes(engine_dir) -> int:
    """Bytes of one block of every layer's K and V: layers x 2 x kv heads x block tokens x head dim x fp32."""
    iface = read_interface(engine_dir)
    return iface.num_layers * 2 * iface.num_kv_heads * BLOCK * iface.head_dim * 4


def sdk(background) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{background.url}/v1", api_key="unused-by-the-device", max_retries=0, timeout=60)


def test_the_openai_sdk_gets_the_padded_engines_answers_from_the_paged_engine(w, paged_world_engine):
    answers = {}
    for name, engine in (("padded", None), ("paged", paged_world_engine)):
        with running_server(w, engine=engine) as (app, background):
            app.load(w["b"])
            client = sdk(background)
            both = client.completions.create(prompt=[PROMPT, OTHER_PROMPT], max_tokens=24, temperature=0, model="2026-11")
            streamed = list(client.completions.create(model="champion", prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
            seeded = client.completions.create(model="champion", prompt=OTHER_PROMPT, max_tokens=16, temperature=0.9, seed=3)
            answers[name] = ([c.text for c in both.choices], "".join(c.choices[0].text for c in streamed if c.choices),
                             seeded.choices[0].text)
            assert app.engine.pool is None or app.engine.pool.used_blocks == 0
    assert answers["paged"] == answers["padded"]
    assert answers["paged"][0][0] == answers["paged"][1] and answers["paged"][0][0] != answers["paged"][0][1]


def test_the_batcher_serves_rows_of_quantized_pages_as_each_decodes_alone(w, pages_world_engine):
    with running_server(w, engine=pages_world_engine) as (app, background):
        app.load(w["b"])
        client = sdk(background)
        lengths = (24, 9)
        alone = [client.completions.create(model="champion", prompt=p, max_tokens=n, temperature=0).choices[0].text
                 for p, n in zip((PROMPT, OTHER_PROMPT), lengths)]
        both = client.completions.create(model="champion", prompt=[PROMPT, OTHER_PROMPT], max_tokens=24, temperature=0)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two requests merged into one batch, one leaving early
            merged = [pool.submit(client.completions.create, model="champion", prompt=p, max_tokens=n, temperature=0)
                      for p, n in zip((PROMPT, OTHER_PROMPT), lengths)]
            merged = [m.result().choices[0].text for m in merged]
        assert app.engine.pool.used_bytes == 0  # every row's float and sealed pages went back
    assert merged == alone and both.choices[0].text == alone[0] and both.choices[1].text.startswith(alone[1])
    assert len(set(alone)) == 2


def test_a_request_the_kv_budget_never_holds_gets_503_with_retry_after(w, paged_world_engine):
    block = block_bytes(paged_world_engine)
    with running_server(w, engine=paged_world_engine, kv_budget_bytes=40 * block + block // 2) as (app, background):
        app.load(w["b"])
        assert app.engine.pool.capacity == 40 and app.engine.pool.block_bytes == block
        client = sdk(background)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as err:  # 40 blocks hold 160 tokens; this needs 200 + prompt
                client.completions.create(model="champion", prompt=PROMPT, max_tokens=200, temperature=0, stream=stream)
            assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
            assert err.value.code == "kv_budget_exceeded" and f"budget holds {40 * block}" in err.value.message
        assert client.completions.create(model="champion", prompt=PROMPT, max_tokens=8, temperature=0).usage.completion_tokens == 8


def test_a_request_waits_for_blocks_and_decodes_as_alone_or_gets_503_when_the_wait_is_over(w, paged_world_engine):
    long = 1000  # decode steps of the first request: far longer than the short wait below
    with running_server(w, engine=paged_world_engine, max_tokens=long) as (app, background):
        app.load(w["b"])
        prompt_tokens = len(app.tokenizer.encode(PROMPT))
        alone = [sdk(background).completions.create(model="champion", prompt=p, max_tokens=n, temperature=0).choices[0].text
                 for p, n in ((PROMPT, long), (OTHER_PROMPT, 10))]
    budget = -(-(prompt_tokens + long - 1) // BLOCK) * block_bytes(paged_world_engine)  # the first request's worst case

    for wait_s, waits in ((60.0, True), (0.2, False)):
        with running_server(w, engine=paged_world_engine, kv_budget_bytes=budget, kv_wait_s=wait_s,
                            max_tokens=long) as (app, background):
            app.load(w["b"])
            client = sdk(background)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                first = pool.submit(client.completions.create, model="champion", prompt=PROMPT, max_tokens=long, temperature=0)
                while app.metrics.value("adapter_generated_tokens_total") < 2:  # the first one holds the blocks
                    time.sleep(0.01)
                second = pool.submit(client.completions.create, model="champion", prompt=OTHER_PROMPT, max_tokens=10, temperature=0)
                assert first.result().choices[0].text == alone[0]
                if waits:
                    assert second.result().choices[0].text == alone[1]  # it waited for the first one's blocks
                else:
                    with pytest.raises(openai.APIStatusError) as err:
                        second.result()
                    assert err.value.status_code == 503 and err.value.code == "kv_budget_exceeded"
                    assert "waited" in err.value.message
            assert app.engine.pool.used_blocks == 0


@pytest.fixture()
def root_logging_restored():
    """``serve`` run in this process makes the root logger's handlers its JSON one (``configure_json_logging``):
    put pytest's back, or every later test's in-process server writes its request lines to the terminal."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_serve_refuses_a_kv_budget_for_a_padded_engine_naming_the_flag(w, capsys, root_logging_restored):
    code = runtime_main(["serve", "--engine", str(w["engine"]), "--package", str(w["b"]), "--trusted-key",
                         str(w["trusted_key"]), "--tokenizer", str(w["tokenizer"]), "--kv-budget-mb", "64"])
    err = capsys.readouterr().err
    assert code == 2 and "kv_budget_mb (--kv-budget-mb): the engine" in err and "a budget needs a paged engine" in err


@pytest.mark.parametrize("flag,value,named", [("--prefill-chunk", "0", "prefill_chunk (--prefill-chunk) 0"),
                                              ("--ort-memory", "pool", "ort_memory (--ort-memory) 'pool'")])
def test_serve_refuses_a_prefill_chunk_or_ort_memory_it_cannot_use_naming_the_flag(w, capsys, flag, value, named,
                                                                                   root_logging_restored):
    code = runtime_main(["serve", "--engine", str(w["engine"]), "--package", str(w["b"]), "--trusted-key",
                         str(w["trusted_key"]), "--tokenizer", str(w["tokenizer"]), flag, value])
    err = capsys.readouterr().err
    assert code == 2 and named in err


def test_the_saved_graph_writes_each_layers_new_slots_before_the_next_layer_attends(float_pair):
    # The new slots leave the graph as soon as they are computed, not at the end of the step (ORT's own order
    # saves graph outputs last, keeping every layer's new K/V alive through the whole forward).
    import onnx

    from runtime.engine.backends.onnxruntime import OPTIMIZED_ONNX

    _, paged = float_pair
    graph = onnx.load(str(paged.engine_dir / OPTIMIZED_ONNX), load_external_data=False).graph
    position = {name: i for i, node in enumerate(graph.node) for name in node.output}
    attention = [i for i, node in enumerate(graph.node) if node.op_type == "Softmax"]
    assert len(attention) == paged.interface.num_layers
    for layer in range(paged.interface.num_layers - 1):
        written = max(position[f"new_{kind}.{layer}"] for kind in ("key", "value"))
        assert written < attention[layer + 1], f"layer {layer}'s new slots wait past layer {layer + 1}'s attention"


# ---------------------------------------------------------------- prefix pages shared between requests

SYSTEM_TURN = ("rules: a void above 15 percent fails; a lifted lead above 30 um fails; a bridge fails; "
               "report the part and the verdict only. ")


def prefill_alone(engine, prompt: list[int], start=None, chunk: int = 8):
    """``prompt`` prefilled alone in chunks (after the shared pages ``start`` holds, when given): (last logits, cache)."""
    starts = np.zeros(1, dtype=np.int64) if start is None else start.lengths.copy()
    return prefill_by_position(engine, [prompt], starts, chunk, start)


@pytest.mark.parametrize("kind", ["float pages", "quantized pages"])
def test_a_shared_page_is_bit_identical_to_a_recomputed_one_and_the_suffix_reads_it_as_a_later_chunk(
        w, paged_world_engine, pages_world_engine, kind):
    engine = OrtEngine(paged_world_engine if kind == "float pages" else pages_world_engine, threads=1)
    tokenizer = DeviceTokenizer(w["tokenizer"])
    first, second = (tokenizer.encode(SYSTEM_TURN + p) for p in (PROMPT, OTHER_PROMPT))
    prefix, scope = engine.pool.share_prefixes(), release_scope("2026-11+test", 1)
    _, cache_first = prefill_alone(engine, first)
    prefix.add(scope, first, cache_first.full_pages(0))

    shared = prefix.lookup(scope, second, unit=2)  # whole chunks of 8 tokens: 2 pages of 4
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert len(shared) == common // 8 * 2 and len(shared) >= 4
    logits_shared, cache_shared = prefill_alone(engine, second, engine.cache_with_pages([shared]))
    logits_alone, cache_alone = prefill_alone(engine, second)

    assert np.array_equal(logits_shared, logits_alone)  # what the suffix read is what its own prefill wrote
    for name, pages in cache_shared.to_numpy().items() if kind == "quantized pages" else enumerate(
            engine.cache_to_numpy(cache_shared)):
        recomputed = (cache_alone.to_numpy()[name] if kind == "quantized pages"
                      else engine.cache_to_numpy(cache_alone)[name])
        assert pages.tobytes() == recomputed.tobytes(), name  # shared pages and the rest, byte for byte
    assert prefix.counters.hit_tokens == len(shared) * BLOCK


def test_no_page_is_shared_across_releases_and_a_release_that_leaves_takes_its_idle_pages_back():
    pool = BlockPool([PoolTensor("pool_key.0", (1, BLOCK, 2), "float32")], None, BLOCK)
    prefix, tokens = pool.share_prefixes(), list(range(13))
    cache = PagedCache(pool, [[]], np.zeros(1, dtype=np.int64))
    cache.append({"pool_key.0": np.ones((1, 1, 13, 2), dtype=np.float32)}, np.ones((1, 13), dtype=bool))
    prefix.add("a#1", tokens, cache.full_pages(0))

    assert prefix.lookup("a#2", tokens) == [] and prefix.lookup("b#1", tokens) == []  # a reload is another scope
    assert [block for _, block in prefix.lookup("a#1", tokens)] == cache.blocks[0][:3]
    del cache  # its rows go back; the three indexed pages one lookup still holds stay
    assert pool.used_blocks == 3 and pool.idle_blocks == 0
    pool.release([[b for _, b in prefix.pages.values()]])  # the lookup's row finishes: idle, kept for the next prompt
    assert pool.used_blocks == 0 and pool.idle_blocks == 3 and prefix.cached_pages == 3
    prefix.drop_scopes({"b#1"})  # release a left the device
    assert pool.idle_blocks == 0 and prefix.cached_pages == 0 and pool.free_blocks == pool.capacity


def test_eviction_gives_back_idle_pages_oldest_first_and_never_a_page_in_use():
    pool = BlockPool([PoolTensor("pool_key.0", (1, BLOCK, 2), "float32")], 6, BLOCK)
    prefix = pool.share_prefixes()
    rows = []
    for first in (0, 100, 200):  # three prompts of two full pages each, indexed
        cache = PagedCache(pool, [[]], np.zeros(1, dtype=np.int64))
        cache.append({"pool_key.0": np.zeros((1, 1, 8, 2), dtype=np.float32)}, np.ones((1, 8), dtype=bool))
        prefix.add("a#1", list(range(first, first + 8)), cache.full_pages(0))
        rows.append(cache)
    in_use = list(rows[2].blocks[0])
    first_idle = list(rows[0].blocks[0])
    rows.pop(0)  # two prompts finish, in order: four idle pages, the first's oldest
    rows.pop(0)
    assert pool.idle_blocks == 4 and pool.free_blocks == 0
    with pool.lock:
        taken = pool.take(2)
    assert sorted(taken) == sorted(first_idle) and prefix.lookup("a#1", list(range(8)) + [9]) == []
    with pool.lock:
        pool.take(2)
        with pytest.raises(KVBudgetExceeded):
            pool.take(1)  # only the pages a row holds are left: refused, not evicted
    assert rows[0].blocks[0] == in_use and pool.idle_blocks == 0


@pytest.mark.parametrize("kind", ["float pages", "quantized pages"])
def test_prompts_with_a_shared_system_turn_reuse_its_pages_and_answer_as_without_sharing(
        w, paged_world_engine, pages_world_engine, kind):
    engine = paged_world_engine if kind == "float pages" else pages_world_engine
    questions = [PROMPT, OTHER_PROMPT, PROMPT.replace("R12", "R13")]
    answers, hits = {}, {}
    for sharing in (False, True):
        with running_server(w, engine=engine, prefill_chunk=8, share_prefixes=sharing) as (app, background):
            app.load(w["b"])
            client = sdk(background)
            answers[sharing] = [client.completions.create(model="champion", prompt=SYSTEM_TURN + q, max_tokens=12,
                                                          temperature=0).choices[0].text for q in questions]
            streamed = client.completions.create(model="champion", prompt=SYSTEM_TURN + PROMPT, max_tokens=12,
                                                 temperature=0, stream=True)
            answers[sharing].append("".join(c.choices[0].text for c in streamed if c.choices))
            hits[sharing] = app.metrics.value("adapter_kv_prefix_hit_tokens_total")
            assert app.engine.pool.used_bytes == 0 if kind == "quantized pages" else app.engine.pool.used_blocks == 0
    assert answers[True] == answers[False] and answers[True][0] == answers[True][3]
    system_tokens = len(DeviceTokenizer(w["tokenizer"]).encode(SYSTEM_TURN))
    assert hits[False] == 0 and hits[True] >= 3 * (system_tokens // 8 * 8)  # three requests read the system turn


@pytest.mark.parametrize("kind", ["float pages", "quantized pages"])
def test_the_budget_counts_a_shared_prefix_once_so_a_request_that_shares_it_runs_beside_the_one_that_wrote_it(
        w, paged_world_engine, pages_world_engine, kind):
    engine = paged_world_engine if kind == "float pages" else pages_world_engine
    tokenizer, long = DeviceTokenizer(w["tokenizer"]), 1000  # the first request's worst case
    first, second = SYSTEM_TURN + PROMPT, SYSTEM_TURN + OTHER_PROMPT
    a, b = (tokenizer.encode(p) for p in (first, second))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    pool = OrtEngine(engine, threads=1, kv_budget_bytes=1 << 30).pool
    if kind == "float pages":  # any number of pages is shared
        pages = common // BLOCK
        shared = pages * pool.block_bytes
    else:  # whole prefill chunks of 8 tokens: the sink page float, the others sealed
        pages = common // 8 * 2
        shared = pool.float.block_bytes + (pages - 1) * pool.sealed.block_bytes
    budget = pool.row_bytes(len(a) + long - 1) + pool.row_bytes(len(b) + SHORT_ANSWER - 1) - shared  # the prefix once
    with running_server(w, engine=engine, prefill_chunk=8, max_tokens=long) as (app, background):
        app.load(w["b"])
        client = sdk(background)
        alone = [client.completions.create(model="champion", prompt=p, max_tokens=n, temperature=0)
                 for p, n in ((first, long), (second, SHORT_ANSWER))]
    assert alone[0].usage.completion_tokens > 20 * SHORT_ANSWER  # the first decodes long after the second could end

    for sharing in (False, True):
        with running_server(w, engine=engine, kv_budget_bytes=budget, kv_wait_s=60, prefill_chunk=8, max_tokens=long,
                            share_prefixes=sharing) as (app, background):
            app.load(w["b"])
            with concurrent.futures.ThreadPoolExecutor(2) as threads:
                running = threads.submit(sdk(background).completions.create, model="champion", prompt=first,
                                         max_tokens=long, temperature=0)
                while app.metrics.value("adapter_generated_tokens_total") < 2:  # the first one holds its pages
                    time.sleep(0.01)
                beside = threads.submit(sdk(background).completions.create, model="champion", prompt=second,
                                        max_tokens=SHORT_ANSWER, temperature=0)
                ended_first, _ = concurrent.futures.wait([running, beside], return_when=concurrent.futures.FIRST_COMPLETED)
                assert [f.result().choices[0].text for f in (running, beside)] == [c.choices[0].text for c in alone]
            # Sharing: admitted at once, its worst case less the pages it shares, and done long before the first.
            # Without: both whole worst cases exceed the budget, so it waits for the first to end.
            assert ended_first == ({beside} if sharing else {running})
            assert app.metrics.value("adapter_kv_prefix_hit_tokens_total") == (pages * BLOCK if sharing else 0)
            assert app.engine.pool.used_bytes == 0


def test_serve_refuses_a_kv_prefix_sharing_that_is_not_a_boolean_naming_the_file_and_key(w, tmp_path, capsys,
                                                                                        root_logging_restored):
    config = tmp_path / "device.json"
    config.write_text(json.dumps({"kv_prefix_sharing": "no"}))
    code = runtime_main(["serve", "--device-config", str(config), "--engine", str(w["engine"]), "--package",
                         str(w["b"]), "--trusted-key", str(w["trusted_key"]), "--tokenizer", str(w["tokenizer"])])
    err = capsys.readouterr().err
    assert code == 2 and "kv_prefix_sharing 'no': true or false" in err


def test_serve_refuses_batch_invariance_on_a_padded_engine_or_as_a_non_boolean_naming_the_key(w, tmp_path, capsys,
                                                                                           root_logging_restored):
    base = ["serve", "--engine", str(w["engine"]), "--package", str(w["b"]), "--trusted-key", str(w["trusted_key"]),
            "--tokenizer", str(w["tokenizer"])]
    assert runtime_main([*base, "--batch-invariant"]) == 2
    assert "batch_invariant (--batch-invariant): the engine" in capsys.readouterr().err
    config = tmp_path / "device.json"
    config.write_text(json.dumps({"batch_invariant": 1}))
    assert runtime_main(["serve", "--device-config", str(config), *base[1:]]) == 2
    assert "batch_invariant 1: true or false" in capsys.readouterr().err


# ---------------------------------------------------------------- rows swapped to local storage instead of refused

LONG_ANSWER, SHORT_ANSWER = 150, 8


def one_request_budget(engine_dir, tokenizer, second_answer: int = SHORT_ANSWER) -> int:
    """A KV budget that holds the worst case of either request of the swap tests (PROMPT for ``LONG_ANSWER`` tokens,
    OTHER_PROMPT for ``second_answer``), never both."""
    pool = OrtEngine(engine_dir, threads=1, kv_budget_bytes=1 << 30).pool
    worst = [pool.row_bytes(len(tokenizer.encode(p)) + n - 1) for p, n in ((PROMPT, LONG_ANSWER), (OTHER_PROMPT, second_answer))]
    assert sum(worst) > max(worst) + pool.sealed.block_bytes
    return max(worst) + pool.sealed.block_bytes


def waited_for(condition, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` every 5 ms until it holds; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.005)


def stream_with_a_second_request(client, second: dict) -> tuple[str, object]:
    """A long greedy stream of PROMPT; once it has its first chunk, ``second`` is sent beside it: (the stream's
    text, the second's answer)."""
    stream = client.completions.create(model="champion", prompt=PROMPT, max_tokens=LONG_ANSWER, temperature=0,
                                       stream=True)
    chunks = iter(stream)
    text = next(c.choices[0].text for c in chunks if c.choices)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(client.completions.create, model="champion", temperature=0, **second)
        text += "".join(c.choices[0].text for c in chunks if c.choices)
        return text, other.result()


def test_a_request_the_budget_cannot_admit_preempts_a_running_stream_which_resumes_as_if_never_preempted(
        w, pages_world_engine, tmp_path):
    tokenizer = DeviceTokenizer(w["tokenizer"])
    second = {"prompt": OTHER_PROMPT, "max_tokens": SHORT_ANSWER}
    with running_server(w, engine=pages_world_engine) as (app, background):
        app.load(w["b"])
        client = sdk(background)
        alone = client.completions.create(model="champion", prompt=PROMPT, max_tokens=LONG_ANSWER, temperature=0)
        alone_second = client.completions.create(model="champion", temperature=0, **second).choices[0].text
    assert alone.usage.completion_tokens == LONG_ANSWER  # the stream runs long enough for the second to arrive

    swap = tmp_path / "swap"
    swap.mkdir()
    with running_server(w, engine=pages_world_engine, kv_budget_bytes=one_request_budget(pages_world_engine, tokenizer),
                        kv_wait_s=60, kv_swap_dir=swap, kv_swap_bytes=1 << 20) as (app, background):
        app.load(w["b"])
        text, other = stream_with_a_second_request(sdk(background), second)
        out, back = (app.metrics.value(f"adapter_kv_pages_swapped_{d}_total") for d in ("out", "in"))
        assert app.metrics.value("adapter_kv_preemptions_total") == 1 and out == back > 0
        assert app.engine.pool.used_bytes == 0 and app.batcher.spill.used_bytes == 0
        assert list(swap.iterdir()) == []  # the spill file has no name: private, and gone with the process
    assert text == alone.choices[0].text and other.choices[0].text == alone_second


def test_a_client_that_leaves_while_its_row_is_swapped_out_frees_its_spill_extent_and_the_row_never_resumes(
        w, pages_world_engine, tmp_path):
    tokenizer = DeviceTokenizer(w["tokenizer"])
    second = {"prompt": PROMPT, "max_tokens": LONG_ANSWER}  # long: the first stays swapped out while it decodes
    with running_server(w, engine=pages_world_engine) as (app, background):
        app.load(w["b"])
        alone_second = sdk(background).completions.create(model="champion", temperature=0, **second)
        first_tokens = sdk(background).completions.create(model="champion", prompt=OTHER_PROMPT, max_tokens=LONG_ANSWER,
                                                          temperature=0).usage.completion_tokens
    assert alone_second.usage.completion_tokens == LONG_ANSWER and first_tokens > 4 * SHORT_ANSWER

    budget = one_request_budget(pages_world_engine, tokenizer, LONG_ANSWER)
    with running_server(w, engine=pages_world_engine, kv_budget_bytes=budget, kv_wait_s=60, kv_swap_dir=tmp_path,
                        kv_swap_bytes=1 << 20) as (app, background):
        app.load(w["b"])
        leaving = http.client.HTTPConnection("127.0.0.1", background.port, timeout=60)  # a client that will hang up
        leaving.request("POST", "/v1/completions", json.dumps({"model": "champion", "prompt": OTHER_PROMPT,
                                                               "max_tokens": LONG_ANSWER, "temperature": 0}),
                        {"Content-Type": "application/json"})
        waited_for(lambda: app.metrics.value("adapter_generated_tokens_total") >= 2, "the first request's tokens")
        with concurrent.futures.ThreadPoolExecutor(1) as threads:
            other = threads.submit(sdk(background).completions.create, model="champion", temperature=0, **second)
            waited_for(lambda: app.metrics.value("adapter_kv_preemptions_total") >= 1, "the first row's preemption")
            assert app.batcher.spill.used_bytes > 0
            leaving.sock.shutdown(socket.SHUT_RDWR)  # gone while its row is in the spill file
            leaving.close()
            assert other.result().choices[0].text == alone_second.choices[0].text
        waited_for(lambda: not app.batcher.spill.used_bytes and not app.engine.pool.used_bytes,
                   "the left row's spill extent and pages back")  # the scheduler's next turn drops it
        assert app.metrics.value("adapter_kv_pages_swapped_out_total") > 0
        assert app.metrics.value("adapter_kv_pages_swapped_in_total") == 0  # never read back, never decoded on
        assert app.metrics.value("adapter_requests_total", endpoint="/v1/completions", status="499") == 1


class CorruptingDisk(SpillFile):
    """A spill file whose rows' first byte changes on the disk after it is written (a failing disk)."""

    def write(self, pages, counts, length):
        row = super().write(pages, counts, length)
        os.pwrite(self.fd, bytes([pages[0][0] ^ 0xFF]), row.offset)
        return row


def test_a_spilled_page_that_does_not_read_back_fails_its_row_with_a_500_never_a_wrong_answer(
        w, pages_world_engine, tmp_path):
    tokenizer = DeviceTokenizer(w["tokenizer"])
    with running_server(w, engine=pages_world_engine, kv_budget_bytes=one_request_budget(pages_world_engine, tokenizer),
                        kv_wait_s=60, kv_swap_dir=tmp_path, kv_swap_bytes=1 << 20) as (app, background):
        app.load(w["b"])
        spill = app.batcher.spill
        app.batcher.spill = CorruptingDisk(tmp_path, spill.budget_bytes)
        with pytest.raises(openai.APIError, match="SpillCorrupted: KV page 0 of a preempted row"):
            stream_with_a_second_request(sdk(background), {"prompt": OTHER_PROMPT, "max_tokens": SHORT_ANSWER})
        assert app.metrics.value("adapter_kv_preemptions_total") == 1
        answer = sdk(background).completions.create(model="champion", prompt=OTHER_PROMPT, max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4 and app.engine.pool.used_bytes == 0  # the device serves on


def test_the_spill_file_is_private_and_gone_after_a_clean_exit_and_after_a_kill(tmp_path):
    spill = SpillFile(tmp_path, 1 << 16)
    assert list(tmp_path.iterdir()) == [] and os.stat(spill.fd).st_mode & 0o777 == 0o600
    first, second = spill.write([b"k" * 4096, b"v" * 100], (1, 1), 20), spill.write([b"q" * 50], (1,), 3)
    assert spill.read(first) == [b"k" * 4096, b"v" * 100] and spill.used_bytes == 4246
    spill.release(first)
    assert spill.read(second) == [b"q" * 50] and not spill.holds([1 << 16]) and spill.holds([4196, (1 << 16) - 4246])
    spill.release(second)
    assert spill.used_bytes == 0 and spill.holds([1 << 16])  # the freed ranges merged again
    spill.close()
    killed = subprocess.run([sys.executable, "-c", "import os, signal, sys; from runtime.engine.kv_swap import SpillFile; "
                             "SpillFile(sys.argv[1], 1 << 16).write([b'x' * 4096], (1,), 16); "
                             "os.kill(os.getpid(), signal.SIGKILL)",
                             str(tmp_path)], cwd=Path(__file__).parents[2])
    assert killed.returncode == -signal.SIGKILL and list(tmp_path.iterdir()) == []
    leftover, users = tmp_path / f"{SPILL_PREFIX}123-abcd.spill", tmp_path / "notes.spill"
    leftover.write_bytes(b"x")  # a process killed between making its file and unlinking it
    users.write_bytes(b"mine")
    SpillFile(tmp_path, 1 << 16).close()
    assert list(tmp_path.iterdir()) == [users] and users.read_bytes() == b"mine"


def test_a_batched_prefill_cuts_each_row_at_its_own_positions_so_its_pages_are_those_it_gets_alone(
        w, pages_world_engine):
    engine = OrtEngine(pages_world_engine, threads=1)
    tokenizer = DeviceTokenizer(w["tokenizer"])
    prompts = [tokenizer.encode(SYSTEM_TURN + p) for p in (PROMPT, OTHER_PROMPT)] + [tokenizer.encode(OTHER_PROMPT)]
    assert len({len(p) for p in prompts}) == 3  # different lengths: a left-padded batch would cut them elsewhere
    logits, cache = prefill_by_position(engine, prompts, np.zeros(3, dtype=np.int64), 8)
    together = cache.to_numpy()
    for b, prompt in enumerate(prompts):
        alone_logits, alone_cache = prefill_alone(engine, prompt)
        assert np.array_equal(logits[b], alone_logits[0])
        for name, pages in alone_cache.to_numpy().items():
            width = pages.shape[2]
            assert np.array_equal(together[name][b, :, :width], pages[0]), name  # byte for byte
