"""kernels.rope: the backbone's RoPE, against Hugging Face's rotate_half."""

import torch

from kernels.rope import apply_rope, rope_cos_sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate_half (transformers' Llama/Qwen2 modeling), the reference."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_the_sign_in_the_sine_table_gives_the_same_float32_numbers_as_rotate_half():
    d = 64
    inv_freq = 1.0 / (1000000.0 ** (torch.arange(0, d, 2).float() / d))
    x = torch.randn(2, 6, 9, d, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9) * 37
    freqs = pos.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], -1).unsqueeze(1)  # (B, 1, T, d)
    cos, sin_signed = rope_cos_sin(pos, inv_freq)
    assert torch.equal(cos, emb.cos())
    assert torch.equal(apply_rope(x, cos, sin_signed), x * emb.cos() + rotate_half(x) * emb.sin())
    assert torch.equal(apply_rope(x, cos, -sin_signed), x * emb.cos() + rotate_half(x) * -emb.sin())  # the inverse
