"""Numerics of kernels/kv_quant.py: packing, quantization error, memory accounting, the reference cache."""

from dataclasses import replace

import pytest
import torch

from kernels.kv_quant import (
    QuantizedKVCache,
    dequantize,
    pack_bits,
    quantize,
    quantize_per_channel,
    quantize_per_token,
    scale_zero_from_range,
    unpack_bits,
    unpack_bits_f32,
)
from kernels.kv_spec import PRE_ROPE_SCHEME, KVQuantSpec, bytes_per_token, packed_size
from kernels.rope import rope_rotate


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("n", [64, 13, 8, 1])
def test_pack_round_trip_every_width(bits, n):
    # given random codes of every width, on a (B, nkv, T, n) tensor
    u = torch.randint(0, 2**bits, (2, 2, 5, n), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    # when packed and unpacked
    packed = pack_bits(u, bits)
    # then the bytes match the width and the codes come back unchanged
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, 2, 5, packed_size(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), u)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("n", [64, 13, 8])
def test_the_float_unpack_the_graph_reads_gives_the_same_integers_at_every_width(bits, n):
    # 3 bits go through one 24-bit word per 8 codes, 2 and 4 through byte parts, 5-7 through bit planes
    u = torch.randint(0, 2**bits, (2, 3, 0 if n == 8 else 5, n), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    assert torch.equal(unpack_bits_f32(pack_bits(u, bits), bits, n), u.float())


def test_stored_bytes_match_the_width():
    assert packed_size(64, 4) == 32  # half a byte per value
    assert packed_size(64, 2) == 16
    assert packed_size(64, 3) == 24
    assert packed_size(64, 5) == 40
    assert packed_size(64, 8) == 64


def test_4bit_layout_is_two_per_byte_low_nibble_first():
    u = torch.tensor([[1, 2, 3, 15, 0, 0, 0, 9]], dtype=torch.uint8)
    assert pack_bits(u, 4).tolist() == [[0x21, 0xF3, 0x00, 0x90]]


def test_4bit_symmetric_codes_are_offset_by_8_like_ort_gqa():
    scale = torch.tensor([[1.0, 1.0, 1.0, 1.0]])  # (nkv=1, d=4)
    x = torch.tensor([-7.0, -1.0, 0.0, 7.0]).view(1, 1, 1, 4)  # (B, nkv, T, d)
    u, _, _ = quantize_per_channel(x, scale, None, 4)
    assert u.flatten().tolist() == [1, 7, 8, 15]  # stored nibble = int4 value + 8


def test_2bit_layout_is_four_per_byte_lowest_first():
    u = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    assert pack_bits(u, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 0]]


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantization_error_is_at_most_half_a_step_inside_the_range(bits, symmetric):
    x = torch.randn(4, 2, 16, 32, generator=torch.Generator().manual_seed(0)) + 0.5  # off-centre channels
    lo, hi = x.amin(dim=(0, 2)), x.amax(dim=(0, 2))  # (nkv, d)
    scale, zero = scale_zero_from_range(lo, hi, bits, symmetric)
    u, _, _ = quantize_per_channel(x, scale, None if symmetric else zero, bits)
    z = torch.full_like(scale, 2.0 ** (bits - 1)) if symmetric else zero
    err = (dequantize(u, scale[:, None], z[:, None]) - x).abs()
    assert (err <= scale[:, None] * 0.5 + 1e-5 + (0 if symmetric else scale[:, None] * 0.5)).all()


@pytest.mark.parametrize("symmetric", [True, False])
def test_per_token_scales_are_fp16_and_an_all_zero_token_stays_zero(symmetric):
    x = torch.randn(1, 2, 3, 64)
    x[0, 1, 2] = 0.0
    u, scale, zero = quantize_per_token(x, 4, symmetric)
    assert scale.shape == (1, 2, 3, 1)
    assert torch.equal(scale, scale.half().float())
    y = dequantize(u, scale, zero)
    assert torch.isfinite(y).all()
    assert y[0, 1, 2].abs().max() == 0.0


def test_asymmetric_beats_symmetric_on_an_off_centre_channel():
    x = torch.rand(1, 1, 256, 8) * 2.0 + 10.0  # values in [10, 12]
    for sym, expect_small in ((True, False), (False, True)):
        lo, hi = x.amin(dim=(0, 2)), x.amax(dim=(0, 2))
        scale, zero = scale_zero_from_range(lo, hi, 4, sym)
        z = torch.full_like(scale, 8.0) if sym else zero
        err = (dequantize(quantize(x, scale[:, None], z[:, None], 4), scale[:, None], z[:, None]) - x).abs().max()
        assert (err < 0.1) == expect_small


