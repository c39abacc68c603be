"""Rotary position embedding (RoPE, Su et al. 2021): the one implementation every path shares.

The backbone (``runtime/engine/model.py``) rotates queries and keys with it. Channel i pairs with channel i + d/2 and both share an angle (Hugging Face's
``rotate_half`` layout); the inverse frequencies come from ``runtime.engine.model.rope_inv_freq``.

``rotate_half``'s sign is carried by the sine table instead of a Neg on every rotated tensor:
x cos + rotate_half(x) sin = x cos + swap_halves(x) sin_signed with sin_signed = (-sin, sin) per
half. The same float32 numbers (a sign flip is exact), one op less wherever it is applied.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (B, T) -> (cos, sin_signed), each (B, 1, T, d): broadcast over heads by ``apply_rope``."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (B, T, d/2)
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # (B, 1, T, d): channels i and i + d/2 share an angle
    sin = emb.sin()
    half = sin.shape[-1] // 2
    return emb.cos(), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x (..., d) rotated by the angles of ``rope_cos_sin`` (cos and sin_signed broadcast against x)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin_signed
