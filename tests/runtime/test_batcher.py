"""Continuous batched decode: a request decodes in company as it would alone, and keeps to its release.

Requests are driven through the real scheduler (``runtime.serve.batcher``) on real ORT engines of the tiny
world: its float engine, and engines compiled from the same base with a paged float cache
(``runtime.engine.kv_blocks``) and with quantized pages (``runtime.engine.kv_pages``, the served cache). What a request gets alone is ``runtime.engine.generate.decode_steps`` on its own fork
of the release's handle, the ``fork`` decode mode. Requests arrive while others decode, so their
caches are merged at other past lengths, and leave at other steps.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import numpy as np
import pytest
from release_testkit import world
from server_testkit import PROMPT, call, complete, running_server, sample, scrape

from kernels.kv_spec import PageQuantSpec
from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import decode_steps
from runtime.engine.sampling import Sampler, greedy
from runtime.engine.tokenizer import DeviceTokenizer
from runtime.release.verify import load_trusted_keys
from runtime.serve.active_release import ActiveRelease
from runtime.serve.batcher import BatchedGeneration, Batcher
from runtime.serve.generation import StopText
from runtime.serve.http_app import ServeSettings
from runtime.serve.metrics import ServerMetrics
from runtime.serve.server import AdapterServer

OTHER_PROMPT = "inspect board=PCB-1201 line=L2 part=C7 temp_c=244 defect=lifted lift_um=40 verdict:"
SHORT_PROMPT = "verdict:"


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    return world(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(w):
    return DeviceTokenizer(w["tokenizer"])


def adapter_server(w) -> AdapterServer:
    return AdapterServer(OrtEngine(w["engine"], threads=1), DeviceTokenizer(w["tokenizer"]),
                         load_trusted_keys([w["trusted_key"]]))


@pytest.fixture(scope="module", params=["float", "paged-float", "quantized-pages"])
def release(request, w, tmp_path_factory):
    """A release's bound handle on the float engine (release B), or the base on an engine paged in blocks of 4
    tokens (so rows cross blocks every few steps), with a float cache or with quantized pages (K4/V4, a value group
    a whole head of 16 channels)."""
    if request.param == "float":
        app = adapter_server(w)
        app.load(w["b"])
        return app.active
    from tasks.stages.compile import compile_engine

    pages = PageQuantSpec(v_group_size=16).to_dict() if request.param == "quantized-pages" else None
    engine_dir = tmp_path_factory.mktemp("paged-engine") / "engine"
    compile_engine(w["tokenizer"], engine_dir, max_rank=8, ort_threads=1, kv_block_size=4, kv_pages=pages)
    engine = OrtEngine(engine_dir, threads=1)
    engine.set_adapter(None)
    assert engine.merges_caches and engine.pool is not None and engine.interface.quantized_pages == bool(pages)
    return ActiveRelease(request.param, 1, {}, engine, time.time())


def alone(release, tokenizer, prompts: list[list[int]], max_tokens: int, sampler=greedy) -> list[list[int]]:
    """Each prompt's tokens with the request decoding by itself (the fork mode's decode)."""
    rows: list[list[int]] = [[] for _ in prompts]
    for step in decode_steps(release.handle.fork(), prompts, max_tokens, tokenizer.stop_ids, tokenizer.pad_id, sampler):
        for row, token in zip(rows, step):
            if token is not None:
                row.append(token)
    return rows


def batched(batcher, release, tokenizer, prompts, max_tokens, sampler=greedy) -> BatchedGeneration:
    return BatchedGeneration(batcher, release, prompts, sampler, [StopText(tokenizer, []) for _ in prompts], max_tokens)


async def consume(generation) -> list[list[int]]:
    while await generation.next_choices() is not None:
        pass
    return [text.ids for text in generation.texts]


async def staggered(generations, after: int = 3) -> list[list[list[int]]]:
    """Start each generation once the one before it has decoded ``after`` tokens: it joins a running batch."""
    tasks = []
    for g in generations:
        tasks.append(asyncio.ensure_future(consume(g)))
        while g.completion_tokens < after and not all(g.finished):
            await asyncio.sleep(0.0002)
    return await asyncio.gather(*tasks)


def scheduler_ends(batcher: Batcher, within_s: float = 5.0) -> bool:
    """Whether the scheduler thread ends within ``within_s`` (it ends on its first turn without work)."""
    thread = batcher._thread
    if thread is not None:
        thread.join(within_s)
    return batcher._thread is None


def rows_per_step(metrics: ServerMetrics) -> tuple[float, float, float]:
    """(decode steps, steps of at most 1 row, steps of at most 2 rows)."""
    return (metrics.value("adapter_decode_batch_rows_count"), metrics.value("adapter_decode_batch_rows_bucket", le="1.0"),
            metrics.value("adapter_decode_batch_rows_bucket", le="2.0"))


def test_merged_caches_split_back_into_the_caches_they_were(release, tokenizer):
    """``concat_caches`` left-pads each cache to the longest; ``take_cache_rows`` without the padding
    gives each one back, byte for byte (float lists and the packed cache alike)."""
    engine = release.handle.fork()
    if engine.pool is not None:
        pytest.skip("a paged cache has no padding: tests/runtime/test_paged_kv.py moves its rows")
    caches = []
    for prompts in ([tokenizer.encode(PROMPT)] * 2, [tokenizer.encode(SHORT_PROMPT)]):
        ids = np.array(prompts, dtype=np.int64)
        caches.append(engine.forward(ids, np.broadcast_to(np.arange(ids.shape[1]), ids.shape), np.ones_like(ids), None)[1])
    long, short = (len(tokenizer.encode(p)) for p in (PROMPT, SHORT_PROMPT))

    merged = engine.concat_caches(caches)

    def arrays(cache):
        got = engine.cache_to_numpy(cache)
        return got if isinstance(got, list) else [got[k] for k in sorted(got)]

    assert all(a.shape[0] == 3 and a.shape[-2 if a.ndim == 4 else -1] == long for a in arrays(merged) if a.size)  # not the empty sink
    assert all(np.array_equal(a, b) for a, b in zip(arrays(engine.take_cache_rows(merged, np.array([0, 1]))), arrays(caches[0])))
    assert all(np.array_equal(a, b) for a, b in zip(arrays(engine.take_cache_rows(merged, np.array([2]), long - short)),
                                                    arrays(caches[1])))
    assert all(not a[2, ..., : long - short, :].any() if a.ndim == 4 else not a[2, : long - short].any()
               for a in arrays(merged))  # the padding is zeros


def test_a_merged_cache_costs_every_padded_slot_of_its_rows_and_a_paged_one_its_blocks(release, tokenizer):
    """``cache_bytes`` counts what a cache holds, the zero slots padding its shorter rows included: the bytes of the
    arrays the graph reads, which are rows x the longest row x ``kv_bytes_per_token`` (2 layers x K and V x 2 KV
    heads x 16 channels, fp32); a paged cache holds each row's own blocks (quantized pages: its float and sealed
    pages, ``PagesCache.allocated_bytes``)."""
    engine = release.handle.fork()
    caches = []
    for prompt in (PROMPT, SHORT_PROMPT):
        ids = np.array([tokenizer.encode(prompt)], dtype=np.int64)
        caches.append(engine.forward(ids, np.arange(ids.shape[1])[None], np.ones_like(ids), None)[1])
    long, short = (len(tokenizer.encode(p)) for p in (PROMPT, SHORT_PROMPT))
    merged = engine.concat_caches(caches)
    if engine.interface.quantized_pages:  # a row's first page and its open one float (fp32), every other page sealed
        float_page, sealed_page = 2 * 2 * 2 * 4 * 16 * 4, 2 * 2 * PageQuantSpec(v_group_size=16).sealed_page_bytes(16, 4)
        expected = 0
        for n in (long, short):
            pages = -(-n // 4)
            float_pages = 1 if pages == 1 else 1 + (n % 4 != 0)
            expected += float_pages * float_page + (pages - float_pages) * sealed_page
        assert long > 12 and engine.cache_bytes(merged) == expected
        return
    assert engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    if engine.pool is not None:  # no padding: each row holds the blocks its own tokens fill
        blocks = sum(-(-n // engine.pool.block_size) for n in (long, short))
        assert engine.cache_bytes(merged) == blocks * engine.pool.block_size * engine.kv_bytes_per_token
        return

    held = engine.cache_to_numpy(merged)
    graph_reads = held if isinstance(held, list) else [a for n, a in held.items() if n in engine.interface.input_names]
    assert engine.cache_bytes(merged) == 2 * long * engine.kv_bytes_per_token
    assert engine.cache_bytes(merged) == sum(a.nbytes for a in graph_reads)


def test_requests_arriving_while_others_decode_get_what_they_get_alone(release, tokenizer):
    """Prompts of different lengths, one request of two prompts, each joining the running batch after
    the previous one decoded 3 tokens, leaving at different steps: each row's tokens are its tokens alone."""
    metrics = ServerMetrics()
    batcher = Batcher(tokenizer.stop_ids, tokenizer.pad_id, metrics)
    requests = [([tokenizer.encode(PROMPT)], 40), ([tokenizer.encode(SHORT_PROMPT)], 12),
                ([tokenizer.encode(OTHER_PROMPT), tokenizer.encode(SHORT_PROMPT + " ok")], 20),
                ([tokenizer.encode("inspect board=PCB-7 verdict:")], 9)]
    assert len({len(p) for prompts, _ in requests for p in prompts}) == 5

    got = asyncio.run(staggered([batched(batcher, release, tokenizer, p, n) for p, n in requests]))

    want = [alone(release, tokenizer, p, n) for p, n in requests]
    assert got == want
    assert len({len(r) for rows in got for r in rows}) >= 4  # rows left the batch at different steps
    steps, single, _ = rows_per_step(metrics)
    assert steps > 0 and single < steps  # rows were decoded together
    assert scheduler_ends(batcher)  # no work left
    pool = release.handle.pool
    pages = release.handle.interface.quantized_pages
    assert pool is None or (pool.used_bytes if pages else pool.used_blocks) == 0  # every row gave its blocks back


