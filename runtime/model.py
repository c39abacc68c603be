"""The backbone forward we export: a small, readable Qwen2/Llama decoder.

Why not export transformers' own modules: measured on this project, their exported graph
decodes 2.6-4.7x slower in ONNX Runtime than this hand-written forward (cache classes,
mask helpers and dtype juggling all end up in the graph). This file reads the Hugging
Face weights by name from ``config.json`` + ``*.safetensors`` and nothing else.

LoRA is applied *unmerged*: for every layer and every fused linear with a target module
(q/k/v, o, gate/up, down: ``runtime.interface.lora_groups``) the graph takes ``A (n r_max, in)``
and ``B (out, n r_max)`` as runtime inputs, ``y + (x A^T) B^T``, so one compiled engine serves
every monthly adapter. ``runtime.adapter`` stacks the targets' A matrices, places each ``scale * B``
block-diagonally, and zero-pads a lower rank; a target the adapter does not touch gets zeros (its
delta is then exactly 0).

Shapes: B batch, T new tokens, P past tokens, S = P + T, H hidden, nh/nkv query/kv
heads, d head dim, g = nh // nkv queries per kv head, r max LoRA rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from runtime.errors import RefusedInput
from runtime.interface import lora_group_name, lora_groups


# Every linear a LoRA may target, in the order its inputs appear in the engine interface.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


class ModelFormatError(RefusedInput):
    """A model directory this forward cannot reproduce exactly; the message says why."""


@dataclass(frozen=True)
class BackboneConfig:
    model_type: str  # "qwen2" or "llama": same block, Qwen2 adds a bias to q/k/v
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads means grouped-query attention
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool  # lm_head reuses embed_tokens (no lm_head.weight in the file)

    @classmethod
    def from_hf(cls, hf: dict) -> "BackboneConfig":
        """Map a Hugging Face config.json; refuse every feature this forward does not implement."""
        problems = []
        model_type = hf.get("model_type")
        if model_type not in ("qwen2", "llama"):
            problems.append(f"model_type {model_type!r} is not qwen2 or llama")
        if hf.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {hf.get('hidden_act')!r} is not silu")
        # transformers 5 nests rope settings in rope_parameters; 4.x used rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            problems.append(f"rope scaling {rope_type!r} is not supported (only plain RoPE)")
        if hf.get("use_sliding_window") and hf.get("sliding_window"):
            problems.append("sliding-window attention is not supported")
        if hf.get("mlp_bias"):
            problems.append("mlp_bias is not supported")
        heads, kv_heads = hf.get("num_attention_heads", 0), hf.get("num_key_value_heads") or hf.get("num_attention_heads", 0)
        if not heads or heads % kv_heads:
            problems.append(f"{heads} attention heads do not split evenly over {kv_heads} kv heads")
        if problems:
            raise ModelFormatError("unsupported model config: " + "; ".join(problems))
        heads = hf["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a LoRA-targetable linear."""
        H, d, I = self.hidden_size, self.head_dim, self.intermediate_size
        return {
            "q_proj": (H, self.num_heads * d),
            "k_proj": (H, self.num_kv_heads * d),
            "v_proj": (H, self.num_kv_heads * d),
            "o_proj": (self.num_heads * d, H),
            "gate_proj": (H, I),
            "up_proj": (H, I),
            "down_proj": (I, H),
        }[module]


def read_config(model_dir: str | Path) -> BackboneConfig:
    return BackboneConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))


def read_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors shard, as fp32, keyed by its Hugging Face name."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{model_dir}: no *.safetensors weights")
    weights = {}
    for file in files:
        with safe_open(file, framework="pt") as fh:
            for name in fh.keys():
                weights[name] = fh.get_tensor(name).float()
    return weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Written as x / sqrt(...) rather than x * rsqrt(...): the division form is the pattern ONNX
    # Runtime fuses into one SimplifiedLayerNormalization kernel (7 ops -> 1 per norm).
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return x @ w.t() if b is None else torch.addmm(b, x, w.t())  # (N, in) -> (N, out)


