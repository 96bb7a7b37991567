"""Which trailing rows each layer computes: prefill tails and replay (ENGINE.md §4).

Pure functions of a `ReplayGeometry` and a few counts; no torch, nothing model-specific. The
replay planner (replay/) prices a resume with them and an engine runs exactly the `RowPlan`
they return, so the plan that is priced is the plan that runs.

A plan counts *input* rows: layer l reads the hidden states of its last `layer_rows[l]` rows,
computes their window keys (so its SWA ring comes from them), and emits outputs (queries,
attention, FFN) only for the rows the next layer reads, `layer_rows[l + 1]`; the last layer
emits `logit_rows`. Exact staircase, L layers of window W, last token only::

    rows read    layer 0: 1 + L(W-1)   layer 1: 1 + (L-1)(W-1)   ...   layer L-1: 1 + (W-1) = W
    rows output  layer 0: 1 + (L-1)(W-1)            ...                layer L-1: 1
                 -> L + (W-1) L (L-1) / 2 row-layers in all

A query row is exact iff its W - 1 predecessors were read by its layer with exact inputs, so
the staircase reproduces a full run; any plan whose layer reads fewer rows than the next layer
needs plus W - 1 (the `bounded` mode) is approximate above its first layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm
from typing import Literal

from engine_adapter.base import ReplayGeometry

ReplayMode = Literal["exact", "bounded", "off"]
REPLAY_MODES: tuple[str, ...] = ("exact", "bounded", "off")


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Trailing rows per layer for one forward over a sequence.

    `layer_rows[l]`: rows layer l reads (its window keys come from exactly these rows);
    non-increasing, since a layer can only read rows the layer below produced.
    `logit_rows`: trailing rows the LM head sees (1 for prefill, decode and replay).
    """

    layer_rows: tuple[int, ...]
    logit_rows: int = 1

    def __post_init__(self) -> None:
        rows = tuple(int(r) for r in self.layer_rows)
        object.__setattr__(self, "layer_rows", rows)
        if not rows or min(rows) < 1:
            raise ValueError(f"RowPlan: every layer must read at least one row, got {list(rows)}")
        if any(a < b for a, b in zip(rows, rows[1:])):
            raise ValueError(f"RowPlan: layer_rows must be non-increasing (a layer reads only rows the "
                             f"layer below produced), got {list(rows)}")
        if not 1 <= self.logit_rows <= rows[-1]:
            raise ValueError(f"RowPlan: logit_rows must lie in [1, {rows[-1]}], got {self.logit_rows}")

    @property
    def token_rows(self) -> int:
        """Trailing tokens embedded (rows read by layer 0)."""
        return self.layer_rows[0]

    def output_rows(self, layer_id: int) -> int:
        """Rows layer `layer_id` computes queries, attention and FFN for."""
        if layer_id + 1 < len(self.layer_rows):
            return self.layer_rows[layer_id + 1]
        return self.logit_rows

    @property
    def row_layers(self) -> int:
        """Query rows summed over layers: the work measure of ENGINE.md §4."""
        return sum(self.output_rows(i) for i in range(len(self.layer_rows)))

    @classmethod
    def full(cls, n_layers: int, num_rows: int, logit_rows: int = 1) -> RowPlan:
        """Every layer on every row (full recompute)."""
        return cls((num_rows,) * n_layers, logit_rows)


def staircase(num_layers: int, window: int) -> tuple[int, ...]:
    """Rows each of `num_layers` stacked window-W layers must read for an exact last token."""
    return tuple(1 + (num_layers - i) * (window - 1) for i in range(num_layers))


def staircase_for(windows: tuple[int, ...]) -> tuple[int, ...]:
    """The exact staircase for layers of different windows: layer i reads 1 + sum_{j>=i}(W_j - 1)."""
    out, need = [], 1
    for w in reversed(windows):
        need += w - 1
        out.append(need)
    return tuple(reversed(out))


def exact_replay_rows(num_layers: int, window: int) -> int:
    """R = 1 + L(W-1): tokens an exact replay of L layers starts from (2,414 for V4.1's decoder)."""
    return 1 + num_layers * (window - 1)


def replay_rows(
    geometry: ReplayGeometry,
    mode: ReplayMode,
    num_tokens: int,
    *,
    num_rows: int | None = None,
    first_layer: int = 0,
    published_tokens: int | None = None,
    bounded_rows: int | None = None,
    slack: int = 0,
) -> RowPlan:
    """The rows per layer of a prefill tail or a replay, as the engine will run them.

    Args:
        geometry: the layer stack.
        mode: "exact" (staircase), "bounded" (`bounded_rows`, default W + slack, through every
            layer from `first_layer`), "off" (every available row).
        num_tokens: T, the sequence length after the forward.
        num_rows: rows available to compute (new tokens of a prefill chunk; T for a replay).
        first_layer: layers below it read every available row (the encoder in prefill);
            0 replays the whole stack from tokens.
        published_tokens: global entries exist for tokens [0, P): layers up to the last
            publisher must read every row of [P, T) so new entries (and compressor tails) are
            published; in `exact` mode each layer below reads W - 1 more rows than the one
            above it, so what is published is exact too (matters when T - P outgrows the
            staircase: a resume whose later blocks are gone). None means nothing needs
            publishing beyond what the rows cover.
        bounded_rows / slack: the bounded tail length (default max window + slack).

    Returns:
        A `RowPlan` clamped to the available rows, whose start rows at and below the last
        publisher are aligned down to a multiple of every group size (a ratio-2 pair is never
        split at a replay edge).
    """
    if mode not in REPLAY_MODES:
        raise ValueError(f"replay mode must be one of {REPLAY_MODES}, got {mode!r}")
    n_layers = geometry.num_layers
    available = num_tokens if num_rows is None else num_rows
    if not 1 <= available <= num_tokens:
        raise ValueError(f"num_rows must lie in [1, num_tokens={num_tokens}], got {available}")
    if not 0 <= first_layer < n_layers:
        raise ValueError(f"first_layer must lie in [0, {n_layers}), got {first_layer}")
    if bounded_rows is not None and bounded_rows < 1:
        raise ValueError(f"bounded_rows must be >= 1, got {bounded_rows}")
    tail_windows = geometry.windows[first_layer:]
    if mode == "exact":
        tail_rows = staircase_for(tail_windows)
    elif mode == "bounded":
        tail_rows = (bounded_rows if bounded_rows is not None else max(tail_windows) + slack,) * len(tail_windows)
    else:
        tail_rows = (available,) * len(tail_windows)
    rows = [available] * first_layer + list(tail_rows)
    last = geometry.last_publisher
    if published_tokens is not None and last is not None:
        must = num_tokens - published_tokens
        rows[: last + 1] = [max(r, must) for r in rows[: last + 1]]
        if mode == "exact":  # the W - 1 lead-in under each raised layer keeps its inputs exact
            for i in range(min(last, n_layers - 1) - 1, first_layer - 1, -1):
                rows[i] = max(rows[i], rows[i + 1] + geometry.windows[i] - 1)
    for i in range(len(rows) - 2, -1, -1):  # non-increasing: a layer reads what the next one needs
        rows[i] = max(rows[i], rows[i + 1])
    if last is not None:
        align = lcm(*[g for g in geometry.group_tokens if g > 0] or [1])
        for i in range(last + 1):  # only where compression groups live
            rows[i] = num_tokens - (num_tokens - min(rows[i], available)) // align * align
    return RowPlan(tuple(min(r, available) for r in rows))
