"""Plan a replay: which rows go through which layers, and what that costs.

A resume loads the persisted global state of tokens [0, P) and then rebuilds what was not
kept (SWA rings, compressor tails) by running the engine over trailing rows::

    tokens      0 ............................................ P ...... T
    loaded      [ global entries (MUST_KEEP, from the tiers)   ]
    replayed                                  [ R rows through layer 0 ]
                                                  [ fewer rows, layer 1 ] ... (staircase)

- `exact`: the staircase of every layer, so the state equals an uninterrupted run's;
- `bounded`: R = W + slack rows through every layer (what the shipped engines do);
- `off`: no load at all, a full re-prefill from token ids (the baseline).

Persisted entries are never rewritten; rows past P publish the entries P did not cover, and a
replay edge never splits a compression group (engine_adapter.rows aligns it).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_adapter.base import EngineCosts, ReplayGeometry
from engine_adapter.rows import REPLAY_MODES, ReplayMode, RowPlan, replay_rows


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What a resume will run. `rows` is None for `off` (a re-prefill, not a replay)."""

    mode: ReplayMode
    num_tokens: int
    persisted_tokens: int  # global state loaded for tokens [0, persisted_tokens)
    rows: RowPlan | None
    row_layers: int  # query rows x layers the engine computes
    est_seconds: float

    @property
    def replay_tokens(self) -> int:
        """Trailing tokens fed to the engine (R of ENGINE.md §4; T for `off`)."""
        return self.num_tokens if self.rows is None else self.rows.token_rows

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode, "num_tokens": self.num_tokens, "persisted_tokens": self.persisted_tokens,
            "replay_tokens": self.replay_tokens, "row_layers": self.row_layers,
            "layer_rows": list(self.rows.layer_rows) if self.rows else None,
            "est_seconds": self.est_seconds,
        }


def plan_replay(
    geometry: ReplayGeometry,
    costs: EngineCosts,
    mode: ReplayMode,
    num_tokens: int,
    persisted_tokens: int,
    *,
    slack: int = 0,
) -> ReplayPlan:
    """Plan the replay of a `num_tokens`-token sequence whose global state is persisted up to
    `persisted_tokens`. Pure: the same inputs give the same plan."""
    if mode not in REPLAY_MODES:
        raise ValueError(f"replay mode must be one of {', '.join(REPLAY_MODES)}, got {mode!r}")
    if num_tokens < 1:
        raise ValueError(f"a session needs at least one token to resume, got {num_tokens}")
    if not 0 <= persisted_tokens <= num_tokens:
        raise ValueError(f"persisted_tokens must lie in [0, {num_tokens}], got {persisted_tokens}")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    if mode == "off":
        return ReplayPlan(mode, num_tokens, 0, None, num_tokens * geometry.num_layers,
                          num_tokens * costs.prefill_s_per_token)
    rows = replay_rows(geometry, mode, num_tokens, published_tokens=persisted_tokens, slack=slack)
    return ReplayPlan(mode, num_tokens, persisted_tokens, rows, rows.row_layers,
                      rows.row_layers * costs.replay_s_per_row_layer)
