"""The backbone forward we export: a small, readable Qwen2/Llama decoder.

Why not export transformers' own modules: measured on this project, their exported graph
decodes 2.6-4.7x slower in ONNX Runtime than this hand-written forward (cache classes,
mask helpers and dtype juggling all end up in the graph). This file reads the Hugging
Face weights by name from ``config.json`` + ``*.safetensors`` and nothing else.

Checkpoints: Qwen2/Qwen2.5 (q/k/v bias, tied or untied head) and Llama 2/3 (untied head,
``attention_bias``, RoPE scaling ``linear`` and ``llama3``), fp32/fp16/bf16 weights in one file or
sharded with ``model.safetensors.index.json``. The shape comes from ``config.json`` through
``runtime.engine.backbone_config.BackboneConfig``, which refuses, naming the key, whatever this forward
would compute differently from transformers.

LoRA is applied *unmerged*: for every layer and every fused linear with a target module
(q/k/v, o, gate/up, down: ``runtime.engine.interface.lora_groups``) the graph takes ``A (n r_max, in)``
and ``B (out, n r_max)`` as runtime inputs, ``y + (x A^T) B^T``, so one compiled engine serves
every monthly adapter. ``runtime.engine.adapter`` stacks the targets' A matrices, places each ``scale * B``
block-diagonally, and zero-pads a lower rank; a target the adapter does not touch gets zeros (its
delta is then exactly 0).

Shapes: B batch, T new tokens, P past tokens, S = P + T, H hidden, nh/nkv query/kv
heads, d head dim, g = nh // nkv queries per kv head, r max LoRA rank.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from kernels.rope import apply_rope, rope_cos_sin
from runtime.engine.backbone_config import (
    ATTENTION_MODULES,
    CONFIG_FILE,
    LORA_MODULES,
    BackboneConfig,
    ModelFormatError,
)
from runtime.engine.interface import lora_group_name, lora_groups

WEIGHTS_INDEX = "model.safetensors.index.json"  # save_pretrained(max_shard_size=...) writes it beside the shards
WEIGHT_DTYPES = ("F32", "F16", "BF16")  # upcast to fp32 on load, as load_base_model does in PyTorch


def read_hf_config(model_dir: str | Path) -> dict:
    """config.json of a model directory as a dict; refused, naming the file, when absent or not JSON."""
    file = Path(model_dir) / CONFIG_FILE
    if not file.is_file():
        raise ModelFormatError(f"{model_dir}: not a Hugging Face model directory (no {CONFIG_FILE})")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ModelFormatError(f"{file}: not valid JSON ({err.msg})") from None


def read_config(model_dir: str | Path) -> BackboneConfig:
    return BackboneConfig.from_hf(read_hf_config(model_dir), str(Path(model_dir) / CONFIG_FILE))


def weight_files(model_dir: str | Path, cfg: BackboneConfig) -> dict[str, Path]:
    """{tensor name: safetensors file holding it} for every tensor of ``cfg.weight_names``, read from
    the shard index when there is one, else from the headers of every ``*.safetensors``. Only headers
    are read, so this checks a checkpoint (shards present, tensors present, float dtypes) before any load."""
    model_dir = Path(model_dir)
    index = model_dir / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        missing = sorted({shard for shard in weight_map.values() if not (model_dir / shard).is_file()})
        if missing:
            raise ModelFormatError(f"{index}: shard {missing[0]} listed in weight_map is missing"
                                   + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        where = {name: model_dir / shard for name, shard in weight_map.items()}
        source = index
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{model_dir}: no *.safetensors weights")
        where = {}
        for file in files:
            with safe_open(file, framework="pt") as fh:
                where.update((name, file) for name in fh.keys())
        source = files[0] if len(files) == 1 else model_dir
    needed = cfg.weight_names()
    absent = [n for n in needed if n not in where]
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise ModelFormatError(f"{source}: tensor {absent[0]}{more} is missing, which {CONFIG_FILE} needs")
    chosen = {n: where[n] for n in needed}
    for file, fh, names in _open_by_file(chosen):
        present = set(fh.keys())
        for name in names:
            if name not in present:  # an index that lists a tensor its shard does not hold
                raise ModelFormatError(f"{index}: weight_map puts tensor {name} in {file.name}, which does not hold it")
            dtype = fh.get_slice(name).get_dtype()
            if dtype not in WEIGHT_DTYPES:
                raise ModelFormatError(f"{file}: tensor {name} is {dtype}; expected one of {', '.join(WEIGHT_DTYPES)}")
    return chosen


def _open_by_file(chosen: dict[str, Path]):
    """(file, open safetensors handle, names to read from it) for each file once."""
    for file in sorted(set(chosen.values())):
        with safe_open(file, framework="pt") as fh:
            yield file, fh, [n for n, f in chosen.items() if f == file]


def read_weights(model_dir: str | Path, cfg: BackboneConfig | None = None) -> dict[str, torch.Tensor]:
    """The tensors the forward reads (``BackboneConfig.weight_names``), as fp32, keyed by Hugging Face
    name. Whatever else the files hold (another head, stale rotary buffers) is never loaded."""
    cfg = cfg or read_config(model_dir)
    weights = {}
    for _, fh, names in _open_by_file(weight_files(model_dir, cfg)):
        for name in names:
            weights[name] = fh.get_tensor(name).float()
    return weights


def rope_inv_freq(cfg: BackboneConfig) -> torch.Tensor:
    """(d/2,) inverse frequencies of RoPE, op for op as transformers 5 computes them
    (modeling_rope_utils: default, ``_compute_linear_scaling_rope_parameters``,
    ``_compute_llama3_parameters``), so every angle is the same float32 number."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":  # positions / factor, folded into the frequencies
        return inv_freq / s.factor
    # llama3 (Llama 3.1): keep short wavelengths, divide long ones by factor, interpolate in between.
    original = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Written as x / sqrt(...) rather than x * rsqrt(...): the division form is the pattern ONNX
    # Runtime fuses into one SimplifiedLayerNormalization kernel (7 ops -> 1 per norm).
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def float_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return x @ w.t() if b is None else torch.addmm(b, x, w.t())  # (N, in) -> (N, out)


