"""`replay.quality.logits_divergence`: the measure the demo and bench.resume report."""

from __future__ import annotations

import math

import pytest
import torch

from replay.quality import logits_divergence


def test_identical_logits_do_not_diverge() -> None:
    logits = torch.randn(8192, generator=torch.Generator().manual_seed(0))
    d = logits_divergence(logits, logits.clone())
    assert d.top1_same and d.kl == 0.0 and d.max_abs_dlogit == 0.0


def test_divergence_matches_the_definitions() -> None:
    ref = torch.tensor([2.0, 1.0, 0.0, -1.0])
    other = torch.tensor([1.0, 2.0, 0.0, -1.0])  # the top two swapped
    d = logits_divergence(ref, other)
    p = torch.softmax(ref.double(), -1)
    q = torch.softmax(other.double(), -1)
    assert not d.top1_same and d.max_abs_dlogit == 1.0
    assert math.isclose(d.kl, float((p * (p / q).log()).sum()), rel_tol=1e-12) and d.kl > 0
    # A constant shift of every logit is the same distribution: KL 0, top-1 kept.
    shifted = logits_divergence(ref, ref + 3.0)
    assert shifted.top1_same and abs(shifted.kl) < 1e-12 and shifted.max_abs_dlogit == 3.0


def test_logits_of_other_vocabularies_are_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        logits_divergence(torch.zeros(4), torch.zeros(5))
