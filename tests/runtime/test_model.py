"""The hand-written forward reproduces transformers + PEFT (merged) exactly enough to export."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_testkit import make_adapter
from safetensors.numpy import load_file

from runtime.adapter import load_adapter
from runtime.hashing import backbone_hash
from runtime.interface import build_interface
from runtime.model import ModelFormatError, load_backbone, read_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def hf_merged_logits(model_dir, adapter_dir, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    with torch.no_grad():
        return model.eval()(ids).logits


def engine_lora(model_dir, adapter_dir, max_rank=8, targets=TARGETS):
    iface = build_interface(read_config(model_dir), backbone_hash(model_dir), max_rank, targets)
    lora = load_adapter(adapter_dir, iface)
    return iface, tuple(torch.from_numpy(lora[n]) for n in iface.lora_names)


def run(model, ids, lora, past=None, start=0):
    B, T = ids.shape
    P = 0 if past is None else past[0].shape[2]
    pos = torch.arange(start, start + T).expand(B, T)
    mask = torch.ones(B, P + T, dtype=torch.long)
    with torch.no_grad():
        return model(ids, pos, mask, past if past is not None else model.empty_past(B), lora)


@pytest.mark.parametrize("kind", ["qwen", "llama"])
def test_forward_with_lora_inputs_matches_peft_merged_within_1e4(kind, request, tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{kind}")
    adapter = make_adapter(model_dir, tmp_path / "adapter", r=4)
    iface, lora = engine_lora(model_dir, adapter)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))

    logits, _ = run(load_backbone(model_dir, TARGETS), ids, lora)
    ref = hf_merged_logits(model_dir, adapter, ids)

    assert (logits - ref).abs().max().item() <= 1e-4
    assert (ref - hf_merged_logits(model_dir, None, ids)).abs().max().item() > 1e-2  # the adapter matters


def test_lower_rank_adapter_is_zero_padded_to_max_rank(tiny_qwen, tmp_path):
    adapter = make_adapter(tiny_qwen, tmp_path / "r2", r=2, alpha=4.0, targets=("q_proj", "v_proj"))
    iface, lora = engine_lora(tiny_qwen, adapter, max_rank=8)
    named = dict(zip(iface.lora_names, lora))
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))

    logits, _ = run(load_backbone(tiny_qwen, TARGETS), ids, lora)

    # One A and one B for q/k/v: rank blocks of 8 (q, k, v), output rows q 0:64, k 64:96, v 96:128.
    a, b = named["lora_A.0.q_proj+k_proj+v_proj"], named["lora_B.0.q_proj+k_proj+v_proj"]
    assert a.shape == (24, 64) and b.shape == (128, 24)
    assert a[:2].abs().sum() > 0 and a[2:8].abs().sum() == 0 and a[8:16].abs().sum() == 0  # q rank 2, k untouched
    assert a[16:18].abs().sum() > 0 and a[18:].abs().sum() == 0
    assert b[64:96].abs().sum() == 0 and b[:, 8:16].abs().sum() == 0  # k rows and columns stay zero
    assert b[:64, 16:].abs().sum() == 0 and b[96:, :8].abs().sum() == 0  # block-diagonal
    raw = load_file(adapter / "adapter_model.safetensors")
    raw_bq = next(v for k, v in raw.items() if "layers.0.self_attn.q_proj.lora_B" in k)
    assert torch.allclose(b[:64, :2], 2.0 * torch.from_numpy(raw_bq))  # scale alpha / r folded into B
    assert (logits - hf_merged_logits(tiny_qwen, adapter, ids)).abs().max().item() <= 1e-4


def test_decode_with_cache_matches_one_full_prefill(tiny_qwen, qwen_adapter):
    _, lora = engine_lora(tiny_qwen, qwen_adapter)
    model = load_backbone(tiny_qwen, TARGETS)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))

    full, _ = run(model, ids, lora)
    first, past = run(model, ids[:, :5], lora)
    second, past = run(model, ids[:, 5:8], lora, past, start=5)
    third, past = run(model, ids[:, 8:], lora, past, start=8)

    assert past[0].shape == (2, 2, 9, 16)  # (B, nkv, S, d)
    assert (torch.cat([first, second, third], 1) - full).abs().max().item() <= 1e-5


def test_left_padded_row_matches_the_same_row_alone(tiny_qwen):
    model = load_backbone(tiny_qwen)
    row = torch.tensor([[5, 17, 33, 2]])
    padded = torch.tensor([[0, 0, 5, 17, 33, 2], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        alone, _ = model(row, torch.arange(4)[None], torch.ones(1, 4, dtype=torch.long), model.empty_past(1))
        batched, _ = model(padded, pos, mask, model.empty_past(2))
    assert (batched[0, 2:] - alone[0]).abs().max().item() <= 1e-5


def test_zero_lora_inputs_compute_the_base_model(tiny_llama):
    cfg = read_config(tiny_llama)
    iface = build_interface(cfg, "x", 8, TARGETS)
    zeros = tuple(torch.zeros(*t.shape) for t in iface.inputs if t.name.startswith("lora_"))
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(3))

    logits, _ = run(load_backbone(tiny_llama, TARGETS), ids, zeros)

    assert (logits - hf_merged_logits(tiny_llama, None, ids)).abs().max().item() <= 1e-4


def test_rope_scaling_is_refused_with_a_clear_error(tiny_qwen, tmp_path):
    config = json.loads((tiny_qwen / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))

    with pytest.raises(ModelFormatError, match="rope scaling 'yarn' is not supported"):
        read_config(tmp_path)


def test_tied_embeddings_share_the_embedding_as_lm_head(tiny_llama):
    model = load_backbone(tiny_llama)
    assert model.lm_head is model.embed
    assert np.isclose(read_config(tiny_llama).rope_theta, 10000.0)


def test_lora_on_every_linear_including_the_mlp_matches_peft_merged(tiny_qwen, tmp_path):
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter = make_adapter(tiny_qwen, tmp_path / "all", r=4, targets=every)
    _, lora = engine_lora(tiny_qwen, adapter, targets=every)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(4))

    logits, _ = run(load_backbone(tiny_qwen, every), ids, lora)

    assert (logits - hf_merged_logits(tiny_qwen, adapter, ids)).abs().max().item() <= 1e-4
