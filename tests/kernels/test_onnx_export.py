"""The pages' read exports with torch.onnx.export(dynamo=True) and ONNX Runtime reproduces it bit for bit."""

import numpy as np
import pytest
import torch

from kernels.kv_spec import PAGE_BITS, PageQuantSpec, key_code_shape
from kernels.page_quant import (
    READ_OPSET,
    dequantize_key_pages,
    dequantize_value_pages,
    key_scale_minimum,
    onnx_translations,
    seal_packed,
    sealed_key_scores,
)


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
                      dynamic_shapes=dynamic, optimize=True, verbose=False, opset_version=READ_OPSET,
                      custom_translation_table=onnx_translations())
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits", PAGE_BITS)
def test_the_read_of_sealed_pages_matches_ort_bit_exactly_at_every_width(bits, tmp_path):
    spec, bs, d = PageQuantSpec(k_bits=bits, v_bits=bits, v_group_size=16), 16, 64
    k, v = (torch.randn(5, 2, bs, d, generator=torch.Generator().manual_seed(i)) * 3 for i in (0, 1))
    stored = seal_packed(k, v, spec)  # 5 pages (S, nkv, ·, ·)
    roles = ("key_codes", "key_scale", "key_min", "value_codes", "value_scale", "value_min")
    # a row: (1, nkv, 5 ·, ·); the keys' grid codes stand in for their float scales and minima, as the read takes them
    rows = [stored[r].transpose(0, 1).reshape(1, 2, -1, stored[r].shape[-1]) for r in roles]
    rows[1:3] = [t.float() for t in rows[1:3]]
    batch, pages = torch.export.Dim("batch"), torch.export.Dim("pages")
    per_page = {"key_scale": 1, "key_min": 1, "key_codes": key_code_shape(bits, bs, d)[0]}  # the rest: bs rows a page
    dynamic = [{0: batch, 2: pages * per_page.get(n, bs)} for n in roles]
    read = ReadPages(spec, bs, d)
    session = _export(read, tuple(rows), list(roles), ["keys", "values"], tmp_path / "read.onnx", dynamic)
    for ours, theirs in zip(read(*rows), session.run(None, {n: t.numpy() for n, t in zip(roles, rows)})):
        assert np.array_equal(ours.numpy(), theirs)


class KeyScores(torch.nn.Module):
    """q against a row's sealed key pages as the paged graph gathers them (``sealed_key_scores``)."""

    def __init__(self, bits: int):
        super().__init__()
        self.bits = bits

    def forward(self, q, codes, scale, minimum):
        return sealed_key_scores(q, codes, scale, minimum, self.bits, 16)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_the_exported_key_scores_of_rows_without_a_sealed_page_are_empty(bits, tmp_path):
    """Until a row fills its second page it has no sealed page: the graph's key scores run on M = 0 pages. A reshape to
    an inferred (-1) width made ONNX Runtime's products fail there (the width of zero elements is not inferable)."""
    bs, d = 16, 64
    k = torch.randn(3, 2, bs, d, generator=torch.Generator().manual_seed(0)) * 3
    stored = seal_packed(k, k, PageQuantSpec(k_bits=bits, v_bits=bits, v_group_size=16))  # 3 pages (S, nkv, ·, ·)
    scale, minimum = key_scale_minimum(stored["key_scale"], stored["key_min"], stored["key_base"])
    row = [t.transpose(0, 1)[None] for t in (stored["key_codes"], scale, minimum)]  # (1, nkv, 3, ·, ·) as gathered
    q = torch.randn(1, 2, 7, d, generator=torch.Generator().manual_seed(1))
    batch, pages = torch.export.Dim("batch"), torch.export.Dim("pages")
    dynamic = [{0: batch}] + [{0: batch, 2: pages}] * 3
    names = ["q", "codes", "scale", "minimum"]
    scores = KeyScores(bits)
    session = _export(scores, (q, *row), names, ["scores"], tmp_path / "scores.onnx", dynamic)

    run = session.run(None, {n: t.numpy() for n, t in zip(names, (q, *row))})[0]
    assert np.allclose(run, scores(q, *row).numpy(), rtol=1e-5, atol=1e-4)
    empty = [t[:, :, :0] for t in row]  # no sealed page
    assert session.run(None, {n: t.numpy() for n, t in zip(names, (q, *empty))})[0].shape == (1, 2, 7, 0)
