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
from engine_adapter import rows
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


def replay_rows(config: CEDConfig, mode: ReplayMode, num_tokens: int, **kwargs: int | None) -> RowPlan:
    """`engine_adapter.rows.replay_rows` over this config's geometry (same keyword arguments).

    Typical calls:
        resume from tokens, nothing local kept   replay_rows(c, "exact", T, published_tokens=P)
                                                 -> layer 0 reads 1 + n_layers(W-1) rows (5,081 for V4.1)
        V4.1's shipped behaviour                 replay_rows(c, "bounded", T, published_tokens=P, slack=5)
        decoder tail only (prefill)              replay_rows(c, "exact", T, first_layer=c.decoder_layer_ids[0])
    """
    return rows.replay_rows(replay_geometry(config), mode, num_tokens, **kwargs)


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
