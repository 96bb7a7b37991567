"""The lightning indexer: which compressed entries each query attends to (ENGINE.md §2.4).

    score[t, n] = sum_h w[t, h] * relu(q_idx[t, h] . k[n]),   w = weights_proj(x) * scale

Entry n of a ratio-r source is visible to query t iff n < (t + 1) // r. Selection is
deterministic: the k highest visible scores, ties broken toward the smaller position (ReLU
makes exact ties common), returned in ascending position order and padded with -1.

The candidate source (a FULL layer) also scores blocks of `candidate_block_size` entries by
their max, always keeps the block holding the query's newest visible entry, and publishes the
top `candidate_topk_blocks` blocks as the pool; REINDEX layers mask scores outside it to -inf.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .layers import Linear, RotaryTail


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Entries visible to queries at `positions`: (t + 1) // r."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def select_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """The k best valid scores per row, ties toward the smaller position.

    Args:
        scores: [c, E] float.
        valid: [c, E] bool; invalid entries are never selected.
        k: slots per row.

    Returns:
        [c, k] int64 positions in ascending order; rows with fewer than k valid entries are
        padded with -1 (unreachable slots) at the end.

    Why not `torch.topk` alone: its order among equal values is unspecified. Rows where the
    k-th best value also occurs outside the top-k (a tie straddling the cut; ReLU makes them
    common) are redone exactly: keep everything above the k-th value, then the leftmost
    entries equal to it.
    """
    c, num = scores.shape
    if num == 0 or c == 0:
        return torch.full((c, k), -1, dtype=torch.long, device=scores.device)
    s = scores.masked_fill(~valid, float("-inf"))
    kk = min(k, num)
    values, ids = s.topk(kk, dim=-1, sorted=False)
    threshold = values.amin(dim=-1, keepdim=True)
    straddles = ((s >= threshold).sum(dim=-1) > kk) & (threshold.squeeze(-1) > float("-inf"))
    if bool(straddles.any()):
        rows = straddles.nonzero().squeeze(-1)
        ids[rows] = _leftmost_topk(s[rows], threshold[rows], kk)
    ids = ids.masked_fill(values == float("-inf"), num).sort(dim=-1).values  # unreachable -> the end
    ids = ids.masked_fill(ids == num, -1)
    if kk < k:
        ids = torch.nn.functional.pad(ids, (0, k - kk), value=-1)
    return ids


def _leftmost_topk(s: torch.Tensor, threshold: torch.Tensor, k: int) -> torch.Tensor:
    """Exact tie-break for rows whose k-th value is tied: above the threshold, then leftmost equals."""
    above = s > threshold
    ties = s == threshold
    chosen = above | (ties & (ties.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
    return chosen.nonzero()[:, 1].view(s.shape[0], k)


try:  # optional: CPU-only installs never take the CUDA paths below
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

# CUDA index scores, chosen by STATESTORE_INDEX_SCORES:
#   "torch"     logits = q @ k.T (bf16, [c * Hi, E]), relu_, bmm with the head weights (the CPU path)
#   "epilogue"  the same with the ReLU in the matmul's epilogue (below)
#   "fused"     one Triton kernel: per [BM queries, BN entries] tile, sum over heads of
#               w[t, h] * relu(q[t, h] . k[n]) accumulated in float32 and rounded once; the
#               [c * Hi, E] logits never touch memory (4 GiB at a 1,024-query chunk over 64K
#               entries, written and read twice by "torch"). Not bit-identical to "torch"
#               (no bf16 rounding of each head's logit), equally valid: prefill and replay
#               both use it, so resume stays exact against a re-prefill on the same device.
# H200, 2026-11-29 (bf16, 32 heads x 128, .probe run): c = 1,024 queries over 64K / 128K entries
# took 4.61 / 9.13 ms ("torch"), 2.64 / 5.32 ms ("epilogue", same bits as "torch"), 0.89 / 2.08 ms
# ("fused", tile 64 x 128, 4 warps, 3 stages; relative error against float64 1.7e-3 vs 2.3e-3
# for "torch"; on random data 54-57% of the top-512 sets equal those of "torch", the rest differ
# at near-ties that bf16 scores cannot order).
INDEX_SCORES = os.environ.get("STATESTORE_INDEX_SCORES", "fused")
INDEX_TILE = tuple(int(v) for v in os.environ.get("STATESTORE_INDEX_TILE", "64,128,4,3").split(","))

if triton is not None:

    @triton.jit
    def _index_scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, C, E, stride_qc, stride_wc, stride_ke, stride_oc,
                             H: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        d = tl.arange(0, DI)
        m_ok = rm < C
        kt = tl.load(k_ptr + rn[None, :].to(tl.int64) * stride_ke + d[:, None], mask=rn[None, :] < E, other=0.0)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for h in range(H):
            q = tl.load(q_ptr + rm[:, None].to(tl.int64) * stride_qc + h * DI + d[None, :], mask=m_ok[:, None],
                        other=0.0)
            s = tl.dot(q, kt)
            w = tl.load(w_ptr + rm.to(tl.int64) * stride_wc + h, mask=m_ok, other=0.0).to(tl.float32)
            acc += w[:, None] * tl.maximum(s, 0.0)
        out = out_ptr + rm[:, None].to(tl.int64) * stride_oc + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (rn[None, :] < E))


def fused_index_scores(q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`index_scores` in one Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    c, heads, dim = q_idx.shape
    num = keys.shape[0]
    q = q_idx.reshape(c, heads * dim)
    q = q if q.stride(-1) == 1 else q.contiguous()
    w = weights if weights.stride(-1) == 1 else weights.contiguous()
    k = keys if keys.stride(-1) == 1 else keys.contiguous()
    out = torch.empty(c, num, dtype=q_idx.dtype, device=q_idx.device)
    if c and num:
        bm, bn, warps, stages = INDEX_TILE
        grid = (triton.cdiv(c, bm), triton.cdiv(num, bn))
        _index_scores_kernel[grid](q, w, k, out, c, num, q.stride(0), w.stride(0), k.stride(0), out.stride(0),
                                   H=heads, DI=dim, BM=bm, BN=bn, num_warps=warps, num_stages=stages)
    return out


# CUDA: the ReLU rides in the matmul's epilogue (cuBLASLt bias + ReLU, bias 0) instead of a
# separate pass over the [c * Hi, E] logits, the indexer's largest tensor (4 GiB of bf16 at a
# 1,024-query chunk over 64K entries): one write and one read of it instead of two of each.
# Same values: relu(x + 0) rounded once equals relu of x rounded (rounding is monotone and
# keeps zero); only the GEMM's accumulation order may differ (cuBLASLt may pick another
# kernel). The CPU path is unchanged.
_zero_bias: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _relu_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """relu(q @ keys.T) for [n, Di] queries and [E, Di] keys."""
    num = keys.shape[0]
    if INDEX_SCORES == "epilogue" and q.is_cuda and num > 1 and q.shape[0] > 1:
        cache_key = (q.device, q.dtype)
        zero = _zero_bias.get(cache_key)
        if zero is None or zero.shape[0] < num:
            zero = _zero_bias[cache_key] = torch.zeros(max(num, 1 << 17), dtype=q.dtype, device=q.device)
        return torch._addmm_activation(zero[:num], q, keys.T)
    return (q @ keys.T).relu_()


def index_scores(q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[c, Hi, Di] queries, [c, Hi] head weights, [E, Di] keys -> [c, E] scores."""
    c, heads, dim = q_idx.shape
    if INDEX_SCORES == "fused" and q_idx.is_cuda and triton is not None:
        return fused_index_scores(q_idx, weights, keys)
    logits = _relu_logits(q_idx.reshape(c * heads, dim), keys).view(c, heads, -1)
    return torch.bmm(weights.unsqueeze(1), logits).squeeze(1)


