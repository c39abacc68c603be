"""The hand-written forward reproduces transformers + PEFT (merged) exactly enough to export."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from engine_testkit import make_adapter, make_model
from safetensors import safe_open
from safetensors.numpy import load_file

from runtime.engine.adapter import load_adapter
from runtime.engine.backbone_config import ModelFormatError
from runtime.engine.hashing import backbone_hash
from runtime.engine.interface import build_interface
from runtime.engine.model import load_backbone, read_config, read_weights

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


def test_unsupported_rope_type_is_refused_naming_file_key_and_value(tiny_qwen, tmp_path):
    config = json.loads((tiny_qwen / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))

    with pytest.raises(ModelFormatError) as err:
        read_config(tmp_path)
    assert str(err.value) == (f"{tmp_path / 'config.json'}: rope_parameters.rope_type 'yarn' is not supported "
                              "(default, linear, llama3)")


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


# ---------------------------------------------------------------- checkpoints people have

@pytest.mark.parametrize("changes", [
    {"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21},  # as Qwen2.5-0.5B ships
    {"use_sliding_window": True, "sliding_window": 256, "max_window_layers": 0},  # window covers every position
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},  # no layer slides
], ids=["off", "window-covers-context", "no-sliding-layer"])
def test_qwen2_sliding_window_that_never_applies_is_accepted(tiny_qwen, tmp_path, changes):
    model_dir = shutil.copytree(tiny_qwen, tmp_path / "qwen")
    config = json.loads((model_dir / "config.json").read_text()) | changes
    config.pop("layer_types")  # derived from max_window_layers, as in 4.x checkpoints
    (model_dir / "config.json").write_text(json.dumps(config))
    assert read_config(model_dir).model_type == "qwen2"


LONG = 200  # tokens: past the llama3 fixtures' original 64-token context, where scaled RoPE differs from plain

LINEAR = {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}
LLAMA3 = {"tie_word_embeddings": False, "rope_parameters": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 500000.0}}


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def max_logit_diff(model_dir, T: int = LONG) -> float:
    """max |our forward - transformers| over the logits of 2 random sequences of T tokens, fp32."""
    ids = torch.randint(0, 96, (2, T), generator=torch.Generator().manual_seed(5))
    ours, _ = run(load_backbone(model_dir), ids, ())
    with torch.no_grad():
        ref = hf_model(model_dir)(ids).logits
    return (ours - ref).abs().max().item()


def plain_rope(inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
    d = 2 * inv_freq.numel()
    return 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))


@pytest.mark.parametrize("overrides", [LINEAR, LLAMA3], ids=["linear", "llama3"])
def test_scaled_rope_forward_matches_transformers_within_1e4(overrides, tmp_path):
    model_dir = make_model(tmp_path / "m", "llama", **overrides)

    inv_freq = load_backbone(model_dir).inv_freq
    assert torch.equal(inv_freq, hf_model(model_dir).model.rotary_emb.inv_freq)  # the same float32 numbers
    theta = overrides["rope_parameters"]["rope_theta"]
    assert (inv_freq != plain_rope(inv_freq, theta)).any()
    assert max_logit_diff(model_dir) <= 1e-4


def test_llama3_rope_keeps_high_divides_low_and_smooths_medium_frequencies(tmp_path):
    inv_freq = load_backbone(make_model(tmp_path / "m", "llama", **LLAMA3)).inv_freq
    plain = plain_rope(inv_freq, 500000.0)
    wavelen = 2 * torch.pi / plain  # bands of original 64 tokens: < 64/4 kept, > 64/1 divided by 8
    high, low = wavelen < 16, wavelen > 64
    assert high.any() and low.any() and (~high & ~low).any()  # every band is exercised
    assert torch.equal(inv_freq[high], plain[high])
    assert torch.allclose(inv_freq[low], plain[low] / 8.0)
    medium = ~high & ~low
    assert ((inv_freq[medium] < plain[medium]) & (inv_freq[medium] > plain[medium] / 8.0)).all()


def test_transformers_4_rope_scaling_spelling_reads_like_rope_parameters(tmp_path):
    model_dir = make_model(tmp_path / "m", "llama", **LINEAR)
    config = json.loads((model_dir / "config.json").read_text())
    del config["rope_parameters"]
    config |= {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}  # as 4.x saved it
    (model_dir / "config.json").write_text(json.dumps(config))

    assert read_config(model_dir).rope_scaling.factor == 4.0
    assert max_logit_diff(model_dir) <= 1e-4


@pytest.mark.parametrize("kind, overrides", [
    ("qwen2", {"tie_word_embeddings": False}),  # q/k/v bias, untied head (Qwen2-7B)
    ("qwen2", {"tie_word_embeddings": True}),  # q/k/v bias, tied head (Qwen2-0.5B)
    ("llama", {"tie_word_embeddings": False}),  # untied head (Llama 2/3)
    ("llama", {"attention_bias": True}),  # q/k/v and o_proj bias
], ids=["qwen2-untied", "qwen2-tied", "llama-untied", "llama-attention-bias"])
def test_architecture_variants_match_transformers_within_1e4(kind, overrides, tmp_path):
    model_dir = make_model(tmp_path / "m", kind, **overrides)

    model = load_backbone(model_dir)
    assert (model.lm_head is model.embed) == overrides.get("tie_word_embeddings", True)
    if kind == "llama" and overrides.get("attention_bias"):
        assert model.blocks[0].o_b is not None and model.blocks[0].qkv_b is not None
    assert max_logit_diff(model_dir, T=32) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_safetensors_match_transformers_upcast_to_fp32(dtype, tiny_llama, tmp_path):
    hf_model(tiny_llama).to(dtype).save_pretrained(tmp_path / "half")

    with safe_open(tmp_path / "half" / "model.safetensors", framework="pt") as fh:
        assert fh.get_slice("model.norm.weight").get_dtype() == {torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    assert max_logit_diff(tmp_path / "half", T=32) <= 1e-4


def test_sharded_checkpoint_loads_every_shard_of_its_index(tiny_llama, tmp_path):
    hf_model(tiny_llama).save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()

    assert max_logit_diff(tmp_path / "sharded", T=32) <= 1e-4


def test_missing_shard_is_refused_naming_the_index_and_the_shard(tiny_llama, tmp_path):
    hf_model(tiny_llama).save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    last = sorted((tmp_path / "sharded").glob("*.safetensors"))[-1]
    last.unlink()

    with pytest.raises(ModelFormatError) as err:
        read_weights(tmp_path / "sharded")
    assert str(err.value).startswith(f"{tmp_path / 'sharded' / 'model.safetensors.index.json'}: shard {last.name} "
                                     "listed in weight_map is missing")


def test_only_the_tensors_the_forward_reads_are_loaded(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    tensors = load_file(tiny_llama / "model.safetensors")
    stale = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8), "score.weight": torch.ones(2, 64)}
    save_file(tensors | stale, tmp_path / "m" / "model.safetensors")

    weights = read_weights(tmp_path / "m")

    assert set(weights) == set(read_config(tmp_path / "m").weight_names()) == set(tensors)
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_untied_config_without_lm_head_is_refused_naming_the_tensor(tiny_llama, tmp_path):
    (tmp_path / "m").mkdir()
    config = json.loads((tiny_llama / "config.json").read_text()) | {"tie_word_embeddings": False}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "model.safetensors").write_bytes((tiny_llama / "model.safetensors").read_bytes())

    with pytest.raises(ModelFormatError) as err:
        read_weights(tmp_path / "m")
    assert str(err.value) == (f"{tmp_path / 'm' / 'model.safetensors'}: tensor lm_head.weight is missing, "
                              "which config.json needs")