def test_requests_beyond_the_row_cap_wait_for_rows_to_leave_and_then_decode_as_alone(release, tokenizer):
    metrics = ServerMetrics()
    batcher = Batcher(tokenizer.stop_ids, tokenizer.pad_id, metrics, max_rows=2)
    requests = [([tokenizer.encode(PROMPT)], 30), ([tokenizer.encode(SHORT_PROMPT)], 10),
                ([tokenizer.encode(OTHER_PROMPT)], 20), ([tokenizer.encode("inspect board=PCB-7 verdict:")], 15)]

    async def all_at_once():
        return await asyncio.gather(*(consume(batched(batcher, release, tokenizer, p, n)) for p, n in requests))

    got = asyncio.run(all_at_once())

    assert got == [alone(release, tokenizer, p, n) for p, n in requests]
    steps, single, two = rows_per_step(metrics)
    assert two == steps and single < steps  # never more than 2 rows, and 2 decoded together
    assert scheduler_ends(batcher)


def test_seeded_sampling_draws_the_same_tokens_in_any_company(release, tokenizer):
    prompt = [tokenizer.encode(PROMPT)]
    want = alone(release, tokenizer, prompt, 16, Sampler(0.9, 0.95, seed=7))
    batcher = Batcher(tokenizer.stop_ids, tokenizer.pad_id, ServerMetrics())
    company = [batched(batcher, release, tokenizer, [tokenizer.encode(OTHER_PROMPT)], 120),
               batched(batcher, release, tokenizer, [tokenizer.encode(SHORT_PROMPT)], 24, Sampler(1.3, 1.0, seed=8))]

    got = asyncio.run(staggered([*company, batched(batcher, release, tokenizer, prompt, 16, Sampler(0.9, 0.95, seed=7))]))

    assert got[-1] == want
    assert want != alone(release, tokenizer, prompt, 16)  # sampled, not greedy


