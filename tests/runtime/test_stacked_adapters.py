"""Stacked adapters (interface version 7): rows of different releases in one forward.

A stacked engine with one slot computes what today's engine computes; rows of three adapters in one forward compute
what each row computes alone. Engines are compiled from the tiny test backbone (``engine_testkit``): quantized pages
(the served cache, K4/V4), and the float cache, padded and paged.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_testkit import TARGETS, engine_run, make_adapter

from kernels.kv_spec import PageQuantSpec
from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import greedy_generate
from runtime.engine.interface import (
    ADAPTER_MASK,
    LOGIT_POSITIONS,
    QUANTIZED_PAGES_INTERFACE_VERSION,
    read_interface,
    single_interface,
)
from tasks.stages.compile import compile_engine

PAGES = PageQuantSpec(v_group_size=16)  # K4/V4, a value group a whole head of the tiny backbone
BLOCK = 4
# The served cache first (quantized pages): the fast loop's; the others are slow (each kind compiles two engines,
# ~15 s each on the 2 shared cores).
KINDS = ("pages", "float", "float-paged")
EACH_KIND = [KINDS[0], *(pytest.param(kind, marks=pytest.mark.slow) for kind in KINDS[1:])]


@pytest.fixture(scope="module")
def adapters(tiny_qwen, tmp_path_factory):
    """Three adapters of the tiny backbone (different seeds and ranks)."""
    return [make_adapter(tiny_qwen, tmp_path_factory.mktemp("adapter"), r=r, seed=seed)
            for r, seed in ((4, 1), (8, 2), (2, 3))]


@pytest.fixture(scope="module")
def engines(tiny_qwen, adapters, tmp_path_factory):
    """engines(kind) -> (today's engine, its stacked twin, the LoRA inputs of the three adapters), compiled at the
    first call."""
    built = {}

    def pair(kind: str):
        if kind not in built:
            pages = PAGES.to_dict() if kind == "pages" else None
            block = BLOCK if kind in ("pages", "float-paged") else None
            handles = []
            for stacked in (False, True):
                engine_dir = tmp_path_factory.mktemp("stacked") / f"{kind}-{stacked}"
                compile_engine(tiny_qwen, engine_dir, max_rank=8, target_modules=TARGETS, kv_block_size=block,
                               stacked=stacked, kv_pages=pages)
                handles.append(OrtEngine(engine_dir, threads=2))
            built[kind] = (*handles, [load_adapter(a, handles[0].interface) for a in adapters])
        return built[kind]

    return pair


def test_the_stacked_interface_takes_every_slots_lora_and_a_row_mask(engines):
    single, stacked, _ = engines("pages")
    iface, before = stacked.interface, single.interface
    shapes = {t.name: t.shape for t in iface.inputs}

    # version 7's inputs under version 8's logit positions, which every export takes, with version 9's pages
    assert iface.version == before.version == QUANTIZED_PAGES_INTERFACE_VERSION and iface.stacked and not before.stacked
    assert iface.input_names[-2:] == [ADAPTER_MASK, LOGIT_POSITIONS] and shapes[ADAPTER_MASK] == ("batch", "slots")
    assert shapes["lora_A.0.q_proj+k_proj+v_proj"] == ("slots*24", 64)  # 3 targets x rank 8 per slot, hidden 64
    assert shapes["lora_B.0.q_proj+k_proj+v_proj"] == (128, "slots*24")  # q 64 + k 32 + v 32
    assert iface.adapter_shape(iface.inputs[iface.input_names.index("lora_B.0.q_proj+k_proj+v_proj")]) == (128, 24)
    assert iface.kv_pages == before.kv_pages == PAGES.to_dict()
    # a release binds as it did: the same adapter contract
    assert iface.float_interface_hash == before.float_interface_hash
    assert read_interface(stacked.engine_dir).interface_hash == iface.interface_hash
    # an adapter that recorded the single-adapter engine's hash binds to its stacked form
    assert single_interface(iface).interface_hash == before.interface_hash and before.interface_hash in iface.accepted_hashes


@pytest.mark.parametrize("kind", EACH_KIND)
def test_one_slot_of_the_stacked_engine_computes_todays_engine(kind, engines):
    single, stacked, bound = engines(kind)
    ids = np.random.default_rng(0).integers(0, 96, (2, 14))
    for engine in (single, stacked):
        engine.set_adapter(bound[0])

    want, _ = engine_run(single, ids, split=7)
    got, _ = engine_run(stacked, ids, split=7)

    assert np.abs(got - want).max() <= 1e-4
    prompts = [[3, 14, 15, 92, 65, 35, 89, 7, 9], [35, 89, 7]]
    assert greedy_generate(stacked, prompts, 12) == greedy_generate(single, prompts, 12)


def run_rows(engine, ids, slots):
    """Logits of every position of ``ids`` (B, T), each row on its slot: 6 tokens prefilled, then one per step."""
    return engine_run(engine, ids, split=6, slots=slots)[0]


@pytest.mark.parametrize("kind", EACH_KIND)
def test_rows_of_three_adapters_in_one_forward_compute_what_each_computes_alone(kind, engines):
    single, stacked, bound = engines(kind)
    stacked.set_adapters(bound)
    ids = np.random.default_rng(1).integers(0, 96, (4, 12))
    slots = np.array([2, 0, 1, 0])

    mixed = run_rows(stacked, ids, slots)
    alone, today = [], []
    for b, slot in enumerate(slots):
        alone.append(run_rows(stacked, ids[b : b + 1], slots[b : b + 1])[0])
        single.set_adapter(bound[slot])
        today.append(engine_run(single, ids[b : b + 1], split=6)[0][0])

    assert np.abs(mixed - np.stack(alone)).max() <= 1e-5  # measured: 0 to ~1e-6
    assert np.abs(mixed - np.stack(today)).max() <= 1e-4
    assert np.abs(np.stack(today)[0] - np.stack(today)[2]).max() > 0.1  # the adapters differ visibly


def test_a_fork_keeps_its_slots_when_the_handle_it_came_from_rebinds(engines):
    _, stacked, bound = engines("pages")
    stacked.set_adapters(bound[:2])
    twin = stacked.fork()
    ids = np.random.default_rng(2).integers(0, 96, (1, 9))
    before = run_rows(twin, ids, np.array([1]))

    stacked.set_adapters([bound[2], bound[0]])

    assert np.array_equal(run_rows(twin, ids, np.array([1])), before)
    assert np.abs(run_rows(stacked, ids, np.array([0])) - before).max() > 0.1
    with pytest.raises(ValueError, match="each below the 2 bound"):
        stacked.forward(ids, np.arange(9)[None], np.ones((1, 9), np.int64), slots=np.array([2]))


# ---------------------------------------------------------------- serving: one batch for every release

SERVED = {  # name: (release of the tiny world, product, month)
    "alpha_champion": ("a", "alpha", "2026-10"), "alpha_candidate": ("b", "alpha", "2026-11"),
    "beta_champion": ("b", "beta", "2026-12"),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny release world (``release_testkit``; releases made for its float engine, interface version 3), its
    releases signed for two products, and the stacked form of its engine (version 7)."""
    from release_testkit import copy_release, resign, world
    from server_testkit import manifest_id

    w = world(tmp_path_factory)
    for name, (source, product, month) in SERVED.items():
        stamp = manifest_id(w[source]).partition("+")[2]
        w[name] = copy_release(w[source], w["root"] / name)
        resign(w[name], w["key"], product=product, month=month, release_id=f"{month}+{stamp}")
    w["stacked_engine"] = w["root"] / "stacked-engine"
    compile_engine(w["base"], w["stacked_engine"], max_rank=8, target_modules=TARGETS, ort_threads=1, stacked=True)
    return w


@pytest.mark.slow  # the tiny release world and a stacked engine: ~40 s of setup
def test_two_products_and_a_candidate_decode_in_one_batch_and_answer_as_alone(served):
    """Acceptance (issue 27): rows of alpha's champion, alpha's candidate and beta's champion decode in the same
    steps, and every answer (greedy and seeded sampling) equals the same request alone, through the openai SDK."""
    import concurrent.futures
    import threading

    import openai
    from server_testkit import PROMPT, call, manifest_id, running_server, sample, scrape

    w = served
    models = [manifest_id(w[name]) for name in SERVED]
    requests = [dict(model=m, temperature=t, seed=s) for m in models for t, s in ((0.0, None), (0.9, 7))]
    with running_server(w, release_dirs=(w["root"],), products=("alpha", "beta"), engine=w["stacked_engine"]) as (app, bg):
        assert app.batcher.stacked
        for name in SERVED:
            channel = name.split("_")[1]
            status, body = call(bg.port, "POST", "/v1/adapters", {"path": str(w[name]), "channel": channel})
            assert status == 200, body
        client = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(r, start=None):
            if start is not None:
                start.wait()  # all sent at once: a loaded machine once started the threads apart, and no step held all three
            out = client.completions.create(prompt=PROMPT, max_tokens=24, **r)
            return out.model, out.choices[0].text

        alone = [ask(r) for r in requests]
        mixed_before = scrape(bg.port)
        start = threading.Barrier(len(requests))
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda r: ask(r, start), requests))
        samples = scrape(bg.port)

    assert together == alone
    assert [m for m, _ in alone] == [m for m in models for _ in range(2)]
    assert len({text for _, text in alone[::2]}) == 2  # A's and B's adapters answer differently
    steps = sample(samples, "adapter_decode_batch_releases_count") - sample(mixed_before, "adapter_decode_batch_releases_count")
    one_or_two = (sample(samples, "adapter_decode_batch_releases_bucket", le="2.0")
                  - sample(mixed_before, "adapter_decode_batch_releases_bucket", le="2.0"))
    assert steps - one_or_two > 0  # some steps decoded rows of all three releases together
    assert sample(mixed_before, "adapter_decode_batch_releases_count") == \
        sample(mixed_before, "adapter_decode_batch_releases_bucket", le="1.0")  # alone: one release per step


