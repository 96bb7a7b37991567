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
        cdt = compute_dtype(x.dtype)
        return F.rms_norm(x.to(cdt), self.weight.shape, self.weight.to(cdt), self.eps).to(x.dtype)


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
    whether it is reached in a 4K-row prefill or in a single decode step. Contiguous positions
    (window keys, queries) read a float64 table that grows by doubling; it belongs to this
    object (one per model), not to the process.
    """

    def __init__(self, rope_dim: int, theta: float, device: torch.device) -> None:
        self.rope_dim = rope_dim
        half = rope_dim // 2
        self.inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=device) * 2.0 / rope_dim)
        self._cos = self._sin = self.inv_freq[None, :0]
        self._size = 0

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """Rotate x [n, D] or [n, H, D] by +position (or -position when `inverse`); a new tensor."""
        cos, sin = self._angles(positions)
        return self._rotate(x, cos, sin, inverse)

    def apply_range(self, x: torch.Tensor, start: int, *, inverse: bool = False) -> torch.Tensor:
        """`apply` at positions start .. start + n - 1, from the table (same values, fewer ops)."""
        end = start + x.shape[0]
        if end > self._size:
            self._size = max(end, 2 * self._size, 1024)
            self._cos, self._sin = self._angles(torch.arange(self._size, device=self.inv_freq.device))
        return self._rotate(x, self._cos[start:end], self._sin[start:end], inverse)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if inverse:
            sin = -sin
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        d, half = x.shape[-1], self.rope_dim // 2
        a, b = x[..., d - self.rope_dim: d - half], x[..., d - half:]
        out = x.clone()
        out[..., d - self.rope_dim: d - half] = a * cos - b * sin
        out[..., d - half:] = a * sin + b * cos
        return out
