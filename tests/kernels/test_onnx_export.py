"""The kernels export with torch.onnx.export(dynamo=True) and ONNX Runtime reproduces them bit for bit."""

import numpy as np
import pytest
import torch

from kernels.kv_quant import dequantize, pack_bits, quantize_per_channel, quantize_per_token, unpack_bits
from kernels.kv_spec import PAGE_BITS, PageQuantSpec
from kernels.page_quant import dequantize_key_pages, dequantize_value_pages, seal_packed

# The engine's quantize and read steps as modules of their own, each exported alone.


class QuantizePack(torch.nn.Module):
    """(x (B, nkv, T, d), scale (nkv, d), zero (nkv, d)) -> packed (B, nkv, T, d b / 8) uint8.

    Static per-channel keys (or values); the engine's quantize-on-append step.
    """

    def __init__(self, bits: int):
        super().__init__()
        self.bits = bits

    def forward(self, x, scale, zero):
        u, _, _ = quantize_per_channel(x, scale, zero, self.bits)
        return pack_bits(u, self.bits)


class UnpackDequantize(torch.nn.Module):
    """(packed, scale (nkv, d), zero (nkv, d)) -> x (B, nkv, T, d) float32; the read step."""

    def __init__(self, bits: int, head_dim: int):
        super().__init__()
        self.bits, self.head_dim = bits, head_dim

    def forward(self, packed, scale, zero):
        u = unpack_bits(packed, self.bits, self.head_dim)  # (B, nkv, T, d)
        return dequantize(u, scale[:, None, :], zero[:, None, :])


class QuantizePackPerToken(torch.nn.Module):
    """x (B, nkv, T, d) -> (packed, scale (B, nkv, T, 1), zero (B, nkv, T, 1)): online per-token values."""

    def __init__(self, bits: int, symmetric: bool):
        super().__init__()
        self.bits, self.symmetric = bits, symmetric

    def forward(self, x):
        u, scale, zero = quantize_per_token(x, self.bits, self.symmetric)
        return pack_bits(u, self.bits), scale, zero


class UnpackDequantizePerToken(torch.nn.Module):
    def __init__(self, bits: int, head_dim: int):
        super().__init__()
        self.bits, self.head_dim = bits, head_dim

    def forward(self, packed, scale, zero):
        return dequantize(unpack_bits(packed, self.bits, self.head_dim), scale, zero)


class ReadPages(torch.nn.Module):
    """A row's sealed pages as the paged graph gathers them -> (keys, values) (B, nkv, M bs, d) float32."""

    def __init__(self, spec: PageQuantSpec, block_size: int, head_dim: int):
        super().__init__()
        self.spec, self.block_size, self.head_dim = spec, block_size, head_dim

    def forward(self, k_codes, k_scale, k_min, v_codes, v_scale, v_min):
        return (dequantize_key_pages(k_codes, k_scale, k_min, self.spec.k_bits, self.block_size),
                dequantize_value_pages(v_codes, v_scale, v_min, self.spec.v_bits, self.head_dim))


def _export(module, args, names, outputs, path, dynamic):
    torch.onnx.export(module.eval(), args, str(path), dynamo=True, input_names=names, output_names=outputs,
                      dynamic_shapes=dynamic, optimize=True, verbose=False)
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits", [4, 3])
def test_per_channel_quantize_pack_and_unpack_dequantize_match_ort_bit_exactly(bits, tmp_path):
    B, nkv, T, d = 2, 2, 7, 64
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(B, nkv, T, d, generator=g) * 3
    scale = torch.rand(nkv, d, generator=g) * 0.5 + 0.1
    zero = torch.round(torch.rand(nkv, d, generator=g) * 2**bits)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")

    q = _export(QuantizePack(bits), (x, scale, zero), ["x", "scale", "zero"], ["packed"], tmp_path / "q.onnx",
                {"x": {0: batch, 2: seq}, "scale": None, "zero": None})
    packed = QuantizePack(bits)(x, scale, zero)
    x2 = torch.randn(3, nkv, 11, d, generator=g) * 3  # other batch and length than at export
    for inp in (x, x2):
        ours = QuantizePack(bits)(inp, scale, zero).numpy()
        theirs = q.run(None, {"x": inp.numpy(), "scale": scale.numpy(), "zero": zero.numpy()})[0]
        assert theirs.dtype == np.uint8 and np.array_equal(ours, theirs)

    dq = _export(UnpackDequantize(bits, d), (packed, scale, zero), ["packed", "scale", "zero"], ["x"],
                 tmp_path / "dq.onnx", {"packed": {0: batch, 2: seq}, "scale": None, "zero": None})
    ours = UnpackDequantize(bits, d)(packed, scale, zero).numpy()
    theirs = dq.run(None, {"packed": packed.numpy(), "scale": scale.numpy(), "zero": zero.numpy()})[0]
    assert np.array_equal(ours, theirs)  # bit-exact, not allclose


def test_per_token_values_match_ort_bit_exactly(tmp_path):
    bits, d = 4, 64
    x = torch.randn(1, 2, 5, d, generator=torch.Generator().manual_seed(0))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    q = _export(QuantizePackPerToken(bits, False), (x,), ["x"], ["packed", "scale", "zero"], tmp_path / "qt.onnx",
                {"x": {0: batch, 2: seq}})
    ours = [t.numpy() for t in QuantizePackPerToken(bits, False)(x)]
    theirs = q.run(None, {"x": x.numpy()})
    for a, b in zip(ours, theirs):
        assert np.array_equal(a, b)
    packed, scale, zero = (torch.from_numpy(t) for t in theirs)
    dq = _export(UnpackDequantizePerToken(bits, d), (packed, scale, zero), ["packed", "scale", "zero"], ["x"],
                 tmp_path / "dqt.onnx", {"packed": {0: batch, 2: seq}, "scale": {0: batch, 2: seq}, "zero": {0: batch, 2: seq}})
    assert np.array_equal(UnpackDequantizePerToken(bits, d)(packed, scale, zero).numpy(),
                          dq.run(None, {"packed": theirs[0], "scale": theirs[1], "zero": theirs[2]})[0])


@pytest.mark.parametrize("bits", PAGE_BITS)
def test_the_read_of_sealed_pages_matches_ort_bit_exactly_at_every_width(bits, tmp_path):
    spec, bs, d = PageQuantSpec(k_bits=bits, v_bits=bits, v_group_size=16), 16, 64
    k, v = (torch.randn(5, 2, bs, d, generator=torch.Generator().manual_seed(i)) * 3 for i in (0, 1))
    stored = seal_packed(k, v, spec)  # 5 pages (S, nkv, ·, ·)
    roles = ("key_codes", "key_scale", "key_min", "value_codes", "value_scale", "value_min")
    rows = [stored[r].transpose(0, 1).reshape(1, 2, -1, stored[r].shape[-1]) for r in roles]  # a row: (1, nkv, 5 ·, ·)
    batch, pages = torch.export.Dim("batch"), torch.export.Dim("pages")
    dynamic = [{0: batch, 2: pages * (1 if n in ("key_scale", "key_min") else bs)} for n in roles]
    read = ReadPages(spec, bs, d)
    session = _export(read, tuple(rows), list(roles), ["keys", "values"], tmp_path / "read.onnx", dynamic)
    for ours, theirs in zip(read(*rows), session.run(None, {n: t.numpy() for n, t in zip(roles, rows)})):
        assert np.array_equal(ours.numpy(), theirs)
