"""Quantized pages (interface version 9): the paged cache whose full pages the runtime seals into codes with their own
scales, the sink and the open page float. Sealing against its PyTorch reference and its boundaries, the engine's
logits against the float paged engine's and against the float backbone reading the reference's pages, stacked
adapters, and the refusals of an engine and a runtime that disagree.

Engines are compiled from the tiny test backbone (``engine_testkit``: head_dim 16, 2 kv heads, 2 layers) in pages of
16 tokens, values in groups of 8 channels: K8/V8, K4/V4 (with stacked adapters, as the device serves) and K2/V2, and
the float paged engine. 3 bits are read by the same graph ops (``tests/kernels/test_onnx_export.py`` runs them at
every width); an engine per width costs ~40 s of export on the test machine.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from engine_testkit import TARGETS, engine_run, make_adapter

from kernels.kv_spec import PageQuantSpec, key_code_shape
from kernels.page_quant import read_back, seal_packed
from runtime.engine import interface as interface_module
from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.generate import greedy_generate
from runtime.engine.hashing import backbone_hash
from runtime.engine.interface import (
    FLOAT_BLOCK_TABLE,
    QUANTIZED_PAGES_INTERFACE_VERSION,
    SEALED_BLOCKS_AXIS,
    InterfaceError,
    build_interface,
    quantized_pages_tensors,
    read_interface,
    single_interface,
    write_interface,
)
from runtime.engine.kv_blocks import KVBudgetExceeded, PoolTensor
from runtime.engine.kv_pages import PagePool, PagesCache
from runtime.engine.model import load_backbone, read_config
from tasks.stages.compile import CompileError, compile_engine

BLOCK, GROUP = 16, 8
WIDTHS = [(8, 8), (4, 4), (2, 2)]
# Measured on the tiny backbone against the float paged engine (``test_quantized_pages_track_the_float_paged_engine``,
# 2 rows x 160 tokens, 144 decode positions each, 9 pages sealed at the end): mean KL per position, max |logit diff|
# (logits spread over [-2.5, 2.5]): K8/V8 9.6e-7, 0.009; K4/V4 2.9e-4, 0.16; K2/V2 6.3e-3, 0.55 (K3/V3, not compiled
# here: 1.1e-3, 0.26). The bounds are those figures with about 2x of room; the order of the widths is asserted as measured.
BOUNDS = {(8, 8): (2e-6, 0.02), (4, 4): (6e-4, 0.35), (2, 2): (1.3e-2, 1.1)}


def spec_of(k_bits: int, v_bits: int) -> PageQuantSpec:
    return PageQuantSpec(k_bits=k_bits, v_bits=v_bits, v_group_size=GROUP)


# Per-layer widths, as calibration writes them (``tasks.checks.page_widths``): layer 0 keys at 8 bits and values at 3, layer 1
# keys at 2 and values at 4. Its pools and its graph's read differ per layer.
LAYERED = spec_of(2, 2).with_layer_bits([(8, 3), (2, 4)])


def compiled(model_dir, engine_dir, spec: PageQuantSpec | None, stacked: bool = False):
    compile_engine(model_dir, engine_dir, max_rank=8, target_modules=TARGETS, kv_block_size=BLOCK, stacked=stacked,
                   kv_pages=None if spec is None else spec.to_dict())
    return engine_dir


@pytest.fixture(scope="module")
def engines(tiny_qwen, qwen_adapter, tmp_path_factory):
    """{(k_bits, v_bits): pages engine, "float": the float paged engine}, the same adapter bound on each (K4/V4's
    engine takes stacked adapters: bound in its slot 0)."""
    root = tmp_path_factory.mktemp("pages")
    dirs = {bits: compiled(tiny_qwen, root / f"k{bits[0]}v{bits[1]}", spec_of(*bits), stacked=bits == (4, 4))
            for bits in WIDTHS}
    dirs["layered"] = compiled(tiny_qwen, root / "layered", LAYERED)
    dirs["float"] = compiled(tiny_qwen, root / "float", None)
    out = {}
    for name, engine_dir in dirs.items():
        out[name] = OrtEngine(engine_dir, threads=2)
        out[name].set_adapter(load_adapter(qwen_adapter, out[name].interface))
    return out


class RecordedKV:
    """Every K/V a pages cache is given, per row and pool name, in order: spied on ``PagesCache.append``."""

    def __init__(self, monkeypatch):
        self.rows: dict[int, dict[str, list[np.ndarray]]] = {}
        original = PagesCache.append

        def append(cache, outputs, real):
            for b in range(real.shape[0]):
                for name, new_kv in outputs.items():
                    self.rows.setdefault(b, {}).setdefault(name, []).append(new_kv[b][:, real[b]])  # (nkv, t, d)
            original(cache, outputs, real)

        monkeypatch.setattr(PagesCache, "append", append)

    def row(self, b: int) -> dict[str, np.ndarray]:
        """{pool name: (nkv, n, d)}: row b's K/V at positions 0..n-1."""
        return {name: np.concatenate(parts, axis=1) for name, parts in self.rows[b].items()}


