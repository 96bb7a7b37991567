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
        mode: "exact" (the staircase: layer l reads W_l - 1 more rows than layer l + 1, the
            last layer W), "bounded" (`bounded_rows`, default max W + slack, through every layer
            from `first_layer`), "off" (every available row).
        num_tokens: T, the sequence length after the forward.
        num_rows: rows available to compute (new tokens of a prefill chunk; T for a replay).
        first_layer: layers below it read every available row (the encoder in prefill);
            0 replays the whole stack from tokens.
        published_tokens: global entries exist for tokens [0, P): layers up to the last
            publisher read all of [P, T) so the missing entries (and compressor tails) are
            published; in `exact` mode every layer below reads W - 1 more rows than the one
            above it, so what is published is exact too (this matters when T - P outgrows the
            staircase: a resume whose later blocks are gone). None: nothing to publish.
        bounded_rows / slack: the bounded tail length (default max window + slack).

    Returns:
        A `RowPlan` clamped to the available rows.

    NOTE: start rows need no alignment. The edge a compression group must not straddle is P,
    the end of the persisted entries, and P is a multiple of every group size (imports start
    there; the rest of a ratio-2 pair is a compressor tail). Rows replayed below P are read as
    window keys only and never compressed again, so an odd start row splits nothing and the
    counts stay ENGINE.md's: 1 + 40 x 127 = 5,081 (V4.1, whole stack), 2,414 (decoder tail).
    """
    if mode not in REPLAY_MODES:
        raise ValueError(f"replay mode must be one of {REPLAY_MODES}, got {mode!r}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    available = num_tokens if num_rows is None else num_rows
    if not 1 <= available <= num_tokens:
        raise ValueError(f"num_rows must lie in [1, num_tokens={num_tokens}], got {available}")
    n_layers = geometry.num_layers
    if not 0 <= first_layer < n_layers:
        raise ValueError(f"first_layer must lie in [0, {n_layers}), got {first_layer}")
    bounded = max(geometry.windows) + slack if bounded_rows is None else bounded_rows
    if bounded < 1:
        raise ValueError(f"bounded_rows must be >= 1, got {bounded}")
    must = 0 if published_tokens is None else num_tokens - published_tokens
    if must < 0:
        raise ValueError(f"published_tokens={published_tokens} exceeds num_tokens={num_tokens}")
    last = -1 if geometry.last_publisher is None else geometry.last_publisher
    rows, above = [0] * n_layers, 1  # `above`: rows the next layer reads (the LM head: 1)
    for layer_id in reversed(range(n_layers)):
        if layer_id < first_layer or mode == "off":
            r = available
        elif mode == "exact":
            r = above + geometry.windows[layer_id] - 1
        else:
            r = max(bounded, above)
        if layer_id <= last:
            r = max(r, must)
        rows[layer_id] = above = min(r, available)
    return RowPlan(tuple(rows))