@pytest.mark.slow
def test_rows_joining_and_leaving_a_stacked_batch_keep_their_releases_weights(served):
    """Release 0's row runs; release 1's joins (a second slot); release 0's leaves and release 2's joins: the slots
    are rebound as [1, 2], release 1's running row moving from slot 1 to slot 0. Every row's tokens are its
    release's alone."""
    import asyncio
    import time

    from server_testkit import PROMPT

    from runtime.engine.generate import decode_steps
    from runtime.engine.sampling import greedy
    from runtime.engine.tokenizer import DeviceTokenizer
    from runtime.serve.active_release import ActiveRelease
    from runtime.serve.batcher import BatchedGeneration, Batcher
    from runtime.serve.generation import StopText
    from runtime.serve.metrics import ServerMetrics

    engine = OrtEngine(served["stacked_engine"], threads=1)
    loras = [load_adapter(a, engine.interface) for a in served["adapters"]]
    loras.append({n: -v if n.startswith("lora_B.") else v for n, v in loras[1].items()})  # release 1's delta negated
    releases = []
    for i, lora in enumerate(loras):
        handle = engine.fork()
        handle.set_adapter(lora)
        releases.append(ActiveRelease(f"r{i}", i + 1, {}, handle, time.time()))
    tokenizer = DeviceTokenizer(served["tokenizer"])
    prompt, lengths = tokenizer.encode(PROMPT), (10, 30, 12)  # no stop ids: each row runs to its max_tokens
    want = [[t[0] for t in decode_steps(r.handle.fork(), [prompt], n, (), tokenizer.pad_id, greedy)]
            for r, n in zip(releases, lengths)]
    batcher = Batcher((), tokenizer.pad_id, ServerMetrics(), stacked=True)
    gens = [BatchedGeneration(batcher, r, [prompt], greedy, [StopText(tokenizer, [])], n) for r, n in zip(releases, lengths)]

    async def consume(g):
        while await g.next_choices() is not None:
            pass
        return g.texts[0].ids

    async def run():
        first = asyncio.ensure_future(consume(gens[0]))
        while gens[0].completion_tokens < 3:
            await asyncio.sleep(0.0002)
        second = asyncio.ensure_future(consume(gens[1]))
        await first  # release 0's row leaves while release 1's decodes on
        assert not all(gens[1].finished)
        return [await first, *(await asyncio.gather(second, consume(gens[2])))]

    assert asyncio.run(run()) == want
    assert want[1][:10] not in (want[0][:10], want[2][:10])  # the row that moved slots would show another's weights