def test_a_swap_mid_stream_keeps_each_request_on_its_release_in_its_own_batch(w, tokenizer):
    app = adapter_server(w)
    app.load(w["a"])
    release_a = app.active
    prompts = [tokenizer.encode(PROMPT)]

    async def scenario():
        first = app.start_generation(release_a, prompts, 300, greedy, [])  # long enough to outlast the swap
        first_task = asyncio.ensure_future(consume(first))
        while first.completion_tokens < 3:
            await asyncio.sleep(0.0002)
        app.load(w["b"])  # the swap: requests from now on get B; the first one stays on A
        on_b = app.start_generation(app.active, prompts, 20, greedy, [])
        late_on_a = app.start_generation(release_a, prompts, 20, greedy, [])  # read active before the swap
        return await asyncio.gather(first_task, consume(on_b), consume(late_on_a)), on_b.release

    (first, on_b, late_on_a), release_b = asyncio.run(scenario())

    assert release_b is app.active and release_b.release_id != release_a.release_id
    assert first == alone(release_a, tokenizer, prompts, 300) and late_on_a == alone(release_a, tokenizer, prompts, 20)
    assert on_b == alone(release_b, tokenizer, prompts, 20) and on_b != late_on_a  # the adapters answer differently
    steps, single, two = rows_per_step(app.metrics)
    assert single < steps  # the two requests on A shared steps ...
    assert two == steps  # ... and never with B's row: no step had 3 rows


def test_a_closed_generation_leaves_the_batch_and_the_others_decode_on(release, tokenizer):
    batcher = Batcher(tokenizer.stop_ids, tokenizer.pad_id, ServerMetrics())
    prompts = [tokenizer.encode(PROMPT)], [tokenizer.encode(SHORT_PROMPT)]  # the longest row leaves: its slots go
    leaving, staying = batched(batcher, release, tokenizer, prompts[0], 200), batched(batcher, release, tokenizer, prompts[1], 30)

    async def scenario():
        tasks = [asyncio.ensure_future(consume(g)) for g in (leaving, staying)]
        while leaving.completion_tokens < 5:
            await asyncio.sleep(0.0002)
        leaving.close()  # what the HTTP side does when the client has gone
        tasks[0].cancel()
        return await tasks[1]

    assert asyncio.run(scenario()) == alone(release, tokenizer, prompts[1], 30)
    assert 5 <= leaving.completion_tokens < 200 and scheduler_ends(batcher)


