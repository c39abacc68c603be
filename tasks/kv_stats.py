"""KV-cache statistics: per-channel ranges of keys and values over calibration text, the scales made
from them, and the release backbone they are collected on.

Shared by the calibrate stage, the KV quality check, the KV grid flow and the KV benchmarks.
"""

from __future__ import annotations

import math
from pathlib import Path

from runtime.engine.adapter_config import ADAPTER_WEIGHTS
from runtime.engine.hashing import sha256_file
from runtime.engine.kv_scales import KVScales, read_kv_scales

# Static scales are set on calib text and read on other text: a percentile range spends the 16
# levels on the bulk rather than on a few extreme values. Measured for the default scheme (static
# per-channel K after RoPE and V, read by the GQA engine, stdlib text, bench/quality/kv_schemes.py):
# perplexity +0.71% at the 99.9th percentile, +0.15% at 99.5, -0.08% at 99.0, -0.17% at 98.
DEFAULT_CLIP_PERCENTILE = 99.0


def collect_kv_stats(backbone, batches, pre_rope_keys: bool, clip_percentile: float = 100.0, progress: bool = True,
                     rotation=None, spec=None, key_positions: int | None = None) -> dict:
    """Per-channel ranges of K and V over every real token of ``batches``.

    batches: iterable of (input_ids (B, T), attention_mask (B, T)), right padded.
    Returns {"k_lo", "k_hi", "v_lo", "v_hi": (L, nkv, d) float32, "tokens": int,
    "k_channel_amax": (L, nkv, d)} where lo/hi are the (100 - p)th and p-th percentiles of
    each channel (p = clip_percentile; 100 = min/max). ``rotation`` (L, d, d): the ranges of K R and
    V R, what a rotated cache quantizes (``kernels.kv_quant.hadamard_matrix``). With a ``spec`` (``KVQuantSpec``), also
    "kv_error" (L,): per layer, the squared error of quantizing these very K and V with the scales
    these ranges give, over their squared norm (K and V summed), the measure ``choose_rotation`` compares.
    ``key_positions`` (keys after RoPE): each key is turned to a position drawn uniformly from
    [0, key_positions) instead of its own (exact: RoPE is the only thing position does to a key once
    it is computed). Calibration text is short; static post-RoPE scales read at position 1,000 must
    cover what the slow RoPE pairs rotate into a channel there, which short rows never show
    (measured on SmolLM2-135M: docs/kv-cache-real-weights.md).
    """
    import torch

    from kernels.rope import rope_rotate
    from tasks.progress import Progress

    if not 50.0 < clip_percentile <= 100.0:
        raise ValueError(f"clip_percentile={clip_percentile} must be in (50, 100]")
    L = backbone.cfg.num_layers
    draw = torch.Generator().manual_seed(0)
    keys: list[list] = [[] for _ in range(L)]
    values: list[list] = [[] for _ in range(L)]
    tokens = 0
    batches = list(batches)
    bar = Progress("calibrate KV", len(batches), unit="batch") if progress else None
    with torch.no_grad():
        for ids, mask in batches:
            B, T = ids.shape
            pos = torch.arange(T).expand(B, T)
            _, present = backbone(ids, pos, mask, backbone.empty_past(B))
            real = mask.bool()  # (B, T)
            tokens += int(real.sum())
            spread = None if pre_rope_keys or not key_positions else torch.randint(0, key_positions, (B, T), generator=draw)
            for i in range(L):
                k, v = present[2 * i], present[2 * i + 1]  # (B, nkv, T, d), keys after RoPE
                if pre_rope_keys or spread is not None:
                    k = rope_rotate(k, pos, backbone.inv_freq, inverse=True)
                if spread is not None:
                    k = rope_rotate(k, spread, backbone.inv_freq)
                if rotation is not None:  # the cache holds k R, v R
                    k, v = k @ rotation[i], v @ rotation[i]
                keys[i].append(k.transpose(1, 2)[real])  # (n, nkv, d)
                values[i].append(v.transpose(1, 2)[real])
            if bar is not None:
                bar.advance(tokens=tokens)
    if bar is not None:
        bar.close()
    if tokens == 0:
        raise ValueError("calibration saw no tokens")

    def bounds(x) -> tuple:  # x (N, nkv d)
        if clip_percentile >= 100.0:
            return x.amin(0), x.amax(0), x.abs().amax(0)
        n = x.shape[0]
        k_hi = max(1, min(n, math.ceil(clip_percentile / 100.0 * n)))
        k_lo = max(1, n + 1 - k_hi)
        return x.kthvalue(k_lo, 0).values, x.kthvalue(k_hi, 0).values, x.abs().amax(0)

    stats = {name: [] for name in ("k_lo", "k_hi", "v_lo", "v_hi", "k_channel_amax")}
    nkv, d = backbone.cfg.num_kv_heads, backbone.cfg.head_dim
    errors = []
    for i in range(L):
        k, v = torch.cat(keys[i]).flatten(1), torch.cat(values[i]).flatten(1)  # (N, nkv d)
        keys[i] = values[i] = None  # the next layer's copies fit where these were
        k_lo, k_hi, k_amax = bounds(k)
        v_lo, v_hi, _ = bounds(v)
        for name, t in (("k_lo", k_lo), ("k_hi", k_hi), ("v_lo", v_lo), ("v_hi", v_hi), ("k_channel_amax", k_amax)):
            stats[name].append(t.reshape(nkv, d))
        if spec is not None:
            errors.append(_relative_error(k, k_lo, k_hi, spec.k_bits, spec.k_symmetric)
                          + _relative_error(v, v_lo, v_hi, spec.v_bits, spec.v_symmetric))
    out = {name: torch.stack(ts) for name, ts in stats.items()}  # (L, nkv, d)
    out["tokens"] = tokens
    if spec is not None:
        out["kv_error"] = errors
    return out