class Block(nn.Module):
    """One decoder layer. q/k/v and gate/up are concatenated into one matmul each: fewer,
    larger GEMMs decode faster on every backend, and the split is exact."""

    # Every base projection goes through this; the PyTorch reference of a quantized engine
    # (tasks.quantize_weights.reference_backbone) swaps in one that rounds the input as the engine's kernel does.
    linear = staticmethod(_linear)

    def __init__(self, cfg: BackboneConfig, w: dict[str, torch.Tensor], prefix: str, lora_modules: tuple[str, ...]):
        super().__init__()
        self.cfg, self.lora_modules = cfg, lora_modules
        p = nn.Parameter
        att, mlp = prefix + "self_attn.", prefix + "mlp."
        self.qkv_w = p(torch.cat([w[att + f"{m}.weight"] for m in ("q_proj", "k_proj", "v_proj")]), requires_grad=False)
        biases = [w.get(att + f"{m}.bias") for m in ("q_proj", "k_proj", "v_proj")]
        self.qkv_b = None
        if any(b is not None for b in biases):
            outs = [cfg.module_shape(m)[1] for m in ("q_proj", "k_proj", "v_proj")]
            filled = [b if b is not None else torch.zeros(n) for b, n in zip(biases, outs)]
            self.qkv_b = p(torch.cat(filled), requires_grad=False)
        self.o_w = p(w[att + "o_proj.weight"], requires_grad=False)
        self.o_b = p(w[att + "o_proj.bias"], requires_grad=False) if att + "o_proj.bias" in w else None
        self.gate_up_w = p(torch.cat([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]), requires_grad=False)
        self.down_w = p(w[mlp + "down_proj.weight"], requires_grad=False)
        self.ln1 = p(w[prefix + "input_layernorm.weight"], requires_grad=False)
        self.ln2 = p(w[prefix + "post_attention_layernorm.weight"], requires_grad=False)

    def _lora(self, first: str, x: torch.Tensor, y: torch.Tensor, lora: dict[str, tuple]) -> torch.Tensor:
        """y + (x A^T) B^T for the fused linear whose first module is ``first``, the add folded into
        the second GEMM (one ONNX Gemm)."""
        if first not in lora:
            return y
        a, b = lora[first]  # (n r, in), (out, n r)
        return torch.addmm(y, x @ a.t(), b.t())  # (N, n r) -> (N, out)

    def forward(self, x, B: int, T: int, cos, sin, mask, past_k, past_v, lora: dict[str, tuple]):
        """x: (N, H) with N = B * T: the linears run on 2-D activations so each one, bias or
        LoRA add included, exports as a single Gemm."""
        cfg = self.cfg
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g = nh // nkv

        q, k, v = self.project_qkv(x, B, T, cos, sin, lora)
        k = torch.cat([past_k, k], dim=2)  # (B, nkv, S, d)
        v = torch.cat([past_v, v], dim=2)  # (B, nkv, S, d)

        # GQA without copying K/V: fold the g query heads of each kv head into the row axis.
        qg = q.reshape(B, nkv, g * T, d)  # (B, nkv, g T, d)
        att = (qg @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d)) + mask  # (B, nkv, g T, S) + (B, 1, g T, S)
        att = torch.softmax(att, dim=-1)
        y = att @ v  # (B, nkv, g T, d)
        return self.finish(x, y, B, T, lora), k, v

    def project_qkv(self, x, B: int, T: int, cos, sin, lora: dict[str, tuple]):
        """(q (B, nh, T, d), k (B, nkv, T, d), v (B, nkv, T, d)) of the new tokens, q and k after RoPE."""
        cfg = self.cfg
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = rms_norm(x, self.ln1, cfg.rms_norm_eps)  # (N, H)
        qkv = self._lora("q_proj", h, self.linear(h, self.qkv_w, self.qkv_b), lora)  # (N, (nh + 2 nkv) d)
        qk, v = qkv.split([(nh + nkv) * d, nkv * d], dim=-1)
        # RoPE on queries and keys in one pass: half the rotate/multiply ops of two passes.
        qk = qk.view(B, T, nh + nkv, d).transpose(1, 2)  # (B, nh + nkv, T, d)
        qk = qk * cos + rotate_half(qk) * sin
        q, k = qk.split([nh, nkv], dim=1)  # (B, nh, T, d), (B, nkv, T, d)
        v = v.view(B, T, nkv, d).transpose(1, 2)  # (B, nkv, T, d)
        return q, k, v

    def finish(self, x, y, B: int, T: int, lora: dict[str, tuple]):
        """Attention output y (B, nkv, g T, d) -> o_proj, residual, MLP: the layer's output (N, H)."""
        cfg = self.cfg
        nh, d = cfg.num_heads, cfg.head_dim
        y = y.view(B, nh, T, d).transpose(1, 2).reshape(B * T, nh * d)  # (N, nh d)
        x = x + self._lora("o_proj", y, self.linear(y, self.o_w, self.o_b), lora)  # (N, H)

        h = rms_norm(x, self.ln2, cfg.rms_norm_eps)  # (N, H)
        gu = self._lora("gate_proj", h, self.linear(h, self.gate_up_w), lora)  # (N, 2 I)
        gate, up = gu.split([cfg.intermediate_size, cfg.intermediate_size], dim=-1)
        m = nn.functional.silu(gate) * up  # (N, I)
        down = self.linear(m, self.down_w)  # (N, H)
        return x + self._lora("down_proj", m, down, lora)