def test_the_engine_stores_the_pytorch_references_codes_and_its_float_pages_as_given(engines, monkeypatch):
    ids = np.random.default_rng(3).integers(0, 96, (2, 75))
    for bits in [*WIDTHS, "layered"]:
        spec = engines[bits].page_spec
        recorded = RecordedKV(monkeypatch)
        _, cache = engine_run(engines[bits], ids, split=21)  # a prefill across page 1, then one token a step
        stored = cache.to_numpy()

        assert cache.lengths.tolist() == [75, 75] and [len(b) for b in cache.blocks] == [3, 3]  # pages 1-3 sealed
        for b in range(2):
            kv = recorded.row(b)
            for layer in range(2):
                k, v = (torch.from_numpy(kv[f"pool_{kind}.{layer}"]) for kind in ("key", "value"))  # (nkv, 75, d)
                pages = [t[:, BLOCK : 4 * BLOCK].unflatten(1, (3, BLOCK)).transpose(0, 1) for t in (k, v)]  # (3, nkv, bs, d)
                for role, want in seal_packed(*pages, spec.layer(layer)).items():  # (3, nkv, slots, w) -> (nkv, 3 slots, w)
                    got = stored[f"pool_{role}.{layer}"][b]
                    assert np.array_equal(got, want.transpose(0, 1).flatten(1, 2).numpy()), (bits, role)
                for kind, t in (("key", k), ("value", v)):  # float pages: the sink, and the open page (11 tokens)
                    floats = stored[f"pool_{kind}.{layer}"][b]  # (nkv, 2 bs, d)
                    assert np.array_equal(floats[:, :BLOCK], t[:, :BLOCK].numpy())
                    assert np.array_equal(floats[:, BLOCK : BLOCK + 11], t[:, 4 * BLOCK :].numpy())


def test_a_page_is_sealed_exactly_when_its_last_slot_is_written(engines):
    engine = engines[(4, 4)]
    ids = np.arange(40, dtype=np.int64)[None] % 90
    _, cache = engine.forward(ids[:, :31], np.arange(31)[None], np.ones((1, 31), np.int64), None)
    # slots 16..30 of page 1 written: its slot 14 is the last, so it is still the open page, float
    assert cache.blocks == [[]] and len(cache.float_blocks[0]) == 2
    open_block = cache.float_blocks[0][1]
    float_before = engine.pool.float.used_blocks

    _, cache = engine.forward(ids[:, 31:32], np.array([[31]]), np.ones((1, 32), np.int64), cache)
    # slot 15 of page 1 written: sealed now, its float block given back
    assert len(cache.blocks[0]) == 1 and len(cache.float_blocks[0]) == 1
    assert engine.pool.float.used_blocks == float_before - 1 and open_block not in cache.float_blocks[0]

    _, cache = engine.forward(ids[:, 32:33], np.array([[32]]), np.ones((1, 33), np.int64), cache)
    assert len(cache.blocks[0]) == 1 and len(cache.float_blocks[0]) == 2  # page 2 opens, float


