"""The compressor of a KV source: r tokens -> one FP4 global entry + one FP4 index key (ENGINE.md §2.3).

    ratio 1: c_j = norm(wkv_c(x_j))
    ratio r: c_j = norm(sum_i softmax_i(wgate(x_i)) * wkv_c(x_i)) over the r tokens of group j,
             per channel, in at least fp32; no overlap between groups
    main entry  = quantize_e4m3_16(rope(c_j, j*r))          (quantized after RoPE, tail included)
    index key   = quantize_e8m0_32(rope(norm(wk(c_j)), j*r))

An incomplete trailing group waits in the source's tail (its wkv_c and wgate rows) until the
rows that complete it arrive; the tail is rebuildable from tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from .codecs import quantize_fp4_e4m3, quantize_fp4_e8m0
from .layers import Linear, RMSNorm, RotaryTail, compute_dtype
from .state import SourceState


class Compressor(nn.Module):
    """Weights and publishing logic of one KV source."""

    def __init__(self, d_model: int, d_latent: int, index_dim: int, ratio: int, eps: float,
                 rope: RotaryTail, index_rope: RotaryTail, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv_c = Linear(d_model, d_latent, dtype=dtype, device=device)
        self.wgate = Linear(d_model, d_latent, dtype=dtype, device=device) if ratio > 1 else None
        self.norm = RMSNorm(d_latent, eps, dtype=dtype, device=device)
        self.wk = Linear(d_latent, index_dim, dtype=dtype, device=device)
        self.k_norm = RMSNorm(index_dim, eps, dtype=dtype, device=device)
        self.rope, self.index_rope = rope, index_rope

    def publish(self, x: torch.Tensor, first: int, source: SourceState) -> None:
        """Feed normed rows x for positions [first, first + n) and publish every completed group.

        Rows the source has already seen (replay over a persisted range) are skipped: replay
        never rewrites a published entry.
        """
        seen = source.covered_tokens
        if seen < first:
            raise ValueError(f"layer {source.layer_id}: rows start at {first} but the compressor has only seen "
                             f"tokens [0, {seen}); a forward must cover every unpublished token")
        x_new = x[seen - first:]
        if x_new.shape[0] == 0:
            return
        cdt = compute_dtype(x.dtype)
        kv = self.wkv_c(x_new).to(cdt)
        if self.wgate is None:
            latent = self.norm(kv)
        else:
            gate = torch.cat([source.tail_gate, self.wgate(x_new).to(cdt)])
            kv = torch.cat([source.tail_kv, kv])
            groups = kv.shape[0] // self.ratio
            cut = groups * self.ratio
            source.tail_kv, source.tail_gate = kv[cut:].clone(), gate[cut:].clone()
            if groups == 0:
                return
            weights = gate[:cut].view(groups, self.ratio, -1).softmax(dim=1)
            latent = self.norm((kv[:cut].view(groups, self.ratio, -1) * weights).sum(dim=1))
        latent = latent.to(x.dtype)
        e0 = source.num_entries
        positions = torch.arange(e0, e0 + latent.shape[0], device=x.device) * self.ratio
        main = self.rope.apply(latent, positions)
        key = self.index_rope.apply(self.k_norm(self.wk(latent)), positions)
        source.append(quantize_fp4_e4m3(main, 16), quantize_fp4_e8m0(key, 32), x.dtype)
