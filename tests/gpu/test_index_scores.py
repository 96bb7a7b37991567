"""The fused Triton index-score kernel against a float64 reference (ENGINE.md §2 step 4).

score[t, n] = sum_h w[t, h] * relu(q[t, h] . k[n]). The kernel accumulates in float32 and rounds
once, so it is compared by relative error, not bits; it runs on CUDA (or under
TRITON_INTERPRET=1 on the CPU), else the test is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine_adapter.ced import indexer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(indexer.triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
                       reason="needs CUDA and triton (or TRITON_INTERPRET=1)"),
]


@pytest.mark.parametrize(("queries", "entries", "heads", "dim"), [(1, 7, 4, 64), (130, 300, 32, 128), (64, 4096, 8, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_index_scores_match_float64(queries: int, entries: int, heads: int, dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(queries * 7 + entries)
    q = torch.randn(queries, heads, dim, generator=gen)
    w = torch.randn(queries, heads, generator=gen) * dim ** -0.5
    k = torch.randn(entries, dim, generator=gen)
    ref = torch.einsum("th,the->te", w.double(), torch.relu(torch.einsum("thd,ed->the", q.double(), k.double())))
    out = indexer.fused_index_scores(q.to(DEVICE, dtype), w.to(DEVICE, dtype), k.to(DEVICE, dtype))
    assert out.shape == (queries, entries) and out.dtype == dtype and torch.isfinite(out).all()
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < (1e-2 if dtype is torch.bfloat16 else 2e-3), float(err)  # tl.dot on float32 runs in tf32