def test_sealing_is_deterministic_across_chunkings_and_batches():
    """The same K/V through the cache alone in one prefill, in chunks of 7, one token at a time, and batched with
    rows of other lengths arriving left-padded: the same codes, scales and float pages, byte for byte."""
    spec, nkv, d = spec_of(4, 3), 2, 16
    float_tensors = [PoolTensor(f"pool_{kind}.{i}", (nkv, BLOCK, d), "float32") for i in range(2) for kind in ("key", "value")]
    sealed_tensors = [PoolTensor(t.name, tuple(t.shape[1:]), t.dtype)
                      for t in quantized_pages_tensors(2, nkv, d, BLOCK, spec.to_dict())]
    pool = PagePool(float_tensors, sealed_tensors, BLOCK, None)
    rng = np.random.default_rng(0)
    rows = [{t.name: rng.standard_normal((nkv, n, d)).astype(np.float32) * 3 for t in float_tensors} for n in (70, 45, 33)]

    def pages_of(cache: PagesCache, b: int) -> dict[str, np.ndarray]:
        """Row b's pages from the cache's copy of the pools: its sealed blocks; of its float blocks the slots it
        filled (a float block taken again keeps what its last row left past them, masked)."""
        n, out = int(cache.lengths[b]), {}
        filled = np.arange(2 * BLOCK) < [min(n, BLOCK)] * BLOCK + [n % BLOCK if n > BLOCK else 0] * BLOCK  # sink, open
        for name, array in cache.to_numpy().items():
            if name in pool.float.arrays:
                out[name] = array[b][:, filled[: array.shape[2]]]
            else:
                out[name] = array[b][:, : len(cache.blocks[b]) * pool.arrays[name].shape[2]]
        return out

    def fed(row_ids: list[int], steps: list[list[tuple[int, int] | None]]) -> PagesCache:
        """``row_ids``'s rows in one cache; each step gives each row a span of its tokens (None: none, as a row
        left-padded out of a prefill chunk), written at once the way a forward's outputs are."""
        cache = PagesCache.empty(pool, spec, len(row_ids))
        for spans in steps:
            T = max(b - a for a, b in (s for s in spans if s is not None))
            real = np.zeros((len(row_ids), T), dtype=bool)
            outputs = {name: np.zeros((len(row_ids), nkv, T, d), np.float32) for name in rows[0]}
            for r, (row, span) in enumerate(zip(row_ids, spans)):
                if span is not None:
                    a, b = span
                    real[r, T - (b - a):] = True  # left-padded, as generate.left_padded pads a prefill
                    for name in outputs:
                        outputs[name][r, :, T - (b - a):] = rows[row][name][:, a:b]
            cache.append(outputs, real)
        return cache

    def alone(row: int, chunk: int) -> dict[str, np.ndarray]:
        n = rows[row]["pool_key.0"].shape[1]
        return pages_of(fed([row], [[(a, min(a + chunk, n))] for a in range(0, n, chunk)]), 0)

    want = alone(0, 70)
    rows_a_page = key_code_shape(spec.k_bits, BLOCK, d)[0]
    assert [want[f"pool_key_codes.{i}"].shape[1] for i in range(2)] == [3 * rows_a_page] * 2  # pages 1-3 sealed, 4 open
    for got in (alone(0, 7), alone(0, 1), alone(0, 16)):
        assert got.keys() == want.keys() and all(np.array_equal(got[n], want[n]) for n in want)

    # row 0 with rows 1 and 2: 1 joins at the first step, 2 at the fourth; chunks of 9, then 5 tokens a step
    steps = [[(0, 9), (0, 9), None], [(9, 18), (9, 18), None], [(18, 27), (18, 27), None], [(27, 36), (27, 36), (0, 9)]]
    steps += [[(a, min(a + 5, 70)), (a, min(a + 5, 45)) if a < 45 else None,
               (a - 27, min(a - 22, 33)) if a - 27 < 33 else None] for a in range(36, 70, 5)]
    batched = fed([0, 1, 2], steps)
    assert batched.lengths.tolist() == [70, 45, 33]
    for b, row in enumerate((0, 1, 2)):
        got, want = pages_of(batched, b), alone(row, 64)
        assert all(np.array_equal(got[n], want[n]) for n in want), row


def test_the_sink_and_open_pages_are_read_in_float(engines):
    # rows of up to 31 tokens hold only their sink and open pages: the float paged engine's logits, bit for bit
    ids = np.random.default_rng(5).integers(0, 96, (2, 40))
    got, cache = engine_run(engines[(4, 4)], ids, split=9)
    want, _ = engine_run(engines["float"], ids, split=9)

    assert np.array_equal(got[:, :32], want[:, :32])  # positions 0..31: nothing sealed before position 32 reads
    assert np.abs(got[:, 32:] - want[:, 32:]).max() > 1e-3  # page 1 sealed at 4 bits from there on
    assert [len(b) for b in cache.blocks] == [1, 1]


