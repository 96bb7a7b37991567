"""CSA2 attention of one layer (ENGINE.md §2): MQA over one latent, window + sparse global entries.

For the query rows of a forward (always the trailing rows of what the layer reads)::

    q       = rope(wq_b(norm(wq_a(x))))                  [n, H, D]   rope on the tail at t
    window  = rope(norm(wkv(x)))                          [m, D]      -> this layer's SWA ring
    entries = the owner's dequantized global KV           [E, D]      (published by the compressor)
    top-k   = own indexer (FULL/REINDEX) or the last index source's (REUSE)
    p       = softmax([q.window_keys || q.entries[top-k] || sink_h] * D^-1/2)   one softmax
    out     = wo_b(grouped wo_a(inverse_rope(p @ values)))                    key = value

Queries are processed in chunks so nothing T x T is ever materialised: a chunk of c queries
has [c, E] index scores, and each attention tile of t queries reads only the t + W - 1 window
keys around it (t = 64 on the CPU wastes 1.5x on the band instead of 3x at t = 256).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .codecs import PackedFP4, dequantize_fp8, gather_dequantize_fp4, quantize_fp8_e8m0
from .compressor import Compressor
from .config import RING_BLOCK, CEDConfig, LayerMode
from .context import StepContext
from .indexer import Indexer, candidate_pool, index_scores, pool_mask, select_topk, visible_entries
from .layers import Linear, RMSNorm, RotaryTail, compute_dtype
from .state import Ring


def band_bias(first_pos: int, num_queries: int, key_lo: int, num_keys: int, window: int, heads: int,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[c * H, m] additive mask (0 or -inf): query t sees window keys t-W+1 .. t; rows query-major."""
    qpos = torch.arange(first_pos, first_pos + num_queries, device=device)[:, None]
    kpos = torch.arange(key_lo, key_lo + num_keys, device=device)[None, :]
    hidden = (kpos > qpos) | (kpos <= qpos - window)
    bias = torch.zeros(num_queries, num_keys, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    return bias.repeat_interleave(heads, dim=0)


def window_sparse_attention(
    q: torch.Tensor,
    first_pos: int,
    keys: torch.Tensor,
    key_start: int,
    window: int,
    entries: torch.Tensor | None,
    topk: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
    bias_cache: dict[tuple[int, int, int], torch.Tensor] | None = None,
    packed: PackedFP4 | None = None,
) -> torch.Tensor:
    """One softmax over [window keys || selected entries || sink] for a chunk of queries.

    Args:
        q: [c, H, D] queries for positions [first_pos, first_pos + c).
        keys: [m, D] window keys for positions [key_start, key_start + m), ending at or after
            the last query; positions the buffer lacks are simply not seen.
        window: W, counting the key itself: query t sees keys t-W+1 .. t.
        entries: [E, D] dequantized global entries, or None for a WINDOW layer.
        topk: [c, k] entry ids (-1 = unreachable), or None.
        sink: [H] per-head sink logits (a key with value zero).
        bias_cache: band masks by (c, first_pos - key_lo, m); every interior chunk of a
            forward has the same one, so it is built once (the GEMM adds it for free).
        packed: the same entries still packed (FP4); when given, the selected rows are
            dequantized straight from them (one fused kernel on CUDA) instead of gathered
            from `entries`: bit-identical, since dequantization is exact.

    Returns:
        [c, H, D] attention output (before the inverse RoPE).
    """
    c, heads, dim = q.shape
    last = first_pos + c
    lo = max(key_start, first_pos - window + 1)
    kw = keys[lo - key_start: last - key_start]
    nk = kw.shape[0]
    key = (c, first_pos - lo, nk)
    bias = None if bias_cache is None else bias_cache.get(key)
    if bias is None:
        bias = band_bias(first_pos, c, lo, nk, window, heads, q.dtype, q.device)
        if bias_cache is not None:
            bias_cache[key] = bias
    qs = q * scale
    cdt = compute_dtype(q.dtype)
    logits = [torch.addmm(bias, qs.view(c * heads, dim), kw.T).view(c, heads, nk).to(cdt)]
    gathered = None
    if topk is not None and entries is not None and entries.shape[0] > 0:
        if packed is not None:
            gathered = gather_dequantize_fp4(packed, topk, q.dtype)  # [c, k, D]
        else:
            gathered = torch.nn.functional.embedding(topk.clamp(min=0), entries)  # [c, k, D]
        sparse = torch.bmm(qs, gathered.transpose(1, 2)).to(cdt)
        logits.append(sparse.masked_fill_((topk < 0)[:, None, :], float("-inf")))
    logits.append(sink.to(cdt).view(1, heads, 1).expand(c, heads, 1))
    probs = torch.cat(logits, dim=-1).softmax(dim=-1).to(q.dtype)
    out = (probs[..., :nk].reshape(c * heads, nk) @ kw).view(c, heads, dim)
    if gathered is not None:
        out = out + torch.bmm(probs[..., nk: nk + gathered.shape[1]], gathered)
    return out


@dataclass(slots=True)
class _Selection:
    """The sparse half of one layer's attention for its query rows (all None for a WINDOW layer)."""

    entries: torch.Tensor | None = None  # [E, D] the owner's dequantized global KV
    packed: PackedFP4 | None = None  # the same entries packed (CUDA: attention gathers from these)
    topk: torch.Tensor | None = None  # [n, k] entry ids: reused, or filled chunk by chunk by this layer
    index_q: tuple[torch.Tensor, torch.Tensor] | None = None  # own index queries [n, Hi, Di], weights [n, Hi]
    index_keys: torch.Tensor | None = None  # [E, Di] the owner's dequantized index keys
    pool_in: torch.Tensor | None = None  # REINDEX: the candidate pool of these rows
    pool_out: torch.Tensor | None = None  # candidate source: the pool it publishes


def _rows(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if t is None else t[lo:hi]


class Attention(nn.Module):
    """Weights of one layer's attention and the glue that reads/writes its state."""

    def __init__(self, config: CEDConfig, layer_id: int, rope: RotaryTail, index_rope: RotaryTail, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c = config
        self.layer_id, self.mode = layer_id, c.layer_mode(layer_id)
        self.ratio = c.compress_ratios[layer_id]
        self.kv_source, self.index_source = c.kv_source_of(layer_id), c.index_source_of(layer_id)
        self.is_candidate = layer_id == c.candidate_source_layer_id
        self.heads, self.dim, self.window = c.n_heads, c.d_latent, c.sliding_window
        self.topk, self.block_size, self.pool_blocks = c.index_topk, c.candidate_block_size, c.candidate_topk_blocks
        self.scale = c.d_latent ** -0.5
        kw = dict(dtype=dtype, device=device)
        self.wq_a = Linear(c.d_model, c.q_rank, **kw)
        self.q_norm = RMSNorm(c.q_rank, c.norm_eps, **kw)
        self.wq_b = Linear(c.q_rank, c.n_heads * c.d_latent, **kw)
        self.wkv = Linear(c.d_model, c.d_latent, **kw)
        self.kv_norm = RMSNorm(c.d_latent, c.norm_eps, **kw)
        self.sink = nn.Parameter(torch.empty(c.n_heads, **kw), requires_grad=False)
        self.wo_a = nn.Parameter(torch.empty(c.o_groups, c.n_heads * c.d_latent // c.o_groups, c.o_rank, **kw),
                                 requires_grad=False)
        self.wo_b = Linear(c.o_groups * c.o_rank, c.d_model, **kw)
        self.rope = rope
        self.compressor = (Compressor(c.d_model, c.d_latent, c.index_dim, self.ratio, c.norm_eps, rope, index_rope,
                                      **kw) if self.mode is LayerMode.FULL else None)
        self.indexer = (Indexer(c.q_rank, c.d_model, c.index_heads, c.index_dim, index_rope, **kw)
                        if self.mode in (LayerMode.FULL, LayerMode.REINDEX) else None)

    def forward(self, x: torch.Tensor, num_out: int, ctx: StepContext) -> torch.Tensor:
        """x: normed inputs of the rows this layer reads -> [num_out, d_model] for the trailing rows."""
        first = ctx.end - x.shape[0]
        keys, key_start = self._window_keys(x, first, ctx.state.rings[self.layer_id], ctx.fp8_ring)
        if self.compressor is not None:
            self.compressor.publish(x, first, ctx.state.sources[self.layer_id])
        xq = x[-num_out:]
        first_out = ctx.end - num_out
        qr = self.q_norm(self.wq_a(xq))
        q = self.rope.apply_range(self.wq_b(qr).view(num_out, self.heads, self.dim), first_out)
        out = self._attend(q, qr, xq, ctx.positions(num_out), keys, key_start, ctx)
        return self._project_out(self.rope.apply_range(out, first_out, inverse=True))

    def _window_keys(self, x: torch.Tensor, first: int, ring: Ring, fp8: bool) -> tuple[torch.Tensor, int]:
        """Window keys of the rows read, preceded by the ring when it ends right before them.

        With `fp8` the keys are rounded through the FP8 ring format before anyone reads them, so
        attention sees exactly what an FP8 ring holds and an FP8 export of the ring is lossless.
        """
        kv = self.rope.apply_range(self.kv_norm(self.wkv(x)), first)
        if fp8:
            kv = dequantize_fp8(quantize_fp8_e8m0(kv, RING_BLOCK), kv.dtype)
        if ring.end == first and len(ring):
            keys, key_start = torch.cat([ring.view(), kv]), ring.start
        else:
            keys, key_start = kv, first
        ring.push(kv, first)
        return keys, key_start

    def _attend(self, q: torch.Tensor, qr: torch.Tensor, xq: torch.Tensor, pos: torch.Tensor,
                keys: torch.Tensor, key_start: int, ctx: StepContext) -> torch.Tensor:
        """Chunked over queries: select (own indexer or reused top-k), then attend tile by tile."""
        num_out, first_pos = q.shape[0], ctx.end - q.shape[0]
        sel = self._prepare_selection(qr, xq, first_pos, ctx)
        out = torch.empty_like(q)
        chunk, tile = ctx.query_chunk, ctx.attention_tile
        for c0 in range(0, num_out, chunk):  # index scores are [chunk, E]: bounded memory
            c1 = min(num_out, c0 + chunk)
            if sel.index_q is not None:
                sel.topk[c0:c1] = self._select(sel.index_q[0][c0:c1], sel.index_q[1][c0:c1], pos[c0:c1],
                                               first_pos + c1, sel.index_keys, _rows(sel.pool_in, c0, c1),
                                               _rows(sel.pool_out, c0, c1))
            for a0 in range(c0, c1, tile):  # a tile of t queries reads t + W - 1 window keys
                a1 = min(c1, a0 + tile)
                out[a0:a1] = window_sparse_attention(q[a0:a1], first_pos + a0, keys, key_start, self.window,
                                                     sel.entries, _rows(sel.topk, a0, a1), self.sink, self.scale,
                                                     ctx.bias_cache, sel.packed)
        if sel.index_q is not None:
            ctx.topk[self.layer_id] = sel.topk
        if sel.pool_out is not None:
            ctx.pool = sel.pool_out
        return out

    def _prepare_selection(self, qr: torch.Tensor, xq: torch.Tensor, first_pos: int, ctx: StepContext) -> _Selection:
        """What this layer's mode reads: the owner's entries, its own index queries or a reused top-k."""
        sel = _Selection()
        if self.kv_source is None:
            return sel  # WINDOW
        source = ctx.state.sources[self.kv_source]
        sel.entries = source.main_values.view()
        if sel.entries.is_cuda and sel.entries.shape[0]:  # fused gather + dequantize of the top-k rows
            sel.packed = source.packed(0, source.num_entries)[0]
        num_out = qr.shape[0]
        if self.indexer is None:  # REUSE: the last index source's top-k for these (trailing) rows
            sel.topk = ctx.topk[self.index_source][-num_out:]
            return sel
        sel.index_q = self.indexer.queries(qr, xq, first_pos)
        sel.index_keys = source.index_values.view()
        sel.topk = torch.empty(num_out, self.topk, dtype=torch.long, device=qr.device)
        if self.is_candidate:
            sel.pool_out = torch.empty(num_out, self.pool_blocks, dtype=torch.long, device=qr.device)
        if self.mode is LayerMode.REINDEX:
            sel.pool_in = ctx.pool[-num_out:]
        return sel

    def _select(self, qi: torch.Tensor, wi: torch.Tensor, pos: torch.Tensor, end: int, index_keys: torch.Tensor,
                pool_in: torch.Tensor | None, pool_out: torch.Tensor | None) -> torch.Tensor:
        """Top-k entry ids for one chunk of queries ending before position `end`."""
        num = end // self.ratio  # entries visible to the chunk's last query
        scores = index_scores(qi, wi, index_keys[:num])
        num_visible = visible_entries(pos, self.ratio)
        valid = torch.arange(num, device=pos.device)[None, :] < num_visible[:, None]
        if pool_out is not None:
            pool_out[:] = candidate_pool(scores, num_visible, self.block_size, self.pool_blocks)
        if pool_in is not None:
            valid &= pool_mask(pool_in, num, self.block_size)
        return select_topk(scores, valid, self.topk)

    def _project_out(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection: heads in o_groups groups -> o_rank each -> d_model."""
        n, groups = o.shape[0], self.wo_a.shape[0]
        grouped = o.reshape(n, groups, -1).transpose(0, 1)
        return self.wo_b(torch.bmm(grouped, self.wo_a).transpose(0, 1).reshape(n, -1))
