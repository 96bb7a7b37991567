"""Per-forward metadata passed explicitly down the stack (nano-vllm's `Context`, minus the global).

Index sources write their top-k here and later layers of the same forward read it; the
candidate source writes the pool. One context per sequence per forward, then dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .plan import RowPlan
from .state import SequenceState


@dataclass(slots=True)
class StepContext:
    """What one forward over one sequence shares between its layers."""

    state: SequenceState
    end: int  # T: position after the newest row
    plan: RowPlan
    query_chunk: int  # queries per indexer chunk (bounds the [chunk, E] score tiles)
    attention_tile: int  # queries per attention tile (each reads tile + W - 1 window keys)
    fp8_ring: bool = False  # window keys pass through FP8 E4M3 + E8M0/32, as V4.1's GPU rings store them
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [rows, k] entry ids
    pool: torch.Tensor | None = None  # [rows, candidate_topk_blocks] block ids, from the candidate source
    bias_cache: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)  # window band masks

    def positions(self, num_rows: int) -> torch.Tensor:
        """Positions of the trailing `num_rows` rows."""
        return torch.arange(self.end - num_rows, self.end, device=self.state.tokens.view().device)