class Block(nn.Module):
    """One decoder layer. q/k/v and gate/up are concatenated into one matmul each: fewer,
    larger GEMMs decode faster on every backend, and the split is exact."""

    # Every base projection goes through this; the PyTorch reference of a quantized engine
    # (tests/weight_reference.py, reference_backbone) swaps in one that rounds the input as the engine's kernel does.
    linear = staticmethod(float_linear)

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
        the second GEMM (one ONNX Gemm). Stacked (interface version 7): A (S n r, in) and B (out, S n r)
        hold S adapters; h = x A^T (N, S n r) keeps only each token's row's slot's columns (``mask``, one-hot
        per slot), so a row's product with the other slots' B columns is exactly 0: it computes what it would alone."""
        if first not in lora:
            return y
        a, b, mask = lora[first]  # (n r, in), (out, n r), None; or stacked (S n r, in), (out, S n r), (N, S n r)
        # (A x^T)^T, not x A^T: ONNX Runtime splits x A^T (A an input, a few dozen columns) across its threads by
        # the row count N, so a row's h depended on its batch's size ({1}, {2, 3}, {4 and more} at 896 x 24, 2
        # threads); this order gives every row the same floats at any N (tests/runtime/test_paired_rows.py).
        h = (a @ x.t()).t()  # (N, n r) or (N, S n r)
        return torch.addmm(y, h if mask is None else h * mask, b.t())  # (N, out)

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
        qk = apply_rope(qk, cos, sin)
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
    """forward(input_ids, position_ids, attention_mask, past_kv, lora, logit_positions) -> (logits, present_kv).

    input_ids, position_ids: (B, T) int64; attention_mask: (B, S) int64, 1 = real token,
    0 = padding (left padding for batched prompts). past_kv: flat tuple
    (past_key.0, past_value.0, past_key.1, ...), each (B, nkv, P, d); P may be 0.
    lora: flat tuple in ``runtime.engine.interface.lora_input_names`` order; empty when built with no lora_modules.
    logit_positions: (B, K) int64, the new tokens (0..T-1) whose logits are computed (``head``); None = all T.
    """

    linear = staticmethod(float_linear)  # the LM head's; see Block.linear

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
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = p(weights["lm_head.weight"], requires_grad=False)  # (V, H)
        # The one inv_freq of this backbone: the exported graph, the KV-cache paths and calibration all read it.
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # (d/2,)

    def forward(self, input_ids, position_ids, attention_mask, past_kv: tuple, lora: tuple = (), logit_positions=None):
        x, cos, sin, mask = self.prepare(input_ids, position_ids, attention_mask, past_kv[0].shape[2])
        B, T = input_ids.shape
        present = []
        loras = self.layer_loras(tuple(lora), T)
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, B, T, cos, sin, mask, past_kv[2 * i], past_kv[2 * i + 1], loras[i])
            present += [k, v]
        return self.head(x, B, T, logit_positions), tuple(present)

    def prepare(self, input_ids, position_ids, attention_mask, P):
        """Embeddings x (N, H), RoPE cos/sin (B, 1, T, d) of the new tokens, additive mask (B, 1, g T, P + T)."""
        cfg = self.cfg
        B, T = input_ids.shape
        x = nn.functional.embedding(input_ids, self.embed).reshape(B * T, -1)  # (N, H); one Gather

        cos, sin = rope_cos_sin(position_ids, self.inv_freq)  # (B, 1, T, d), rotate_half's sign in sin

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

    def layer_loras(self, lora: tuple, T: int) -> list[dict[str, tuple]]:
        """Per layer {first module of a fused linear: (A, B, mask)}, for T new tokens per row. The LoRA inputs come
        in (A, B) pairs; a stacked engine's (interface version 7) end with ``adapter_mask`` (B, S), expanded here
        once per forward and rank n r to (N, S n r): 1 in the columns of each token's row's slot, else 0. Otherwise
        the mask is None."""
        n = 2 * len(self.lora_groups)  # inputs per layer
        masks: dict[int, torch.Tensor] = {}
        if len(lora) % 2:
            row = lora[-1]  # (B, S)
            B, S = row.shape
            for a in lora[:n:2]:  # one mask per rank: (B, 1, S, 1) -> (B, T, S, n r) -> (N, S n r)
                nr = a.shape[0] // S
                masks.setdefault(nr, row[:, None, :, None].expand(B, T, S, nr).reshape(B * T, S * nr))
        return [{fused[0]: (lora[n * i + 2 * j], lora[n * i + 2 * j + 1],
                            masks[lora[n * i + 2 * j].shape[0] // S] if masks else None)
                 for j, (_, fused) in enumerate(self.lora_groups)} for i in range(self.cfg.num_layers)]

    def head(self, x, B: int, T: int, logit_positions=None):
        """Logits (B, T, V) of the hidden states x (B T, H); with ``logit_positions`` (B, K) of those positions
        only, (B, K, V): gathered before the norm and the LM head, whose (B T, V) output would otherwise be the
        largest tensor of a long prefill."""
        if logit_positions is not None:
            H = x.shape[-1]
            x = torch.gather(x.view(B, T, H), 1, logit_positions.unsqueeze(-1).expand(-1, -1, H))  # (B, K, H)
            T = logit_positions.shape[1]
            x = x.reshape(B * T, H)  # (B K, H)
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
                key = f"model.layers.{i}.{'self_attn' if m in ATTENTION_MODULES else 'mlp'}.{m}.weight"
                merged[key] = weights[key] + delta[row : row + weights[key].shape[0]]
                row += weights[key].shape[0]
    return merged


def load_backbone(
    model_dir: str | Path, lora_modules: tuple[str, ...] = (), merged_lora: dict[str, torch.Tensor] | None = None
) -> Backbone:
    """Backbone from a Hugging Face directory, optionally with a LoRA merged into its weights."""
    cfg = read_config(model_dir)
    weights = read_weights(model_dir, cfg)
    if merged_lora is not None:
        modules = tuple(sorted({m for k in merged_lora if k.startswith("lora_A.") for m in k.split(".")[-1].split("+")}))
        weights = merge_lora(weights, merged_lora, cfg.num_layers, modules)
    return Backbone(cfg, weights, lora_modules).eval()