def _relative_error(x, lo, hi, bits: int, symmetric: bool) -> float:
    """||x - dequantize(quantize(x))||^2 / ||x||^2 of x (N, nkv d) with per-channel scales from [lo, hi]."""
    from kernels.kv_quant import dequantize, quantize, scale_zero_from_range

    scale, zero = scale_zero_from_range(lo, hi, bits, symmetric)
    scale = scale.clamp_min(2.0**-14)
    err = dequantize(quantize(x, scale, zero, bits), scale, zero) - x
    return float((err.double() ** 2).sum() / (x.double() ** 2).sum().clamp_min(1e-30))


def key_outlier_ratio(k_channel_amax) -> list[float]:
    """Per layer: largest channel amax over the median channel amax (the outlier check of issue 4)."""
    flat = k_channel_amax.flatten(1)  # (L, nkv d)
    return (flat.amax(1) / flat.median(1).values).tolist()


def scales_from_stats(stats: dict, spec) -> dict:
    """{"k_scale", "k_zero" (None if symmetric), "v_scale", "v_zero"}: (L, nkv, d) for this spec's widths."""
    from kernels.kv_quant import scale_zero_from_range

    out = {}
    for kind, bits, sym in (("k", spec.k_bits, spec.k_symmetric), ("v", spec.v_bits, spec.v_symmetric)):
        scale, zero = scale_zero_from_range(stats[f"{kind}_lo"], stats[f"{kind}_hi"], bits, sym)
        out[f"{kind}_scale"], out[f"{kind}_zero"] = scale, (None if sym else zero)
    return out


def kv_scales_from_stats(stats: dict, spec, record: dict, rotation=None) -> KVScales:
    """The release's scales for ``spec`` (a ``KVQuantSpec``) from ``collect_kv_stats`` output, with the
    (L, d, d) ``rotation`` those statistics were taken after (None: none)."""
    s = {kind: (None if t is None else t.float().numpy()) for kind, t in scales_from_stats(stats, spec).items()}
    return KVScales(spec.to_dict(), s["k_scale"], s["k_zero"], s["v_scale"], s["v_zero"], record,
                    None if rotation is None else rotation.float().numpy())


# A layer's cache is turned only when the Hadamard rotation cuts its relative K/V quantization error by at
# least this fraction: the rotation costs a (d, d) matmul per token on q, k, v and the attention output, and
# gains of a few percent are within what the calibration text moves this measure by (SmolLM2: 0-3% both
# ways on its 30 layers; a 2-layer Llama chose it at 1-3% gains, and one greedy answer on the 4-bit cache
# then differed from the float one).
ROTATION_MIN_GAIN = 0.10