@pytest.mark.parametrize("name", [(4, 4), "layered"])
def test_the_engines_logits_are_the_float_backbone_reading_the_references_pages(engines, tiny_qwen, qwen_adapter,
                                                                                monkeypatch, name):
    engine = engines[name]
    ids = np.random.default_rng(7).integers(0, 96, (1, 70))
    recorded = RecordedKV(monkeypatch)
    got, _ = engine_run(engine, ids, split=12)
    kv = recorded.row(0)
    model = load_backbone(tiny_qwen, TARGETS)
    lora = load_adapter(qwen_adapter, engine.interface)
    lora = tuple(torch.from_numpy(lora[n]) for n in engine.interface.lora_names)

    worst = 0.0
    for t in range(12, 70):  # decode positions: token t read its past 0..t-1 as the pages held it then
        past = []
        for layer in range(2):
            k, v = read_back(*(torch.from_numpy(kv[f"pool_{kind}.{layer}"][:, :t]) for kind in ("key", "value")),
                             engine.page_spec.layer(layer), BLOCK)
            past += [k[None], v[None]]
        with torch.no_grad():
            want, _ = model(torch.from_numpy(ids[:, t : t + 1]), torch.tensor([[t]]), torch.ones(1, t + 1, dtype=torch.long),
                            tuple(past), lora)
        worst = max(worst, float(np.abs(got[:, t] - want[:, 0].numpy()).max()))
    assert worst <= 1e-5  # float32 rounding between ORT and eager torch; a misread page moves logits by > 1e-2


def test_quantized_pages_track_the_float_paged_engine(engines):
    ids = np.random.default_rng(11).integers(0, 96, (2, 160))
    want, _ = engine_run(engines["float"], ids, split=16)
    p = torch.softmax(torch.from_numpy(want[:, 16:]), -1)
    measured = {}
    for bits in WIDTHS:
        got, _ = engine_run(engines[bits], ids, split=16)
        q = torch.log_softmax(torch.from_numpy(got[:, 16:]), -1)
        kl = float((p * (p.log() - q)).sum(-1).mean())
        measured[bits] = (kl, float(np.abs(got[:, 16:] - want[:, 16:]).max()))
    print("\nquantized pages vs float paged, tiny backbone (mean KL, max |logit diff|):",
          {f"K{k}/V{v}": (f"{kl:.2e}", f"{diff:.4f}") for (k, v), (kl, diff) in measured.items()})
    for bits, (kl, diff) in measured.items():
        assert kl <= BOUNDS[bits][0] and diff <= BOUNDS[bits][1], (bits, kl, diff)
    kls = [measured[bits][0] for bits in WIDTHS]
    assert kls == sorted(kls)  # fewer bits, further from the float cache


def test_float_pages_on_a_pages_engine_decode_what_the_float_paged_engine_does(engines):
    """The KV gate's reference on the device's own engine (``tasks.checks.page_quality.engine_page_quality``): the
    same graph decoding over float pages only, so that the pages alone differ from it, not the decode path."""
    from tasks.checks.page_quality import _decoded_logits, engine_page_quality, float_pages_engine

    ids = np.random.default_rng(5).integers(0, 96, (1, 83))  # 6 pages: 4 would be sealed by 83
    want, _ = engine_run(engines["float"], ids, split=20)
    pages = engines[(2, 2)]
    got = _decoded_logits(float_pages_engine(pages), ids, 20)
    sealed = _decoded_logits(pages, ids, 20)

    assert np.abs(got - want[0, 19:-1]).max() <= 1e-4
    assert np.abs(sealed[-30:] - want[0, -31:-1]).max() > 1e-2  # the same engine's sealed pages do move them
    documents = np.random.default_rng(6).integers(0, 96, (3, 70)).tolist()
    k8, k2 = (engine_page_quality(engines[bits], documents) for bits in ((8, 8), (2, 2)))
    assert k8["tokens"] == k2["tokens"] == 3 * 35
    assert 0 < k8["kl_mean"] < BOUNDS[(8, 8)][0] < k2["kl_mean"]
    assert k8["perplexity_float_cache"] == pytest.approx(k2["perplexity_float_cache"], rel=1e-5)  # one reference


def test_greedy_answers_through_quantized_pages_are_the_same_batched_and_alone(engines):
    engine = engines[(2, 2)]
    prompts = [[3, 14, 15, 92, 65, 35, 89, 7, 9] * 3, [35, 89, 7], [5] * 37]  # left-padded to 37 together

    batched = greedy_generate(engine, prompts, max_new_tokens=24)
    alone = greedy_generate(engine, prompts, max_new_tokens=24, batch_size=1)

    assert batched == alone and [len(t) for t in batched] == [24, 24, 24]
    assert engine.pool.used_bytes == 0  # every generation's float and sealed pages went back