def test_a_request_the_engine_refuses_fails_alone(release, tokenizer):
    """A token id past the vocabulary fails in the engine's prefill: that request gets the error, the
    batch it would have joined decodes on."""
    batcher = Batcher(tokenizer.stop_ids, tokenizer.pad_id, ServerMetrics())
    prompt = [tokenizer.encode(PROMPT)]
    running, refused = batched(batcher, release, tokenizer, prompt, 30), batched(batcher, release, tokenizer, [[10**6]], 5)

    async def scenario():
        task = asyncio.ensure_future(consume(running))
        while running.completion_tokens < 3:
            await asyncio.sleep(0.0002)
        with pytest.raises(Exception, match="(?i)index|indices|out of"):
            await consume(refused)
        return await task

    assert asyncio.run(scenario()) == alone(release, tokenizer, prompt, 30)


def test_a_bug_in_the_scheduler_while_it_admits_fails_the_request_never_leaves_it_waiting(release, tokenizer, monkeypatch):
    batcher = Batcher(tokenizer.stop_ids, tokenizer.pad_id, ServerMetrics())

    def broken(arrivals):
        raise RuntimeError("a bug in admission")

    monkeypatch.setattr(batcher, "_admit", broken)
    admitted = batched(batcher, release, tokenizer, [tokenizer.encode(PROMPT)], 5)
    with pytest.raises(RuntimeError, match="a bug in admission"):
        asyncio.run(asyncio.wait_for(consume(admitted), 30))
    assert scheduler_ends(batcher)


# ---------------------------------------------------------------- through the HTTP app


def test_a_client_that_leaves_a_non_streamed_request_frees_its_row(w):
    with running_server(w, max_tokens=1024) as (app, background):
        app.load(w["b"])
        body = json.dumps({"prompt": PROMPT, "max_tokens": 1024, "temperature": 0}).encode()
        sock = socket.create_connection(("127.0.0.1", background.port), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: device\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while sample(scrape(background.port), "adapter_generated_tokens_total") == 0:  # it decodes
            assert time.monotonic() < deadline
        sock.close()
        while sample(samples := scrape(background.port), "adapter_generations_in_flight") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)
        tokens = sample(scrape(background.port), "adapter_generated_tokens_total")
        assert complete(background.port)["tokens"] == 6  # the device serves on
    assert 1 <= tokens < 1024  # it stopped early, and stays stopped
    assert sample(samples, "adapter_requests_total", endpoint="/v1/completions", status="499") == 1


def test_fork_mode_answers_as_batched_mode(w):
    assert ServeSettings(decode="fork").max_concurrent == 2 and ServeSettings().max_concurrent == 16
    with pytest.raises(ValueError, match="decode='forked': expected one of batched, fork"):
        ServeSettings(decode="forked")
    answers = {}
    for mode in ("batched", "fork"):
        with running_server(w, decode=mode) as (app, background):
            app.load(w["b"])
            status, out = call(background.port, "POST", "/v1/completions",
                               {"prompt": [PROMPT, SHORT_PROMPT], "max_tokens": 8, "temperature": 0})
            assert status == 200, out
            answers[mode] = [c["text"] for c in out["choices"]]
            steps = sample(scrape(background.port), "adapter_decode_batch_rows_count")
            assert (steps > 0) == (mode == "batched")
    assert answers["batched"] == answers["fork"]


# ---------------------------------------------------------------- incremental text


def test_stop_text_decodes_incrementally_holds_back_split_characters_and_cuts_at_stops(tokenizer):
    euro = tokenizer.encode("€")
    assert len(euro) > 1  # the byte-level BPE spells it in several byte tokens: a token ends mid-character
    ids = tokenizer.encode("ab") + euro + tokenizer.encode("c d e f STOP g")
    text = StopText(tokenizer, ["STOP", "xyz"])
    pieces = []
    for i, token in enumerate(ids):
        pieces.append(text.push(token))
        if text.stopped:
            break
        assert text.text == tokenizer.decode(ids[: i + 1])  # what decoding every id at once gives
        assert "\ufffd" not in "".join(pieces)  # part of a character is never sent
    assert text.stopped and text.text == "ab€c d e f " and "".join(pieces) == text.text
    assert pieces[len(tokenizer.encode("ab")) : len(tokenizer.encode("ab")) + len(euro)][-1].startswith("€")

    held = StopText(tokenizer, ["STOP"])
    sent = "".join(held.push(t) for t in tokenizer.encode("x ST"))
    assert sent == "x " and held.finish() == "ST"  # "ST" could have begun "STOP"; at the end it is sent
