"""Paired rows (``OrtEngine(paired_rows=True)``, ``serve --batch-invariant``): a row's floats are the same alone and in
any batch on an int4 engine with quantized pages, the engine the device serves.

ONNX Runtime's MatMulNBits runs rows in pairs; the row an odd count leaves over (a lone row included) takes a
single-row kernel that sums in another order. Paired, an odd batch runs its last row twice and drops the copy. The
LoRA's first product is computed as (A x^T)^T, which gives a row the same floats at 2 to 16 rows (x A^T did not: at
768 x 24, 2 threads, 2-3 rows and 4 or more differed). Each prompt is prefilled apart, as the batcher does for an
engine that pairs its rows, and the rows decode together. The test backbone (``engine_testkit``, 768 wide, a rank-8
LoRA on q, k, v and o) compiled with K4/V4 pages in blocks of 16, then its projections int4 in blocks of 128:
prompts of 23, 40 and 9 tokens, then three decode steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_testkit import TARGETS, make_adapter, make_model

from kernels.kv_spec import PageQuantSpec
from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import prefill_by_position
from tasks.stages.compile import compile_engine
from tasks.weights.engines import quantize_engine_dir

PROMPTS = [list(np.random.default_rng(seed).integers(1, 96, n)) for seed, n in ((0, 23), (1, 40), (2, 9))]


@pytest.fixture(scope="module")
def int4_pages_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("paired")
    # wider than the tiny backbone, in int4 blocks of 128 (the serving int4's): the single-row kernel sums otherwise
    # at 4 bits in blocks of 64 and 128, not in blocks of 32 (measured on single MatMulNBits nodes, ORT 1.32)
    model = make_model(root / "model", "qwen2", hidden_size=768, intermediate_size=1024, num_attention_heads=8)
    compile_engine(model, root / "pages", max_rank=8, target_modules=TARGETS, kv_block_size=16,
                   kv_pages=PageQuantSpec(v_group_size=8).to_dict())
    quantize_engine_dir(root / "pages", root / "int4", "int4", block_size=128)
    return root / "int4", make_adapter(model, root / "adapter", r=8)


def opened(int4_pages_engine, paired_rows: bool) -> OrtEngine:
    """The engine with the adapter bound (a LoRA of zeros would hide its products' rounding)."""
    engine_dir, adapter_dir = int4_pages_engine
    engine = OrtEngine(engine_dir, threads=2, paired_rows=paired_rows)
    engine.set_adapter(load_adapter(adapter_dir, engine.interface))
    return engine


def logits_of(engine: OrtEngine, rows: list[int]) -> list[np.ndarray]:
    """Each of ``rows``' (indices into PROMPTS) logits: its prefill's last (each prompt apart), then three decode steps'
    together (next tokens fixed per prompt, so the company cannot change them), each (V,) per step: [row][step]."""
    prompts = [PROMPTS[r] for r in rows]
    prefilled = [prefill_by_position(engine, [p], np.zeros(1, dtype=np.int64), chunk=16) for p in prompts]
    cache = engine.concat_caches([c for _, c in prefilled])
    steps = [np.concatenate([last[:, 0] for last, _ in prefilled])]
    tokens = np.array([[5 + r] for r in rows], dtype=np.int64)
    positions = np.array([[len(p)] for p in prompts], dtype=np.int64)
    for _ in range(3):
        logits, cache = engine.forward(tokens, positions, np.ones_like(tokens), cache)
        steps.append(logits[:, -1])
        positions = positions + 1
    return [np.stack([s[i] for s in steps]) for i in range(len(rows))]


def test_paired_rows_give_each_row_the_same_floats_alone_in_an_even_and_in_an_odd_batch(int4_pages_engine):
    engine = opened(int4_pages_engine, paired_rows=True)
    alone = [logits_of(engine, [r])[0] for r in range(3)]
    odd = logits_of(engine, [0, 1, 2])
    even = logits_of(engine, [2, 0])
    for r in range(3):
        assert np.array_equal(odd[r], alone[r])  # bit for bit, the left-over row (2) included
    assert np.array_equal(even[0], alone[2]) and np.array_equal(even[1], alone[0])
    assert engine.pool.used_bytes == 0  # every cache went back when dropped: the copy of a row held no blocks


def test_unpaired_the_row_an_odd_batch_leaves_over_is_summed_otherwise(int4_pages_engine):
    # why the option exists: the same engine without it gives the left-over row other floats than in a pair
    engine = opened(int4_pages_engine, paired_rows=False)
    paired = logits_of(engine, [0, 2])[1]  # row 2 second of a pair
    left_over = logits_of(engine, [0, 1, 2])[2]  # row 2 left over by the pair (0, 1)
    assert not np.array_equal(paired, left_over)
    assert np.abs(paired - left_over).max() < 0.5  # the same answer up to the order of a sum


def test_paired_rows_need_a_paged_engine(tiny_qwen, tmp_path):
    compile_engine(tiny_qwen, tmp_path / "padded", max_rank=8, target_modules=TARGETS)
    with pytest.raises(ValueError, match="paired rows need a paged engine"):
        OrtEngine(tmp_path / "padded", threads=1, paired_rows=True)
