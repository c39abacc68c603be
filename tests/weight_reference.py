"""Test kit, the PyTorch side of weight-only quantization: ``runtime.engine.model.Backbone`` with the dequantized
weights of the same integer codes the quantized engine stores (``tasks/weights/graph.py``), and
optionally its activations rounded as MatMulNBits rounds them at int8 compute. The engine must
match it (tests/tasks/test_weight_reference.py).
"""

from __future__ import annotations

from pathlib import Path

from kernels.weight_quant import fake_quantize
from tasks.weights.graph import DEFAULT_BLOCK_SIZE, INT8_COMPUTE_LEVEL

_NORM_BEFORE = {  # which RMSNorm scale multiplies each projection's input
    "q_proj": "input_layernorm", "k_proj": "input_layernorm", "v_proj": "input_layernorm",
    "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm",
}


def reference_weights(
    weights: dict, num_layers: int, bits: int, block_size: int = DEFAULT_BLOCK_SIZE, fold_norms: bool = False,
    keep: tuple[str, ...] = ("lm_head", "embed"), symmetric: bool = False, tied: bool = True,
    head_bits: int | None = None,
) -> dict:
    """Hugging Face-named weights with every projection replaced by what the quantized engine
    multiplies by (``fake_quantize``); the input of ``runtime.engine.model.Backbone``."""
    out = dict(weights)
    for i in range(num_layers):
        for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            kind = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"model.layers.{i}.{kind}.{m}.weight"
            g = weights[f"model.layers.{i}.{_NORM_BEFORE[m]}.weight"] if fold_norms and m in _NORM_BEFORE else None
            out[key] = fake_quantize(weights[key], bits, block_size, symmetric, g)
    if "lm_head" not in keep:
        head = weights["model.embed_tokens.weight"] if tied or "lm_head.weight" not in weights else weights["lm_head.weight"]
        g = weights["model.norm.weight"] if fold_norms else None
        out["lm_head.weight"] = fake_quantize(head, head_bits or bits, block_size, symmetric, g)
    return out


def int8_rounded_linear(x, w, b=None, block_size: int = DEFAULT_BLOCK_SIZE):
    """``runtime.engine.model.float_linear`` after rounding each row of ``x`` as MatMulNBits does at accuracy
    level 4: per block of ``block_size`` input channels, symmetric int8 with scale amax / 127,
    round half to even. Everything after the rounding is float, as in the kernel's int32 sums."""
    import torch

    from runtime.engine.model import float_linear

    N, K = x.shape
    pad = -K % block_size  # a partial last block: zeros change neither its amax nor the sums
    blocks = torch.nn.functional.pad(x, (0, pad)).view(N, -1, block_size)
    scale = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    rounded = (torch.round(blocks * inv).clamp(-127, 127) * scale).view(N, -1)[:, :K]
    return float_linear(rounded, w, b)


def reference_backbone(model_dir: str | Path, bits: int, block_size: int = DEFAULT_BLOCK_SIZE, fold_norms: bool = False,
                       keep: tuple[str, ...] = ("lm_head", "embed"), lora_modules: tuple[str, ...] = (),
                       symmetric: bool = False, accuracy_level: int = 0, head_bits: int | None = None):
    """``runtime.engine.model.Backbone`` with the dequantized weights of the same quantization; at
    ``accuracy_level`` 4 every quantized projection also rounds its input (``int8_rounded_linear``),
    as the engine does. The LoRA path reads the unrounded input, as in the engine."""
    import dataclasses
    import functools

    from runtime.engine.model import Backbone, read_config, read_weights

    if accuracy_level == INT8_COMPUTE_LEVEL and fold_norms:
        # The folded engine rounds the norm output before its scale; this reference applies the
        # scale first (fake_quantize divides it back out of the weight), so it would round other values.
        raise ValueError("reference_backbone: int8 activation rounding with folded norm scales is not modelled; "
                         "use accuracy_level=0 (fp32 compute) for a folded engine")
    cfg = read_config(model_dir)
    w = reference_weights(read_weights(model_dir), cfg.num_layers, bits, block_size, fold_norms, keep, symmetric,
                          cfg.tie_word_embeddings, head_bits)
    if "lm_head" not in keep:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)  # the head now differs from the table
    backbone = Backbone(cfg, w, lora_modules).eval()
    if accuracy_level == INT8_COMPUTE_LEVEL:
        rounded = functools.partial(int8_rounded_linear, block_size=block_size)
        for block in backbone.blocks:
            block.linear = rounded
        if "lm_head" not in keep:
            backbone.linear = rounded
    return backbone
