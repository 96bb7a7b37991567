"""The replay planner (replay/planner.py) and the row planning under it (engine_adapter/rows.py).

Pure and table-driven: every expected row count below was derived by hand from ENGINE.md §4,
not printed by the code under test. Geometries:

    MINI  8 layers, W = 8, ratios [0,0,2,2,1,1,1,1], last publisher 4, decoder 5..7
          exact staircase (1 + (8 - i) * 7):  57 50 43 36 29 22 15 8
    V41   40 layers, W = 128, ratios [0,0] + [2]*18 + [1]*20, last publisher 20, decoder 21..39
          decoder tail 21..39: R = 1 + 19 * 127 = 2,414; whole stack: R = 1 + 40 * 127 = 5,081

Start rows need no alignment: the edge a ratio-2 group must not straddle is P (the end of
the persisted entries, always a multiple of every ratio), and rows replayed below P are window
keys only, never compressed again. So the counts are ENGINE.md's exactly; layers up to the last
publisher are raised to T - P, and in `exact` mode every layer below keeps its W - 1 lead-in:

    T = 100, P = 20, exact   top-down: 8, 15, 22, then layer 4 must cover [20, 100): 80,
                             layer 3: 80 + 7 = 87, layer 2: 94, layers 1, 0: 101 -> clamped to 100
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine_adapter.base import EngineCosts, ReplayGeometry
from engine_adapter.rows import RowPlan, exact_replay_rows, replay_rows, staircase, staircase_for
from replay import ReplayPlan, plan_replay


MINI = ReplayGeometry(windows=(8,) * 8, group_tokens=(0, 0, 2, 2, 1, 1, 1, 1), last_publisher=4,
                      first_decoder_layer=5)
V41 = ReplayGeometry(windows=(128,) * 40, group_tokens=(0, 0) + (2,) * 18 + (1,) * 20, last_publisher=20,
                     first_decoder_layer=21)
COSTS = EngineCosts(prefill_s_per_token=1e-3, decode_s_per_token=4e-3, replay_s_per_row_layer=1e-4)
MINI_STAIRCASE = (57, 50, 43, 36, 29, 22, 15, 8)


# ----- the staircase of ENGINE.md §4 --------------------------------------------------------


def test_engine_md_row_counts() -> None:
    assert exact_replay_rows(19, 128) == 2414  # V4.1 decoder tail 21..39
    assert exact_replay_rows(40, 128) == 5081  # V4.1 whole stack from tokens
    assert staircase(19, 128)[0] == 2414 and staircase(19, 128)[-1] == 128
    assert staircase(40, 128)[0] == 5081
    assert staircase(8, 8) == MINI_STAIRCASE
    # L + (W - 1) L (L - 1) / 2 row-layers: the work of an exact last token.
    assert RowPlan(staircase(8, 8)).row_layers == 8 + 7 * 8 * 7 // 2 == 204
    assert RowPlan(staircase(19, 128)).row_layers == 19 + 127 * 19 * 18 // 2 == 21736


def test_staircase_for_mixed_windows_adds_each_layers_window_minus_one() -> None:
    # read by layer i: 1 + sum_{j >= i} (W_j - 1):  1 + 1 = 2, 2 + 7 = 9, 9 + 3 = 12
    assert staircase_for((4, 8, 2)) == (12, 9, 2)
    assert staircase_for((8,) * 8) == staircase(8, 8)
    assert staircase_for((1, 1, 1)) == (1, 1, 1)  # window 1 reads only itself


def test_v41_decoder_tail_is_2414_rows_under_a_full_encoder() -> None:
    plan = replay_rows(V41, "exact", 8192, first_layer=21)
    assert plan.layer_rows[:21] == (8192,) * 21  # the encoder runs every row of a prefill
    assert plan.layer_rows[21:] == staircase(19, 128)
    assert plan.layer_rows[21] == 2414 and plan.layer_rows[39] == 128


def test_v41_whole_stack_from_tokens_is_5081_rows_at_any_parity() -> None:
    for t in (8192, 8193):
        plan = replay_rows(V41, "exact", t, published_tokens=t // 2 * 2)
        assert plan.layer_rows == staircase(40, 128) and plan.token_rows == 5081


# ----- replay_rows: the table --------------------------------------------------------------

ROW_CASES: list[tuple[str, ReplayGeometry, str, int, dict[str, int], tuple[int, ...]]] = [
    # name, geometry, mode, T, kwargs, expected rows per layer
    ("exact T=100 P=100", MINI, "exact", 100, {"published_tokens": 100}, MINI_STAIRCASE),
    ("exact T=101 P=100 (odd T)", MINI, "exact", 101, {"published_tokens": 100}, MINI_STAIRCASE),
    ("exact T=58 P=58 (odd start row 1 is fine)", MINI, "exact", 58, {"published_tokens": 58},
     MINI_STAIRCASE),
    ("exact T=45 P=44 (clamped to T)", MINI, "exact", 45, {"published_tokens": 44}, (45, 45, 43, 36, 29, 22, 15, 8)),
    ("exact T=1 P=0", MINI, "exact", 1, {"published_tokens": 0}, (1,) * 8),
    ("exact T=100 P=20: publishers cover [20, 100) with a W-1 lead-in", MINI, "exact", 100,
     {"published_tokens": 20},
     (100, 100, 94, 87, 80, 22, 15, 8)),
    ("bounded T=100 P=100: R = W", MINI, "bounded", 100, {"published_tokens": 100}, (8,) * 8),
    ("bounded T=101 P=100: R = W", MINI, "bounded", 101, {"published_tokens": 100}, (8,) * 8),
    ("bounded T=100 P=60", MINI, "bounded", 100, {"published_tokens": 60}, (40,) * 5 + (8,) * 3),
    ("bounded T=100 P=61", MINI, "bounded", 100, {"published_tokens": 61},
     (39,) * 5 + (8,) * 3),
    ("bounded T=100 slack=8: R = 2W", MINI, "bounded", 100, {"published_tokens": 100, "slack": 8}, (16,) * 8),
    ("bounded T=100 slack=3", MINI, "bounded", 100, {"published_tokens": 100, "slack": 3}, (11,) * 8),
    ("bounded T=100 bounded_rows=5", MINI, "bounded", 100, {"published_tokens": 100, "bounded_rows": 5},
     (5,) * 8),
    ("bounded T=5 P=4 (clamped)", MINI, "bounded", 5, {"published_tokens": 4}, (5,) * 8),
    ("bounded T=101, nothing to publish", MINI, "bounded", 101, {}, (8,) * 8),
    ("off T=100", MINI, "off", 100, {"published_tokens": 100}, (100,) * 8),
    ("prefill tail: exact from the decoder", MINI, "exact", 100, {"first_layer": 5}, (100,) * 5 + (22, 15, 8)),
    ("prefill chunk of 10 rows", MINI, "exact", 100, {"first_layer": 5, "num_rows": 10}, (10,) * 7 + (8,)),
    ("V4.1 bounded with speculative slack: 133", V41, "bounded", 8192, {"published_tokens": 8192, "slack": 5},
     (133,) * 40),
]


@pytest.mark.parametrize(("geometry", "mode", "num_tokens", "kwargs", "expected"),
                         [c[1:] for c in ROW_CASES], ids=[c[0] for c in ROW_CASES])
def test_replay_rows_table(geometry: ReplayGeometry, mode: str, num_tokens: int, kwargs: dict[str, int],
                           expected: tuple[int, ...]) -> None:
    plan = replay_rows(geometry, mode, num_tokens, **kwargs)  # type: ignore[arg-type]
    assert plan.layer_rows == expected
    assert plan.logit_rows == 1


@pytest.mark.parametrize("mode", ["exact", "bounded"])
def test_every_replay_plan_covers_the_unpublished_tokens(mode: str) -> None:
    """Over every (T, P) up to 80: the rules of ENGINE.md §4, for each layer l.

    - non-increasing rows, never more than T;
    - l <= last publisher: rows[l] >= T - P (the layer publishes every entry P did not cover;
      nothing below P is published again, since the engine publishes only tokens past P);
    - exact: rows[l] == min(T, X[l]), X[l] being the trailing rows whose input to layer l must
      be exact: X[7] = W (the last token), X[l] = max(X[l + 1] + W - 1, T - P if l <= 4);
    - bounded: rows above the publishers are exactly min(W, T), and the publishers read
      exactly min(T, max(W, T - P)).
    """
    for t in range(1, 81):
        for p in range(0, t + 1):
            rows = replay_rows(MINI, mode, t, published_tokens=p).layer_rows  # type: ignore[arg-type]
            assert all(a >= b for a, b in zip(rows, rows[1:])) and rows[0] <= t, (t, p, rows)
            assert all(rows[layer] >= t - p for layer in range(5)), (t, p, rows)
            if mode == "exact":
                need = [0] * 8
                for layer in reversed(range(8)):
                    need[layer] = max(need[layer + 1] + 7 if layer < 7 else 8, t - p if layer <= 4 else 0)
                    need[layer] = min(t, need[layer])
                assert list(rows) == need, (t, p, rows, need)
            else:
                assert rows[5:] == (min(8, t),) * 3, (t, p, rows)
                assert rows[:5] == (min(t, max(8, t - p)),) * 5, (t, p, rows)


# ----- plan_replay --------------------------------------------------------------------------


def test_plan_replay_exact_prices_the_rows_it_runs() -> None:
    plan = plan_replay(MINI, COSTS, "exact", 100, 100)
    assert plan == ReplayPlan("exact", 100, 100, RowPlan(MINI_STAIRCASE), 204, 204 * 1e-4)
    # outputs: rows read by the next layer, then one logit row: 50+43+36+29+22+15+8+1
    assert plan.replay_tokens == 57
    assert plan.to_dict() == {
        "mode": "exact", "num_tokens": 100, "persisted_tokens": 100, "replay_tokens": 57, "row_layers": 204,
        "layer_rows": list(MINI_STAIRCASE), "est_seconds": 204 * 1e-4,
    }


def test_plan_replay_bounded_is_w_plus_slack_and_off_is_a_reprefill() -> None:
    bounded = plan_replay(MINI, COSTS, "bounded", 101, 100)
    assert bounded.rows == RowPlan((8,) * 8)
    assert (bounded.persisted_tokens, bounded.replay_tokens, bounded.row_layers) == (100, 8, 8 * 7 + 1)
    assert plan_replay(MINI, COSTS, "bounded", 100, 100, slack=8).rows == RowPlan((16,) * 8)
    off = plan_replay(MINI, COSTS, "off", 100, 100)
    assert off == ReplayPlan("off", 100, 0, None, 800, 100 * 1e-3)  # nothing loaded, T x L rows
    assert off.replay_tokens == 100 and off.to_dict()["layer_rows"] is None


def test_plan_replay_is_pure() -> None:
    a = plan_replay(V41, COSTS, "exact", 4097, 4096)
    b = plan_replay(V41, COSTS, "exact", 4097, 4096)
    assert a == b and hash(a) == hash(b) and a is not b


def test_bounded_is_cheaper_than_exact_which_is_cheaper_than_off_on_v41() -> None:
    t = 32768
    costs = {m: plan_replay(V41, COSTS, m, t, t).row_layers for m in ("bounded", "exact", "off")}
    assert costs["bounded"] < costs["exact"] < costs["off"]
    assert costs["off"] == t * 40


# ----- bad inputs -----------------------------------------------------------------------------

ERROR_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("plan mode", lambda: plan_replay(MINI, COSTS, "fast", 10, 10),  # type: ignore[arg-type]
     "replay mode must be one of exact, bounded, off, got 'fast'"),
    ("plan empty", lambda: plan_replay(MINI, COSTS, "exact", 0, 0),
     "a session needs at least one token to resume, got 0"),
    ("plan persisted > T", lambda: plan_replay(MINI, COSTS, "exact", 100, 101),
     "persisted_tokens must lie in [0, 100], got 101"),
    ("plan persisted < 0", lambda: plan_replay(MINI, COSTS, "bounded", 100, -1),
     "persisted_tokens must lie in [0, 100], got -1"),
    ("plan slack", lambda: plan_replay(MINI, COSTS, "bounded", 100, 100, slack=-1), "slack must be >= 0, got -1"),
    ("rows mode", lambda: replay_rows(MINI, "all", 10),  # type: ignore[arg-type]
     "replay mode must be one of ('exact', 'bounded', 'off'), got 'all'"),
    ("rows num_rows 0", lambda: replay_rows(MINI, "exact", 100, num_rows=0),
     "num_rows must lie in [1, num_tokens=100], got 0"),
    ("rows num_rows > T", lambda: replay_rows(MINI, "exact", 100, num_rows=101),
     "num_rows must lie in [1, num_tokens=100], got 101"),
    ("rows first_layer", lambda: replay_rows(MINI, "exact", 100, first_layer=8),
     "first_layer must lie in [0, 8), got 8"),
    ("rows bounded_rows", lambda: replay_rows(MINI, "bounded", 100, bounded_rows=0),
     "bounded_rows must be >= 1, got 0"),
    ("RowPlan empty", lambda: RowPlan(()), "RowPlan: every layer must read at least one row, got []"),
    ("RowPlan zero", lambda: RowPlan((3, 0)), "RowPlan: every layer must read at least one row, got [3, 0]"),
    ("RowPlan increasing", lambda: RowPlan((3, 5)),
     "RowPlan: layer_rows must be non-increasing (a layer reads only rows the layer below produced), got [3, 5]"),
    ("RowPlan logits", lambda: RowPlan((5, 3), logit_rows=4), "RowPlan: logit_rows must lie in [1, 3], got 4"),
    ("geometry lengths", lambda: ReplayGeometry(windows=(8, 8), group_tokens=(0,)),
     "ReplayGeometry: windows and group_tokens need one entry per layer"),
    ("geometry window", lambda: ReplayGeometry(windows=(8, 0), group_tokens=(0, 0)),
     "ReplayGeometry: windows must be >= 1 and group sizes >= 0"),
    ("geometry publisher", lambda: ReplayGeometry(windows=(8,) * 8, group_tokens=(0,) * 8, last_publisher=8),
     "ReplayGeometry: last_publisher=8 outside [0, 8)"),
    ("geometry decoder", lambda: ReplayGeometry(windows=(8,) * 8, group_tokens=(0,) * 8, first_decoder_layer=-1),
     "ReplayGeometry: first_decoder_layer=-1 outside [0, 8)"),
]


@pytest.mark.parametrize(("make", "message"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_bad_inputs_raise_value_errors_that_say_what_is_wrong(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


def test_row_plan_counts() -> None:
    plan = RowPlan((9, 9, 8), logit_rows=2)
    assert (plan.token_rows, plan.output_rows(0), plan.output_rows(1), plan.output_rows(2)) == (9, 9, 8, 2)
    assert plan.row_layers == 9 + 8 + 2
    assert RowPlan.full(4, 30) == RowPlan((30, 30, 30, 30), 1)
