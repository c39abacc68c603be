"""The pages' read exports with torch.onnx.export(dynamo=True) and ONNX Runtime reproduces it bit for bit."""

import numpy as np
import pytest
import torch

from kernels.kv_spec import PAGE_BITS, PageQuantSpec
from kernels.page_quant import READ_OPSET, dequantize_key_pages, dequantize_value_pages, onnx_translations, seal_packed


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
    rows = [stored[r].transpose(0, 1).reshape(1, 2, -1, stored[r].shape[-1]) for r in roles]  # a row: (1, nkv, 5 ·, ·)
    batch, pages = torch.export.Dim("batch"), torch.export.Dim("pages")
    dynamic = [{0: batch, 2: pages * (1 if n in ("key_scale", "key_min") else bs)} for n in roles]
    read = ReadPages(spec, bs, d)
    session = _export(read, tuple(rows), list(roles), ["keys", "values"], tmp_path / "read.onnx", dynamic)
    for ours, theirs in zip(read(*rows), session.run(None, {n: t.numpy() for n, t in zip(roles, rows)})):
        assert np.array_equal(ours.numpy(), theirs)