class Backbone(nn.Module):
    """forward(input_ids, position_ids, attention_mask, past_kv, lora) -> (logits, present_kv).

    input_ids, position_ids: (B, T) int64; attention_mask: (B, S) int64, 1 = real token,
    0 = padding (left padding for batched prompts). past_kv: flat tuple
    (past_key.0, past_value.0, past_key.1, ...), each (B, nkv, P, d); P may be 0.
    lora: flat tuple in ``runtime.interface.lora_input_names`` order; empty when built with no lora_modules.
    """

    linear = staticmethod(_linear)  # the LM head's; see Block.linear

    def __init__(self, cfg: BackboneConfig, weights: dict[str, torch.Tensor], lora_modules: tuple[str, ...] = ()):
        super().__init__()
        unknown = [m for m in lora_modules if m not in LORA_MODULES]
        if unknown:
            raise ValueError(f"unknown LoRA target modules {unknown}; supported: {list(LORA_MODULES)}")
        self.cfg, self.lora_modules = cfg, tuple(lora_modules)
        self.lora_groups = lora_groups(self.lora_modules)
        p = nn.Parameter
        self.embed = p(weights["model.embed_tokens.weight"], requires_grad=False)  # (V, H)
        self.blocks = nn.ModuleList(
            Block(cfg, weights, f"model.layers.{i}.", self.lora_modules) for i in range(cfg.num_layers)
        )
        self.norm = p(weights["model.norm.weight"], requires_grad=False)
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = p(weights["lm_head.weight"], requires_grad=False)  # (V, H)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (d/2,)

    def forward(self, input_ids, position_ids, attention_mask, past_kv: tuple, lora: tuple = ()):
        x, cos, sin, mask = self.prepare(input_ids, position_ids, attention_mask, past_kv[0].shape[2])
        B, T = input_ids.shape
        present = []
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, B, T, cos, sin, mask, past_kv[2 * i], past_kv[2 * i + 1], self.layer_lora(lora, i))
            present += [k, v]
        return self.head(x, B, T), tuple(present)

    def prepare(self, input_ids, position_ids, attention_mask, P):
        """Embeddings x (N, H), RoPE cos/sin (B, 1, T, d) of the new tokens, additive mask (B, 1, g T, P + T)."""
        cfg = self.cfg
        B, T = input_ids.shape
        x = nn.functional.embedding(input_ids, self.embed).reshape(B * T, -1)  # (N, H); one Gather

        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq  # (B, T, d/2)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # (B, 1, T, d)
        cos, sin = emb.cos(), emb.sin()

        # Causal by cache slot (not by position id, which skips left padding), and never
        # attend to a padded slot. A finite minimum, not -inf, so a fully padded row stays finite.
        q_slot = torch.arange(T, device=input_ids.device) + P  # (T,)
        k_slot = torch.arange(P + T, device=input_ids.device)  # (S,)
        allowed = (k_slot[None, :] <= q_slot[:, None])[None] & (attention_mask[:, None, :] > 0)  # (B, T, S)
        zero = torch.zeros((), dtype=x.dtype)
        mask = torch.where(allowed, zero, torch.finfo(x.dtype).min)  # (B, T, S)
        # Rows repeated once per query head of a kv group, built once here instead of a 5-D
        # view + broadcast in every layer.
        g = cfg.num_heads // cfg.num_kv_heads
        mask = mask.unsqueeze(1).expand(B, g, T, P + T).reshape(B, 1, g * T, P + T)  # (B, 1, g T, S)
        return x, cos, sin, mask

    def layer_lora(self, lora: tuple, i: int) -> dict[str, tuple]:
        """{first module of a fused linear: (A, B)} of layer i."""
        groups = self.lora_groups
        layer = lora[2 * len(groups) * i : 2 * len(groups) * (i + 1)]
        return {fused[0]: tuple(layer[2 * j : 2 * j + 2]) for j, (_, fused) in enumerate(groups)}

    def head(self, x, B: int, T: int):
        x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)  # (N, H)
        return self.linear(x, self.lm_head).view(B, T, -1)  # (B, T, V)

    def empty_past(self, batch: int) -> tuple[torch.Tensor, ...]:
        shape = (batch, self.cfg.num_kv_heads, 0, self.cfg.head_dim)
        return tuple(torch.zeros(shape) for _ in range(2 * self.cfg.num_layers))


def merge_lora(
    weights: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], num_layers: int, modules: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """W + B @ A (the scale is inside B) for every layer and fused linear, cut back into the
    modules' weights: the merged-weights reference/baseline."""
    merged = dict(weights)
    for i in range(num_layers):
        for targeted, fused in lora_groups(modules):
            name = lora_group_name(targeted)
            delta = lora[f"lora_B.{i}.{name}"] @ lora[f"lora_A.{i}.{name}"]  # (out of the fused linear, in)
            row = 0
            for m in fused:  # an untargeted member's rows are zero
                key = f"model.layers.{i}.{'self_attn' if m in _ATTN else 'mlp'}.{m}.weight"
                merged[key] = weights[key] + delta[row : row + weights[key].shape[0]]
                row += weights[key].shape[0]
    return merged


def load_backbone(
    model_dir: str | Path, lora_modules: tuple[str, ...] = (), merged_lora: dict[str, torch.Tensor] | None = None
) -> Backbone:
    """Backbone from a Hugging Face directory, optionally with a LoRA merged into its weights."""
    cfg = read_config(model_dir)
    weights = read_weights(model_dir)
    if merged_lora is not None:
        modules = tuple(sorted({m for k in merged_lora if k.startswith("lora_A.") for m in k.split(".")[-1].split("+")}))
        weights = merge_lora(weights, merged_lora, cfg.num_layers, modules)
    return Backbone(cfg, weights, lora_modules).eval()
