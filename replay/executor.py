"""Run a `ReplayPlan` through an engine adapter."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine_adapter.base import EngineAdapter
from replay.planner import ReplayPlan


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a replay did and how long it took."""

    mode: str
    replay_tokens: int
    row_layers: int
    seconds: float


def execute_replay(adapter: EngineAdapter, state: object, token_ids: Sequence[int], plan: ReplayPlan) -> ReplayReport:
    """Make `state` live: replay its trailing rows (`exact`/`bounded`) or re-prefill (`off`).

    For `exact`/`bounded` the persisted global state of [0, plan.persisted_tokens) must already
    be imported; for `off` the state must be fresh. Blocking (torch): call it off the event loop.
    """
    if len(token_ids) != plan.num_tokens:
        raise ValueError(f"the plan is for {plan.num_tokens} tokens, got {len(token_ids)}")
    start = time.perf_counter()
    if plan.rows is None:
        adapter.append(state, token_ids)
    else:
        adapter.replay(state, token_ids, plan.rows.layer_rows)
    return ReplayReport(plan.mode, plan.replay_tokens, plan.row_layers, time.perf_counter() - start)