def candidate_pool(scores: torch.Tensor, num_visible: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """Pool blocks per query: [c, E] scores, [c] visible counts -> [c, num_blocks] block ids.

    Block score = max over its entries; the block of the newest visible entry is always kept;
    ids come back ascending, padded with -1 when fewer blocks are visible. No masking is needed:
    the only block that mixes visible and invisible entries is the newest one, whose score is
    forced to +inf, and blocks past it are invalid.
    """
    c, num = scores.shape
    full = num // block_size
    block_scores = scores[:, : full * block_size].view(c, full, block_size).amax(dim=-1)
    if num > full * block_size:
        block_scores = torch.cat([block_scores, scores[:, full * block_size:].amax(dim=-1, keepdim=True)], dim=1)
    block_ids = torch.arange(block_scores.shape[1], device=scores.device)[None, :]
    newest = ((num_visible - 1) // block_size)[:, None]
    block_scores = block_scores.masked_fill(block_ids == newest, float("inf"))
    return select_topk(block_scores, block_ids <= newest, num_blocks)


def pool_mask(pool: torch.Tensor, num_entries: int, block_size: int) -> torch.Tensor:
    """[c, nb_sel] pool block ids (-1 padded) -> [c, num_entries] bool: entry lies in a pool block."""
    c = pool.shape[0]
    nb = -(-num_entries // block_size)
    blocks = torch.zeros(c, nb + 1, dtype=torch.bool, device=pool.device)
    blocks.scatter_(1, torch.where(pool < 0, nb, pool.clamp(max=nb)), True)
    return blocks[:, :nb].repeat_interleave(block_size, dim=1)[:, :num_entries]


class Indexer(nn.Module):
    """Index queries and head weights of one FULL or REINDEX layer."""

    def __init__(self, q_rank: int, d_model: int, heads: int, dim: int, rope: RotaryTail, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.wq_idx = Linear(q_rank, heads * dim, dtype=dtype, device=device)
        self.weights_proj = Linear(d_model, heads, dtype=dtype, device=device)
        self.scale = (heads * dim) ** -0.5
        self.rope = rope

    def queries(self, qr: torch.Tensor, x: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [n, Hi, Di] at positions first.. (RoPE at t, like the keys at j*r), head weights [n, Hi]."""
        q = self.rope.apply_range(self.wq_idx(qr).view(-1, self.heads, self.dim), first)
        return q, self.weights_proj(x) * self.scale