def test_spec_refuses_every_bad_field_at_once():
    with pytest.raises(ValueError) as err:
        KVQuantSpec(k_bits=1, v_bits=9, k_granularity="head", sink_tokens=-1)
    for word in ("k_bits=1", "v_bits=9", "k_granularity", "sink_tokens"):
        assert word in str(err.value)


def test_bytes_per_token_counts_scales_sink_and_window():
    L, nkv, d, T = 4, 2, 64, 2048
    assert bytes_per_token(None, L, nkv, d, T) == 2048.0  # fp16: 2 tensors x 4 layers x 2 heads x 64 x 2 B
    chosen = PRE_ROPE_SCHEME  # K4 per-channel asym (fp32 scale+zero per channel), V4 per-token sym, sink 1
    per_token = L * (nkv * 32 * 2 + nkv * 2)  # packed K and V, fp16 V scale (no zero point: symmetric)
    static = L * nkv * d * 2 * 4  # K scale + zero, fp32
    sink = L * 2 * nkv * d * 2
    expected = ((T - 1) * per_token + static + sink) / T
    assert bytes_per_token(chosen, L, nkv, d, T) == pytest.approx(expected)
    assert 2048.0 / bytes_per_token(chosen, L, nkv, d, T) >= 3.5  # the acceptance ratio at 2048
    naive8 = KVQuantSpec(k_bits=8, v_bits=8, k_granularity="token", v_granularity="token")
    assert bytes_per_token(naive8, L, nkv, d, T) == L * 2 * nkv * (64 + 2)  # no zero points when symmetric
    assert bytes_per_token(replace(chosen, v_symmetric=False), L, nkv, d, T) == pytest.approx(expected + L * nkv * 2 * (T - 1) / T)
    windowed = replace(chosen, window_tokens=32)
    assert bytes_per_token(windowed, L, nkv, d, T) > bytes_per_token(chosen, L, nkv, d, T)


def _cache(spec, L=2, nkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    scales = {}
    if "channel" in (spec.k_granularity, spec.v_granularity):  # the scheme needs calibrated scales
        scales = dict(k_scale=torch.rand(L, nkv, d, generator=g) * 0.5 + 0.2, k_zero=torch.full((L, nkv, d), 7.0),
                      v_scale=torch.rand(L, nkv, d, generator=g) * 0.5 + 0.2, v_zero=torch.full((L, nkv, d), 7.0))
        if spec.k_symmetric:
            scales["k_zero"] = None
        if spec.v_symmetric:
            scales["v_zero"] = None
    return QuantizedKVCache(spec, L, d, inv_freq, **scales)


@pytest.mark.parametrize("spec", [
    PRE_ROPE_SCHEME,
    replace(PRE_ROPE_SCHEME, k_bits=3, v_bits=5, window_tokens=4),
    KVQuantSpec(k_bits=2, v_bits=2, k_granularity="token", v_granularity="token"),
    KVQuantSpec(k_bits=8, v_bits=8, v_symmetric=False, sink_tokens=2, window_tokens=3, pre_rope_keys=True),
])
def test_cache_stores_what_bytes_per_token_says(spec):
    B, nkv, T, d = 3, 2, 20, 16
    cache = _cache(spec)
    k, v = torch.randn(B, nkv, T, d), torch.randn(B, nkv, T, d)
    pos = torch.arange(T).expand(B, T)
    for i in range(2):
        cache.append(i, k, v, pos)
    assert len(cache) == T
    static = sum(s.numel() * 4 for s in (cache.static["k"][0] if spec.k_granularity == "channel" else None,
                                          cache.static["k"][1] if spec.k_granularity == "channel" and not spec.k_symmetric else None,
                                          cache.static["v"][0] if spec.v_granularity == "channel" else None,
                                          cache.static["v"][1] if spec.v_granularity == "channel" and not spec.v_symmetric else None)
                 if s is not None)
    per_sequence = (cache.stored_bytes() - static) / B + static
    assert per_sequence / T == pytest.approx(bytes_per_token(spec, 2, nkv, d, T))


def test_sink_and_window_tokens_are_exact_fp16_and_the_rest_is_quantized():
    spec = replace(PRE_ROPE_SCHEME, sink_tokens=2, window_tokens=5)
    cache = _cache(spec)
    B, nkv, T, d = 1, 2, 16, 16
    k, v = torch.randn(B, nkv, T, d), torch.randn(B, nkv, T, d)
    cache.append(0, k, v, torch.arange(T)[None])
    kq, vq = cache.get(0)
    assert kq.shape == (B, nkv, T, d)
    assert torch.equal(kq[:, :, :2], k[:, :, :2].half().float())
    assert torch.equal(vq[:, :, -5:], v[:, :, -5:].half().float())
    assert not torch.equal(vq[:, :, 2:-5], v[:, :, 2:-5].half().float())


def test_appending_token_by_token_equals_appending_at_once():
    # decode appends one token at a time; a window lets tokens wait before they are quantized
    spec = replace(PRE_ROPE_SCHEME, k_bits=3, window_tokens=3)
    B, nkv, T, d = 2, 2, 12, 16
    k, v = torch.randn(B, nkv, T, d), torch.randn(B, nkv, T, d)
    pos = torch.arange(T).expand(B, T)
    whole, steps = _cache(spec), _cache(spec)
    whole.append(0, k, v, pos)
    steps.append(0, k[:, :, :4], v[:, :, :4], pos[:, :4])
    for t in range(4, T):
        steps.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1], pos[:, t : t + 1])
    for a, b in zip(whole.get(0), steps.get(0)):
        assert torch.equal(a, b)
    assert len(steps) == T