def test_stacked_adapters_decode_each_row_on_quantized_pages_as_alone(engines, tiny_qwen, qwen_adapter, tmp_path_factory):
    engine = engines[(4, 4)]
    other = make_adapter(tiny_qwen, tmp_path_factory.mktemp("other-adapter"), seed=2)
    loras = [load_adapter(a, engine.interface) for a in (qwen_adapter, other)]
    ids = np.random.default_rng(13).integers(0, 96, (2, 50))
    alone = []
    for lora in loras:
        engine.set_adapter(lora)
        alone.append(engine_run(engine, ids, split=20)[0])  # (2, 50, V): both rows on this adapter
    engine.set_adapters(loras)

    got, _ = engine_run(engine, ids, split=20, slots=np.array([0, 1]))

    engine.set_adapter(loras[0])
    for row in range(2):
        assert np.abs(got[row] - alone[row][row]).max() <= 1e-5
    assert np.abs(alone[0][1] - alone[1][1]).max() > 1e-2  # row 1 on the first adapter would read otherwise


def test_the_interface_records_the_scheme_and_keeps_the_float_contract(engines, tiny_qwen, tiny_engine):
    stacked = engines[(4, 4)].interface
    cfg = read_config(tiny_qwen)
    iface = build_interface(cfg, backbone_hash(tiny_qwen), 8, TARGETS, kv_block_size=BLOCK, logit_positions=True,
                            kv_pages=spec_of(3, 3).to_dict())
    assert single_interface(stacked).interface_hash == build_interface(
        cfg, backbone_hash(tiny_qwen), 8, TARGETS, kv_block_size=BLOCK, logit_positions=True,
        kv_pages=spec_of(4, 4).to_dict()).interface_hash  # a release made for the one-adapter form binds
    for one in (stacked, iface):
        assert one.version == QUANTIZED_PAGES_INTERFACE_VERSION and one.paged and one.kv_block_size == BLOCK
        assert one.float_interface_hash == read_interface(tiny_engine).float_interface_hash
        assert one.input_names[3:5] == ["block_table", FLOAT_BLOCK_TABLE]
    assert stacked.kv_pages == spec_of(4, 4).to_dict() and iface.kv_pages == spec_of(3, 3).to_dict()
    specs = {t.name: t for t in iface.inputs}
    assert specs["pool_key_codes.1"].shape == (SEALED_BLOCKS_AXIS, 2, BLOCK, 6)  # 16 channels at 3 bits: 6 bytes
    assert specs["pool_value_scale.0"].shape == (SEALED_BLOCKS_AXIS, 2, BLOCK, 2) and specs["pool_key_min.0"].dtype == "uint8"
    assert specs["pool_key_base.0"].shape == (SEALED_BLOCKS_AXIS, 2, 1, 3) and specs["pool_key_base.0"].dtype == "float16"
    # a sealed page of K3/V3 per layer and head: keys 16 x 6 code bytes + 16 (scale, minimum) pairs of 8-bit codes + a
    # key_base of 3 fp16, values 16 x 6 + 16 tokens x 2 groups x 2 fp16; two layers, two heads; over its 16 tokens
    assert iface.kv_bytes_per_token == 2 * 2 * ((96 + 32 + 6) + (96 + 128)) // BLOCK


def refused(engine_dir, tmp_path, **changes) -> str:
    """The message ``OrtEngine`` refuses a copy of ``engine_dir`` with, its interface changed as ``changes`` say."""
    copy = tmp_path / "engine"
    shutil.copytree(engine_dir, copy)
    iface = read_interface(copy)
    write_interface(dataclasses.replace(iface, **changes), copy / "interface.json")
    with pytest.raises(InterfaceError) as err:
        OrtEngine(copy, threads=1)
    return str(err.value)


def test_an_engine_whose_pages_this_runtime_cannot_seal_is_refused_naming_them(engines, tmp_path):
    engine_dir = engines[(2, 2)].engine_dir
    message = refused(engine_dir, tmp_path / "a", kv_pages={"k_bits": 5, "v_bits": 4, "v_group_size": GROUP})
    assert "are not a scheme this runtime seals" in message and "k_bits=5 is not one of (2, 3, 4, 8)" in message
    message = refused(engine_dir, tmp_path / "b", kv_pages={"k_bits": 4, "v_bits": 4, "v_group_size": GROUP,
                                                            "rotation": "hadamard"})
    assert "unknown fields ['rotation']" in message and "update the runtime or recompile the engine" in message