def choose_rotation(backbone, batches, spec, clip_percentile: float,
                    key_positions: int | None = None) -> tuple[dict, "torch.Tensor | None", dict]:  # noqa: F821
    """Per layer, the cache rotation (none or Hadamard) whose scales quantize the calibration K/V
    with the smaller relative error (``collect_kv_stats``'s "kv_error"), Hadamard only when it is
    smaller by ``ROTATION_MIN_GAIN``. Returns (statistics under
    the chosen rotations, rotation (L, d, d) or None when no layer turns, what to record).

    Keys cached before RoPE are never turned (the engine re-applies RoPE to what it reads); a
    head_dim that is not a power of two has no Walsh-Hadamard matrix."""
    import torch

    from kernels.kv_quant import hadamard_matrix

    plain = collect_kv_stats(backbone, batches, spec.pre_rope_keys, clip_percentile, spec=spec, key_positions=key_positions)
    record = {"key_outlier_ratio": key_outlier_ratio(plain["k_channel_amax"]), "kv_error_none": plain["kv_error"]}
    L, d = backbone.cfg.num_layers, backbone.cfg.head_dim
    if spec.pre_rope_keys or d & (d - 1):
        return plain, None, record | {"rotation": ["none"] * L}
    hadamard = hadamard_matrix(d).expand(L, d, d)
    turned = collect_kv_stats(backbone, batches, False, clip_percentile, progress=False, rotation=hadamard, spec=spec,
                              key_positions=key_positions)
    use = torch.tensor([h < p * (1 - ROTATION_MIN_GAIN) for h, p in zip(turned["kv_error"], plain["kv_error"])])  # (L,)
    stats = {name: torch.where(use[:, None, None], turned[name], plain[name])
             for name in ("k_lo", "k_hi", "v_lo", "v_hi", "k_channel_amax")} | {"tokens": plain["tokens"]}
    rotation = torch.where(use[:, None, None], hadamard, torch.eye(d).expand(L, d, d)) if use.any() else None
    record |= {"kv_error_hadamard": turned["kv_error"], "rotation": ["hadamard" if u else "none" for u in use.tolist()]}
    return stats, rotation, record


def cache_kwargs(scales: KVScales) -> dict:
    """Keyword arguments of ``kernels.QuantizedKVCache`` for these scales (torch views of the arrays)."""
    import torch

    out = {kind: torch.from_numpy(a) for kind, a in scales.stacked().items()}  # an absent zero point stays None
    return out | ({} if scales.rotation is None else {"rotation": torch.from_numpy(scales.rotation)})


def read_release_kv_scales(base_dir: Path, adapter_dir: Path, kv_dir: Path, spec: dict | None = None) -> KVScales:
    """The KV scales in ``kv_dir``, checked to be calibrated for the adapter in ``adapter_dir`` on the
    base in ``base_dir`` (and, given, for ``spec``): a release's own, never another's."""
    from runtime.engine.hashing import backbone_hash

    return read_kv_scales(Path(kv_dir), sha256_file(Path(adapter_dir) / ADAPTER_WEIGHTS), backbone_hash(Path(base_dir)),
                          spec=spec)


def load_release_backbone(base_dir: Path, adapter_dir: Path, engine_dir: Path | None = None):
    """Backbone with the adapter merged (calibration runs eagerly; merging is exact to fp32).

    The adapter is validated by ``runtime.engine.adapter.load_adapter`` (provenance included) against
    the compiled engine's interface when ``engine_dir`` is given, else against an interface
    shaped after the adapter itself; an adapter made for another backbone is refused either way.
    Returns (backbone, base hash, interface hash of the engine or "").
    """
    import torch

    from runtime.engine.adapter import load_adapter
    from runtime.engine.adapter_config import read_adapter_config
    from runtime.engine.hashing import backbone_hash
    from runtime.engine.interface import build_interface, read_interface
    from runtime.engine.model import load_backbone, read_config

    if engine_dir is not None:
        iface = read_interface(engine_dir)
        interface_hash = iface.lora_contract_hash
    else:
        acfg = read_adapter_config(adapter_dir)
        iface = build_interface(read_config(base_dir), backbone_hash(base_dir), max_rank=acfg.r,
                                target_modules=acfg.target_modules)
        interface_hash = ""
    lora = {k: torch.from_numpy(v) for k, v in load_adapter(adapter_dir, iface).items()}
    return load_backbone(base_dir, merged_lora=lora), iface.backbone_hash, interface_hash


def jsonl_batches(tokenizer, calib_jsonl: Path, batch_size: int, max_seq_len: int) -> tuple[list, int]:
    """prompt + completion + eos of every row, right padded: [(ids (B, T), mask (B, T))], rows."""
    from tasks.records import read_jsonl
    from tasks.training import collate, encode_example

    rows = read_jsonl(Path(calib_jsonl))
    encoded = [encode_example(tokenizer, ex, max_seq_len) for ex in rows]
    batches = []
    for i in range(0, len(encoded), batch_size):
        b = collate(encoded[i : i + batch_size], tokenizer.pad_token_id)
        batches.append((b["input_ids"], b["attention_mask"]))
    return batches, len(rows)