def test_pre_rope_keys_come_back_rotated_and_close():
    spec = replace(PRE_ROPE_SCHEME, k_bits=8, v_bits=8, sink_tokens=0)
    cache = _cache(spec)
    cache.static["k"] = (torch.full((2, 2, 16), 4.0 / 127), None)  # generous range: no clipping
    cache.spec = replace(spec, k_symmetric=True)
    B, nkv, T, d = 1, 2, 10, 16
    pre = torch.randn(B, nkv, T, d).clamp(-3.5, 3.5)
    pos = torch.arange(T)[None] + 100
    post = rope_rotate(pre, pos, cache.inv_freq)
    cache.append(0, post, torch.zeros_like(post), pos)
    k, _ = cache.get(0)
    assert (k - post).abs().max() < 0.03


def test_cache_refuses_missing_calibration():
    with pytest.raises(ValueError, match="calibrated k_scale"):
        QuantizedKVCache(PRE_ROPE_SCHEME, 2, 16, torch.ones(8))
    with pytest.raises(ValueError, match="inv_freq"):
        QuantizedKVCache(replace(PRE_ROPE_SCHEME, k_granularity="token"), 2, 16, None)


def test_the_hadamard_matrix_is_orthogonal_with_exact_entries_at_head_dim_64():
    from kernels.kv_quant import hadamard_matrix

    h = hadamard_matrix(64)
    assert torch.equal(h @ h, torch.eye(64))  # +-1/8 entries: every product and sum is exact
    assert torch.equal(h.abs(), torch.full((64, 64), 0.125)) and torch.equal(h, h.T)
    with pytest.raises(ValueError, match="head_dim=48: a Walsh-Hadamard rotation needs a power of two"):
        hadamard_matrix(48)


def test_a_rotated_cache_spreads_rare_spikes_and_reads_back_the_unrotated_keys():
    """Rare spikes (1% of entries 20x, heavy tails every channel's static range must cover): on the
    rotated keys per-channel scales lose far less of the attention scores, and the cache hands back
    keys in the backbone's basis (q k^T directly). A channel that is merely wide is not such a case:
    its own scale already covers it, and turning spreads its range into every channel."""
    from kernels.kv_quant import hadamard_matrix

    torch.manual_seed(0)
    L, nkv, T, d = 1, 2, 64, 64
    spec = KVQuantSpec()
    k = torch.randn(1, nkv, T, d)
    k = torch.where(torch.rand(k.shape) < 0.01, 20 * k, k)
    v = torch.randn(1, nkv, T, d)
    q = torch.randn(1, nkv, 8, d)
    errors = {}
    for name, r in (("none", None), ("hadamard", hadamard_matrix(d)[None])):
        kr, vr = (k, v) if r is None else (k @ r[0], v @ r[0])
        scales = {f"{n}_scale": x.abs().amax(2) / 7 for n, x in (("k", kr), ("v", vr))}  # (L = 1, nkv, d), amax / 7
        cache = QuantizedKVCache(spec, L, d, rotation=r, **scales)
        cache.append(0, k, v, torch.arange(T)[None])
        k_read, v_read = cache.get(0)
        errors[name] = float(((q @ k_read.transpose(-1, -2) - q @ k.transpose(-1, -2)) ** 2).mean())
    assert errors["hadamard"] < errors["none"] / 2  # measured 5.5 vs 13.9


def test_a_rotation_is_refused_for_keys_cached_before_rope():
    from kernels.kv_quant import hadamard_matrix

    with pytest.raises(ValueError, match="a KV rotation turns post-RoPE keys"):
        QuantizedKVCache(PRE_ROPE_SCHEME, 1, 8, torch.ones(4), k_scale=torch.ones(1, 2, 8), k_zero=torch.zeros(1, 2, 8),
                         rotation=hadamard_matrix(8)[None])
