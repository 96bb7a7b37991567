"""Which trailing rows each layer of a CED model computes: prefill tails and replay (ENGINE.md §4).

A plan counts *input* rows: layer l reads the hidden states of its last `layer_rows[l]` rows,
computes their window keys (so its SWA ring comes from them), and emits queries, attention and
FFN only for the rows the next layer reads; the last layer for the LM head's row. Exact
staircase, L layers of window W, last token only::

    rows read    layer 0: 1 + L(W-1)   layer 1: 1 + (L-1)(W-1)   ...   layer L-1: W
    rows output  layer 0: 1 + (L-1)(W-1)            ...                layer L-1: 1
                 -> L + (W-1) L (L-1) / 2 row-layers in all

`RowPlan` and the staircase arithmetic are shared with the replay planner
(`engine_adapter.rows`). What a `CEDConfig` looks like to it (`replay_geometry`):

    windows          W for every layer
    group_tokens     the compression ratios
    last_publisher   the last KV source (layers up to it publish global entries)
    first_decoder    the layer after the candidate source (prefill runs every row below it)

NOTE: the candidate source belongs to the encoder. ENGINE.md §4's R = 2,414 for V4.1's "decoder
tail 21-39" is 1 + 19 x 127, so layer 20 reads every prompt row (its compressor needs them);
it computes queries only for the rows layer 21 reads, which changes no number.
"""

from __future__ import annotations

from engine_adapter.base import ReplayGeometry
from engine_adapter.rows import REPLAY_MODES, ReplayMode, RowPlan, exact_replay_rows, staircase

from .config import CEDConfig

__all__ = ["REPLAY_MODES", "ReplayMode", "RowPlan", "exact_replay_rows", "staircase", "replay_geometry",
           "replay_rows", "prefill_plan"]


def replay_geometry(config: CEDConfig) -> ReplayGeometry:
    """The layer stack of `config` as row planning sees it."""
    decoder = config.decoder_layer_ids
    return ReplayGeometry(windows=(config.sliding_window,) * config.n_layers,
                          group_tokens=tuple(config.compress_ratios),
                          last_publisher=config.kv_source_layer_ids[-1],
                          first_decoder_layer=decoder[0] if decoder else None)


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
    """Rows per layer of a replay (or a prefill tail) of a CED model, as the engine will run them.

    Args:
        config: the model.
        mode: "exact" (the staircase: layer l reads W - 1 more rows than layer l + 1, the last
            layer W), "bounded" (`bounded_rows`, default W + slack, through every layer from
            `first_layer`), "off" (every available row).
        num_tokens: T, the sequence length after the forward.
        num_rows: rows available (the new tokens of a prefill chunk; default T for a replay).
        first_layer: layers below it read every available row (prefill passes the first decoder
            layer); 0 replays the whole stack from tokens.
        published_tokens: entries exist for tokens [0, P): every KV source layer reads all of
            [P, T) so the missing entries and compressor tails are published; in `exact` mode
            the layers below read W - 1 more rows each, so what is published is exact too.

    Returns:
        A `RowPlan` clamped to the available rows.

    NOTE: start rows need no alignment. The edge a compressor group must not straddle is P,
    the end of the persisted entries, and P is always a multiple of every ratio (imports start
    there; the rest of a ratio-2 pair is a compressor tail). Rows replayed below P are read as
    window keys only, never compressed again, so an odd start row splits nothing, and the row
    counts stay the spec's: 1 + 40 x 127 = 5,081 (V4.1, whole stack), 2,414 (decoder tail).

    Typical calls:
        resume from tokens, nothing local kept   replay_rows(c, "exact", T, published_tokens=P)
                                                 -> layer 0 reads 1 + n_layers(W-1) rows (5,081 for V4.1)
        V4.1's shipped behaviour                 replay_rows(c, "bounded", T, published_tokens=P, slack=5)
        decoder tail only (prefill)              replay_rows(c, "exact", T, first_layer=c.decoder_layer_ids[0])

    NOTE: `engine_adapter.rows.replay_rows` raises the source layers to T - P without the W - 1
    lead-in below them, which is exact only while T - P fits inside the staircase (P near T).
    """
    if mode not in REPLAY_MODES:
        raise ValueError(f"replay mode must be one of {REPLAY_MODES}, got {mode!r}")
    available = num_tokens if num_rows is None else num_rows
    if not 1 <= available <= num_tokens:
        raise ValueError(f"num_rows must lie in [1, num_tokens={num_tokens}], got {available}")
    if not 0 <= first_layer < config.n_layers:
        raise ValueError(f"first_layer must lie in [0, {config.n_layers}), got {first_layer}")
    bounded = config.sliding_window + slack if bounded_rows is None else bounded_rows
    if bounded < 1:
        raise ValueError(f"bounded rows must be >= 1, got {bounded}")
    must = 0 if published_tokens is None else num_tokens - published_tokens
    if must < 0:
        raise ValueError(f"published_tokens={published_tokens} exceeds num_tokens={num_tokens}")
    last_source = config.kv_source_layer_ids[-1]
    rows, above = [0] * config.n_layers, 1  # `above`: rows the next layer reads (the LM head: 1)
    for layer_id in reversed(range(config.n_layers)):
        if layer_id < first_layer or mode == "off":
            r = available
        elif mode == "exact":
            r = above + config.sliding_window - 1
        else:
            r = max(bounded, above)
        if layer_id <= last_source:
            r = max(r, must)
        rows[layer_id] = above = min(r, available)
    return RowPlan(tuple(rows))


def prefill_plan(config: CEDConfig, num_tokens: int, num_new: int, decoder_rows: int | None = None) -> RowPlan:
    """Prefill of `num_new` tokens ending at `num_tokens`: encoder on every new row, decoder on a tail.

    `decoder_rows=None` is the exact staircase (bit-identical to a full run up to reduction
    order); an int runs that many rows through every decoder layer (approximate when it is
    shorter than the staircase).
    """
    if not config.decoder_layer_ids:
        return RowPlan.full(config.n_layers, num_new)
    mode: ReplayMode = "exact" if decoder_rows is None else "bounded"
    return replay_rows(config, mode, num_tokens, num_rows=num_new, first_layer=config.decoder_layer_ids[0],
                       bounded_rows=decoder_rows)
