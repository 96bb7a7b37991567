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


def index_scores(q_idx: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[c, Hi, Di] queries, [c, Hi] head weights, [E, Di] keys -> [c, E] scores."""
    c, heads, dim = q_idx.shape
    logits = (q_idx.reshape(c * heads, dim) @ keys.T).view(c, heads, -1).relu_()
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
