"""kernels.gqa_attention: the eager reference is what ONNX Runtime's GroupQueryAttention computes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kernels.gqa_attention import gqa_problems, gqa_quantized_attention, onnx_translation
from kernels.kv_quant import pack_bits, quantize
from kernels.kv_spec import PRE_ROPE_SCHEME, KVQuantSpec

NH, NKV, D = 4, 2, 16


class OneOp(torch.nn.Module):
    def forward(self, q, k, v, past_k, past_v, k_scale, v_scale, bias):
        return gqa_quantized_attention(q, k, v, past_k, past_v, k_scale, v_scale, bias, NH, NKV)


def inputs(B: int, T: int, P: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, n * D, generator=g) for n in (NH, NKV, NKV))
    past_k, past_v = (torch.randint(0, 256, (B, NKV, P, D // 2), dtype=torch.uint8, generator=g) for _ in range(2))
    k_scale, v_scale = (torch.rand(1, NKV, 1, D, generator=g) * 0.4 + 0.1 for _ in range(2))
    bias = torch.zeros(B, 1, T, P + T)
    bias[-1, :, :, :2] = torch.finfo(torch.float32).min  # the last row's first two slots are padding
    return q, k, v, past_k, past_v, k_scale, v_scale, bias


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    Dim = torch.export.Dim
    b, t, p, s = Dim("b"), Dim("t"), Dim("p"), Dim("s")
    dynamic = ({0: b, 1: t}, {0: b, 1: t}, {0: b, 1: t}, {0: b, 2: p}, {0: b, 2: p}, None, None, {0: b, 2: t, 3: s})
    program = torch.onnx.export(OneOp(), inputs(2, 3, 5), dynamo=True, dynamic_shapes=dynamic, opset_version=18,
                                custom_translation_table=onnx_translation())
    path = tmp_path_factory.mktemp("gqa") / "gqa.onnx"
    program.save(str(path))
    assert [n.op_type for n in onnx.load(path).graph.node].count("GroupQueryAttention") == 1
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("B,T,P", [(2, 3, 5), (1, 1, 40), (3, 6, 0)], ids=["chunk-after-past", "decode", "prefill"])
def test_onnx_runtime_stores_the_reference_integers_and_attends_like_it(session, B, T, P):
    args = inputs(B, T, P, seed=B * 100 + P)
    want = OneOp()(*args)
    got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})

    assert np.array_equal(got[1], want[1].numpy()) and np.array_equal(got[2], want[2].numpy())
    assert np.array_equal(got[1][:, :, :P], args[3].numpy())  # the past bytes are kept as they were
    # A query that sees only padded slots (the padded prompt tokens themselves) has no defined
    # output; ONNX Runtime and the reference fill it differently, both finite. Every other row agrees.
    sees_a_real_slot = (torch.arange(T)[None, :] + P >= torch.tensor([0] * (B - 1) + [2])[:, None]).numpy()  # (B, T)
    assert np.abs(got[0] - want[0].numpy())[sees_a_real_slot].max() < 1e-5
    assert np.isfinite(got[0]).all()


def test_new_tokens_are_stored_offset_by_8_two_per_byte_low_nibble_first():
    q, k, v, past_k, past_v, k_scale, v_scale, bias = inputs(1, 2, 0)
    _, present_k, _ = gqa_quantized_attention(q, k, v, past_k, past_v, k_scale, v_scale, bias, NH, NKV)
    u = torch.clamp(torch.round(k.view(1, 2, NKV, D).transpose(1, 2) / k_scale), -8, 7) + 8
    assert torch.equal(present_k, (u[..., 0::2] + 16 * u[..., 1::2]).to(torch.uint8))
    assert torch.equal(present_k, pack_bits(quantize(k.view(1, 2, NKV, D).transpose(1, 2), k_scale, torch.tensor(8.0), 4), 4))


def test_a_token_reads_its_own_value_through_the_quantizer():
    q, k, v, past_k, past_v, k_scale, v_scale, bias = inputs(1, 1, 0)
    out, _, _ = gqa_quantized_attention(q, k, v, past_k, past_v, k_scale, v_scale, bias, NH, NKV)
    own = v.view(NKV, D)
    dequantized = (torch.clamp(torch.round(own / v_scale.view(NKV, D)), -8, 7)) * v_scale.view(NKV, D)
    head0 = out.view(NH, D)[0]  # one slot: softmax weight 1 on it
    assert torch.allclose(head0, dequantized[0], atol=1e-6) and not torch.allclose(head0, own[0], atol=1e-3)


def test_only_the_scheme_the_op_implements_has_no_problems():
    gqa = KVQuantSpec(k_bits=4, v_bits=4, k_granularity="channel", v_granularity="channel", k_symmetric=True,
                      v_symmetric=True, sink_tokens=0, window_tokens=0, pre_rope_keys=False)
    assert gqa_problems(gqa) == []
    assert KVQuantSpec() == gqa  # the defaults are the scheme the release ships, which the op runs
    assert gqa_problems(PRE_ROPE_SCHEME) == [
        "v_granularity='token' (the op needs 'channel')", "k_symmetric=False (the op needs True)",
        "sink_tokens=1 (the op needs 0)", "pre_rope_keys=True (the op needs False)"]
    assert gqa_problems(KVQuantSpec(k_bits=8)) == ["k_bits=8 (the op needs 4)"]
