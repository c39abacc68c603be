"""The one-forward measure of quantized pages (``tasks.checks.page_quality``) against decoding token by token through
the reference's pages, on the tiny test backbone (head_dim 16, 2 kv heads, 2 layers) with an adapter bound."""

from __future__ import annotations

import numpy as np
import torch
from engine_testkit import TARGETS, qwen_adapter, tiny_qwen  # noqa: F401  (fixtures)

from kernels.kv_spec import PageQuantSpec
from kernels.page_quant import read_back
from runtime.engine.adapter import load_adapter
from runtime.engine.hashing import backbone_hash
from runtime.engine.interface import build_interface
from runtime.engine.model import load_backbone, read_config
from tasks.checks.page_quality import page_read_logits, score_document, sealed_reads

BLOCK = 16
SPEC = PageQuantSpec(k_bits=4, v_bits=4, v_group_size=8)


def adapted_backbone(model_dir, adapter_dir):
    backbone = load_backbone(model_dir, TARGETS)
    iface = build_interface(read_config(model_dir), backbone_hash(model_dir), 8, TARGETS)
    lora = load_adapter(adapter_dir, iface)
    return backbone, tuple(torch.from_numpy(lora[n]) for n in iface.lora_names)


def decoded_logits(backbone, lora, ids: torch.Tensor, spec, prefill: int) -> torch.Tensor:
    """(T, V): ``ids[:prefill]`` prefilled, then one token per step, each reading its past as the pages hold it."""
    with torch.no_grad():
        T = ids.shape[1]
        logits, present = backbone(ids[:, :prefill], torch.arange(prefill)[None], torch.ones(1, prefill, dtype=torch.long),
                                   backbone.empty_past(1), lora)
        kv = [p[0] for p in present]  # per layer K, V (nkv, n, d): float, as the device's pools receive them
        out = [logits[0]]
        for t in range(prefill, T):
            past = []
            for layer in range(backbone.cfg.num_layers):
                k, v = read_back(kv[2 * layer], kv[2 * layer + 1], spec, BLOCK) if spec else (kv[2 * layer], kv[2 * layer + 1])
                past += [k[None], v[None]]
            logits, present = backbone(ids[:, t : t + 1], torch.tensor([[t]]), torch.ones(1, t + 1, dtype=torch.long),
                                       tuple(past), lora)
            kv = [torch.cat([kv[i], present[i][0, :, -1:]], dim=1) for i in range(len(kv))]
            out.append(logits[0])
    return torch.cat(out)


def test_one_forward_gives_the_logits_of_a_prefill_then_token_by_token_decode_through_the_pages(tiny_qwen, qwen_adapter):
    backbone, lora = adapted_backbone(tiny_qwen, qwen_adapter)
    ids = torch.from_numpy(np.random.default_rng(7).integers(0, 96, (1, 83)))

    for prefill in (12, 40):  # a prefill inside the first page, and one that seals page 1 itself
        want = decoded_logits(backbone, lora, ids, SPEC, prefill)
        got = page_read_logits(backbone, ids, SPEC, BLOCK, prefill, lora)[0]
        float_logits = page_read_logits(backbone, ids, None, BLOCK, prefill, lora)[0]

        # float32 reassociation only: K/V computed in one forward or one token at a time differ in their last bits,
        # which can move a code sitting on a rounding boundary by one step (measured: 3 of 83 positions moved by
        # 1.6e-3 once page 4 was sealed, every other position within 6e-6); a misread page moves logits by > 1e-2
        worst = (got - want).abs().max(-1).values  # (T,)
        assert (worst <= 1e-5).float().mean() >= 0.9 and worst.max() <= 5e-3
        assert (got[48:] - float_logits[48:]).abs().max() > 1e-2  # and the pages do cost something from page 2 on


def test_without_a_scheme_it_is_the_backbones_own_forward(tiny_qwen, qwen_adapter):
    backbone, lora = adapted_backbone(tiny_qwen, qwen_adapter)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 96, (2, 50)))
    with torch.no_grad():
        want, _ = backbone(ids, torch.arange(50).expand(2, 50), torch.ones(2, 50, dtype=torch.long), backbone.empty_past(2), lora)

    assert torch.allclose(page_read_logits(backbone, ids, None, BLOCK, 0, lora), want, atol=1e-5)


def test_a_query_reads_only_the_full_pages_between_the_sink_and_its_own_page_sealed_and_only_when_decoded():
    reads = sealed_reads(64, BLOCK, prefill=20)

    assert not reads[:20].any()  # prefilled tokens read their chunk in float
    assert not reads[20:32].any()  # page 1 is still open while tokens 20..31 are decoded
    assert reads[32, 16:32].all() and not reads[32, :16].any() and not reads[32, 32:].any()  # sink float, own page float
    assert reads[63, 16:48].all() and not reads[63, 48:].any()


def test_a_document_scores_its_decoded_half_and_fewer_bits_cost_more(tiny_qwen):
    backbone = load_backbone(tiny_qwen)
    ids = np.random.default_rng(3).integers(0, 96, 96).tolist()

    eight, float_logits = score_document(backbone, ids, PageQuantSpec(k_bits=8, v_bits=8, v_group_size=8), BLOCK, 48)
    two, _ = score_document(backbone, ids, PageQuantSpec(k_bits=2, v_bits=2, v_group_size=8), BLOCK, 48, float_logits)

    assert eight.tokens == two.tokens == 48 and eight.nll_float == two.nll_float
    assert 0.0 <= eight.kl < two.kl  # fewer bits, further from the float cache
