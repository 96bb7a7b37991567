"""How close a replayed state comes to the one it stands for, by its next-token logits.

`exact` replay recomputes every row the sliding windows need (the same state up to float
rounding: its matmuls have other shapes than the prefill's); `bounded` replays fewer rows and
approximates it. What a user of the state sees of the difference is the next-token
distribution, so that is what is compared: top-1 agreement, KL divergence and the largest
logit difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Divergence:
    """`other`'s next-token logits against `ref`'s."""

    top1_same: bool
    kl: float  # KL(ref || other) of the softmax distributions, in nats
    max_abs_dlogit: float


def logits_divergence(ref: torch.Tensor, other: torch.Tensor) -> Divergence:
    """Compare two next-token logit vectors of the same vocabulary (float64 throughout)."""
    if ref.shape != other.shape:
        raise ValueError(f"logits of shape {tuple(ref.shape)} against {tuple(other.shape)}")
    a, b = ref.detach().double().cpu(), other.detach().double().cpu()
    p, q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    return Divergence(top1_same=int(a.argmax()) == int(b.argmax()),
                      kl=float((p.exp() * (p - q)).sum()),
                      max_abs_dlogit=float((a - b).abs().max()))