def test_an_interface_whose_pages_differ_from_its_graphs_is_refused(engines, tmp_path):
    iface = engines[(8, 8)].interface
    other = spec_of(2, 8).to_dict()
    pools = {t.name: t for t in quantized_pages_tensors(2, 2, 16, BLOCK, other)}
    inputs = tuple(pools.get(t.name, t) for t in iface.inputs)
    message = refused(engines[(8, 8)].engine_dir, tmp_path / "a", kv_pages=other, inputs=inputs)
    assert "the graph's pools ['pool_key_codes.0', 'pool_key_codes.1'] are not those of the quantized pages K2/V8" in message
    message = refused(engines[(8, 8)].engine_dir, tmp_path / "b", kv_pages=other)  # the pools left as 8-bit
    assert "its sealed pools are not the ones this scheme stores" in message


def test_a_runtime_that_does_not_speak_version_9_refuses_the_engine(engines, monkeypatch):
    monkeypatch.setattr(interface_module, "SUPPORTED_VERSIONS", interface_module.SUPPORTED_VERSIONS[:-1])
    with pytest.raises(InterfaceError, match="interface version 9 but this runtime speaks 3, 6, 7, 8; recompile"):
        read_interface(engines[(8, 8)].engine_dir)


def test_pages_the_backbone_cannot_hold_or_without_blocks_are_refused_at_compile(tiny_qwen, tmp_path):
    with pytest.raises(CompileError, match=r"v_group_size=32 does not divide head_dim=16; no kv_block_size"):
        compile_engine(tiny_qwen, tmp_path / "e", max_rank=8, target_modules=TARGETS,
                       kv_pages=PageQuantSpec(v_group_size=32).to_dict())
    assert not (tmp_path / "e").exists()


def test_the_kv_budget_counts_float_and_sealed_pages_and_refuses_before_writing():
    spec, nkv, d = spec_of(4, 4), 2, 16
    float_tensors = [PoolTensor(f"pool_{kind}.0", (nkv, BLOCK, d), "float32") for kind in ("key", "value")]
    sealed_tensors = [PoolTensor(t.name, tuple(t.shape[1:]), t.dtype)
                      for t in quantized_pages_tensors(1, nkv, d, BLOCK, spec.to_dict())]
    float_bytes = 2 * nkv * BLOCK * d * 4  # 4,096
    sealed_bytes = nkv * ((BLOCK * 8 + 2 * d + 3 * 2) + (BLOCK * 8 + 2 * BLOCK * 2 * 2))  # 2 x (166 + 256) = 844
    pool = PagePool(float_tensors, sealed_tensors, BLOCK, budget_bytes=2 * float_bytes + 3 * sealed_bytes)
    assert pool.row_bytes(16) == float_bytes and pool.row_bytes(17) == 2 * float_bytes
    assert pool.row_bytes(5 * BLOCK) == 2 * float_bytes + 3 * sealed_bytes  # sink, 3 sealed, open: the worst case

    cache = PagesCache.empty(pool, spec, 1)
    kv = np.random.default_rng(0).standard_normal((1, nkv, 5 * BLOCK, d)).astype(np.float32)
    cache.append({"pool_key.0": kv[:, :, :75], "pool_value.0": kv[:, :, :75]}, np.ones((1, 75), bool))
    assert pool.used_bytes == 2 * float_bytes + 3 * sealed_bytes == cache.allocated_bytes()

    other = PagesCache.empty(pool, spec, 1)
    with pytest.raises(KVBudgetExceeded, match=f"{float_bytes} bytes of KV pages needed, 0 of {pool.budget_bytes} free"):
        other.append({"pool_key.0": kv[:, :, :3], "pool_value.0": kv[:, :, :3]}, np.ones((1, 3), bool))
    assert other.lengths.tolist() == [0] and other.float_blocks == [[]]  # nothing taken, nothing written
    cache.append({"pool_key.0": kv[:, :, 75:], "pool_value.0": kv[:, :, 75:]}, np.ones((1, 5), bool))  # page 4 seals
    assert pool.used_bytes == float_bytes + 4 * sealed_bytes
    del cache, other
    assert pool.used_bytes == 0
    with pytest.raises(KVBudgetExceeded, match="less than one float page"):
        PagePool(float_tensors, sealed_tensors, BLOCK, budget_bytes=float_bytes - 1)
