"""Which trailing rows each layer computes: prefill tails and replay (ENGINE.md §4).

Pure functions of a config and a few counts; no torch. The replay planner calls
`replay_rows` to price a resume, and the engine runs exactly the `RowPlan` it returns.

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

from .config import CEDConfig

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


def exact_replay_rows(num_layers: int, window: int) -> int:
    """R = 1 + L(W-1): tokens an exact replay of L layers starts from (2,414 for V4.1's decoder)."""
    return 1 + num_layers * (window - 1)


def replay_rows(
    config: CEDConfig,
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
        config: the model.
        mode: "exact" (staircase), "bounded" (`bounded_rows`, default W + slack, through every
            layer from `first_layer`), "off" (every available row).
        num_tokens: T, the sequence length after the forward.
        num_rows: rows available to compute (new tokens of a prefill chunk; T for a replay).
        first_layer: layers below it read every available row (the encoder in prefill: pass
            `config.decoder_layer_ids[0]`); 0 replays the whole stack from tokens.
        published_tokens: global entries exist for tokens [0, P): layers up to the last KV
            source must read every row of [P, T) so the new entries (and compressor tails)
            are published. None means nothing needs publishing beyond what the rows cover.
        bounded_rows / slack: the bounded tail length (default W + slack).

    Returns:
        A `RowPlan` clamped to the available rows, whose start rows at and below the last KV
        source are aligned down to a multiple of every compression ratio (a ratio-2 pair is
        never split at a replay edge; the decoder owns no groups, so its rows stay exact).
    """
    if mode not in REPLAY_MODES:
        raise ValueError(f"replay mode must be one of {REPLAY_MODES}, got {mode!r}")
    available = num_tokens if num_rows is None else num_rows
    if not 1 <= available <= num_tokens:
        raise ValueError(f"num_rows must lie in [1, num_tokens={num_tokens}], got {available}")
    if not 0 <= first_layer < config.n_layers:
        raise ValueError(f"first_layer must lie in [0, {config.n_layers}), got {first_layer}")
    tail = config.n_layers - first_layer
    if mode == "exact":
        tail_rows = staircase(tail, config.sliding_window)
    elif mode == "bounded":
        tail_rows = (bounded_rows if bounded_rows is not None else config.sliding_window + slack,) * tail
    else:
        tail_rows = (available,) * tail
    rows = [available] * first_layer + list(tail_rows)
    if published_tokens is not None:
        must = num_tokens - published_tokens
        last_source = config.kv_source_layer_ids[-1]
        rows[: last_source + 1] = [max(r, must) for r in rows[: last_source + 1]]
    for i in range(len(rows) - 2, -1, -1):  # non-increasing: a layer reads what the next one needs
        rows[i] = max(rows[i], rows[i + 1])
    align = lcm(*[r for r in config.compress_ratios if r > 0] or [1])
    for i in range(config.kv_source_layer_ids[-1] + 1):  # only where compressor groups live
        rows[i] = num_tokens - (num_tokens - min(rows[i], available)) // align * align
    return RowPlan(tuple(min(r, available) for r in rows))


def prefill_plan(config: CEDConfig, num_tokens: int, num_new: int, decoder_rows: int | None = None) -> RowPlan:
    """Prefill of `num_new` tokens ending at `num_tokens`: encoder on every new row, decoder on a tail.

    `decoder_rows=None` is the exact staircase (bit-identical to a full run up to reduction
    order); an int runs that many rows through every decoder layer (approximate).
    """
    if not config.decoder_layer_ids:
        return RowPlan.full(config.n_layers, num_new)
    mode: ReplayMode = "exact" if decoder_rows is None else "bounded"
    return replay_rows(config, mode, num_tokens, num_rows=num_new, first_layer=config.decoder_layer_ids[0],
                       bounded_rows=decoder_rows)
