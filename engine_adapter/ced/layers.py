"""Small building blocks: RMSNorm, RoPE on a tail, SwiGLU, a plain linear layer.

Everything here is stateless apart from its weights and works on any device and float dtype.
Low-precision inputs (bf16/fp16) are normalised in float32; float32 and float64 stay as they are,
so a float64 engine is float64 end to end (the exactness tests rely on it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: where the spec says "in fp32" a float64 engine keeps float64."""
    return torch.promote_types(dtype, torch.float32)


class Linear(nn.Module):
    """y = x W^T, no bias (none of the CED projections has one)."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in at least float32."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(y.dtype)).to(x.dtype)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), with w1 and w3 fused into one matmul."""

    def __init__(self, d_model: int, d_ffn: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.w13 = Linear(d_model, 2 * d_ffn, dtype=dtype, device=device)
        self.w2 = Linear(d_ffn, d_model, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class RotaryTail:
    """RoPE on the last `rope_dim` channels (half-split pairs), at explicit integer positions.

    Angles are computed in float64 from integer positions, so position p rotates identically
    whether it is reached in a 4K-row prefill or in a single decode step.
    """

    def __init__(self, rope_dim: int, theta: float, device: torch.device) -> None:
        self.rope_dim = rope_dim
        half = rope_dim // 2
        self.inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=device) * 2.0 / rope_dim)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, rope_dim/2] cos and sin for integer positions [n]."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """Rotate x [n, D] or [n, H, D] by +position (or -position when `inverse`); a new tensor."""
        cos, sin = self.cos_sin(positions, x.dtype)
        if inverse:
            sin = -sin
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        half = self.rope_dim // 2
        out = x.clone()
        a = x[..., -self.rope_dim: x.shape[-1] - half]
        b = x[..., x.shape[-1] - half:]
        out[..., -self.rope_dim: x.shape[-1] - half] = a * cos - b * sin
        out[..., x.shape[-1] - half:] = a * sin + b * cos
        return out
