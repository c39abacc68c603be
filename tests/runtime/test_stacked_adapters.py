"""Stacked adapters (interface version 7): rows of different releases in one forward.

A stacked engine with one slot computes what today's engine computes; rows of three adapters (each with its own
KV scales on the quantized cache) in one forward compute what each row computes alone. Engines are compiled from
the tiny test backbone (``engine_testkit``): GQA over the 4-bit cache (the shipped scheme), the float cache, and
both paged.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_testkit import TARGETS, calibrate, engine_run, make_adapter

from kernels.kv_spec import KVQuantSpec
from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import greedy_generate
from runtime.engine.interface import ADAPTER_MASK, STACKED_INTERFACE_VERSION, read_interface
from tasks.compile import compile_engine

GQA = KVQuantSpec()
BLOCK = 4
KINDS = ("gqa", "float", "gqa-paged", "float-paged")


@pytest.fixture(scope="module")
def adapters(tiny_qwen, tmp_path_factory):
    """Three adapters of the tiny backbone (different seeds and ranks): their engine LoRA inputs and 4-bit KV
    scales, each calibrated on its own merged model."""
    dirs = [make_adapter(tiny_qwen, tmp_path_factory.mktemp("adapter"), r=r, seed=seed)
            for r, seed in ((4, 1), (8, 2), (2, 3))]
    return dirs


@pytest.fixture(scope="module")
def engines(tiny_qwen, adapters, tmp_path_factory):
    """{kind: (today's engine, its stacked twin, [(lora, kv scales)] of the three adapters)}."""
    out = {}
    for kind in KINDS:
        spec = GQA.to_dict() if kind.startswith("gqa") else None
        block = BLOCK if kind.endswith("paged") else None
        pair = []
        for stacked in (False, True):
            engine_dir = tmp_path_factory.mktemp("stacked") / f"{kind}-{stacked}"
            compile_engine(tiny_qwen, engine_dir, max_rank=8, target_modules=TARGETS, kv_spec=spec,
                           kv_attention="gqa" if spec else "standard", kv_block_size=block, stacked=stacked)
            pair.append(OrtEngine(engine_dir, threads=2))
        bound = []
        for adapter_dir in adapters:
            lora = load_adapter(adapter_dir, pair[0].interface)
            bound.append((lora, calibrate(tiny_qwen, GQA, lora) if spec else None))
        out[kind] = (*pair, bound)
    return out


def test_the_stacked_interface_takes_every_slots_lora_a_row_mask_and_per_row_kv_statics(engines):
    single, stacked, _ = engines["gqa-paged"]
    iface, before = stacked.interface, single.interface
    shapes = {t.name: t.shape for t in iface.inputs}

    assert iface.version == STACKED_INTERFACE_VERSION and iface.stacked and not before.stacked
    assert iface.input_names[-1] == ADAPTER_MASK and shapes[ADAPTER_MASK] == ("batch", "slots")
    assert shapes["lora_A.0.q_proj+k_proj+v_proj"] == ("slots", 24, 64)  # 3 targets x rank 8, hidden 64
    assert shapes["lora_B.0.q_proj+k_proj+v_proj"] == (128, "slots", 24)  # q 64 + k 32 + v 32
    assert shapes["k_scale.0"] == ("batch", 2, 16) and shapes["kv_rotation.1"] == ("batch", 16, 16)
    # a release binds as it did: the same adapter contract
    assert iface.float_interface_hash == before.float_interface_hash
    assert read_interface(stacked.engine_dir).interface_hash == iface.interface_hash


@pytest.mark.parametrize("kind", KINDS)
def test_one_slot_of_the_stacked_engine_computes_todays_engine(kind, engines):
    single, stacked, bound = engines[kind]
    ids = np.random.default_rng(0).integers(0, 96, (2, 14))
    for engine in (single, stacked):
        engine.set_adapter(*bound[0])

    want, _ = engine_run(single, ids, split=7)
    got, _ = engine_run(stacked, ids, split=7)

    assert np.abs(got - want).max() <= 1e-4
    prompts = [[3, 14, 15, 92, 65, 35, 89, 7, 9], [35, 89, 7]]
    assert greedy_generate(stacked, prompts, 12) == greedy_generate(single, prompts, 12)


def run_rows(engine, ids, slots, split: int = 6):
    """``engine_run`` with each row on its slot."""
    B, T = ids.shape
    pos = np.broadcast_to(np.arange(T), (B, T))
    mask = np.ones((B, T), dtype=np.int64)
    logits, cache = engine.forward(ids[:, :split], pos[:, :split], mask[:, :split], None, slots=slots)
    out = [logits]
    for t in range(split, T):
        logits, cache = engine.forward(ids[:, t : t + 1], pos[:, t : t + 1], mask[:, : t + 1], cache, slots=slots)
        out.append(logits)
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_of_three_adapters_in_one_forward_compute_what_each_computes_alone(kind, engines):
    single, stacked, bound = engines[kind]
    stacked.set_adapters(bound)
    ids = np.random.default_rng(1).integers(0, 96, (4, 12))
    slots = np.array([2, 0, 1, 0])

    mixed = run_rows(stacked, ids, slots)
    alone, today = [], []
    for b, slot in enumerate(slots):
        alone.append(run_rows(stacked, ids[b : b + 1], slots[b : b + 1])[0])
        single.set_adapter(*bound[slot])
        today.append(engine_run(single, ids[b : b + 1], split=6)[0][0])

    assert np.abs(mixed - np.stack(alone)).max() <= 1e-5  # measured: 0 to ~1e-6
    assert np.abs(mixed - np.stack(today)).max() <= 1e-4
    assert np.abs(np.stack(today)[0] - np.stack(today)[2]).max() > 0.1  # the adapters differ visibly


def test_a_fork_keeps_its_slots_when_the_handle_it_came_from_rebinds(engines):
    _, stacked, bound = engines["gqa-paged"]
    stacked.set_adapters(bound[:2])
    twin = stacked.fork()
    ids = np.random.default_rng(2).integers(0, 96, (1, 9))
    before = run_rows(twin, ids, np.array([1]))

    stacked.set_adapters([bound[2], bound[0]])

    assert np.array_equal(run_rows(twin, ids, np.array([1])), before)
    assert np.abs(run_rows(stacked, ids, np.array([0])) - before).max() > 0.1
    with pytest.raises(ValueError, match="each below the 2 bound"):
        stacked.forward(ids, np.arange(9)[None], np.ones((1, 9), np.int64), slots=np.array([2]))
