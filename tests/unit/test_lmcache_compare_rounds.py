"""bench.lmcache_compare's bookkeeping of rounds: medians per path and ratios per round (the
measuring itself needs LMCache and runs in `make bench-lmcache`), and its durable plain-file
reference, which needs no LMCache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.lmcache_compare import NUMERIC, median_rows, round_ratios, run_durable_plain


def row(path: str, rnd: int, put: float, get: float, *, exact: bool = True, model: str = "m") -> dict[str, Any]:
    out: dict[str, Any] = {col: 1.0 for col in NUMERIC}
    out.update(model=model, path=path, round=rnd, put_GBps=put, get_GBps=get, bit_exact=exact, durable="x")
    return out


def test_median_rows_take_each_figure_over_the_rounds() -> None:
    rows = [row("a", 0, 1.0, 4.0), row("a", 1, 3.0, 2.0), row("a", 2, 2.0, 9.0, exact=False), row("b", 0, 5.0, 5.0)]
    by_path = {r["path"]: r for r in median_rows(rows)}
    assert by_path["a"]["put_GBps"] == 2.0 and by_path["a"]["get_GBps"] == 4.0
    assert by_path["a"]["rounds"] == 3 and by_path["a"]["round"] == "median"
    assert by_path["a"]["bit_exact"] is False  # one inexact round makes the path inexact
    assert by_path["b"]["put_GBps"] == 5.0 and by_path["b"]["bit_exact"] is True


def test_round_ratios_pair_the_sides_round_by_round() -> None:
    rows = [row("ours", 0, 2.0, 1.0), row("theirs", 0, 1.0, 4.0),
            row("ours", 1, 3.0, 1.0), row("theirs", 1, 6.0, 1.0),
            row("ours", 2, 9.0, 9.0),  # no counterpart in round 2: not a ratio
            row("theirs", 0, 100.0, 100.0, model="other")]  # another model's row is not paired
    assert round_ratios(rows, "m", "ours", "theirs", "put") == [2.0, 0.5]
    assert round_ratios(rows, "m", "ours", "theirs", "get") == [0.25, 1.0]


def test_request_figures_are_medians_only_where_every_round_has_them() -> None:
    rows = [{**row("a", 0, 1.0, 1.0), "req_put_GBps": 2.0, "req_get_GBps": 8.0},
            {**row("a", 1, 1.0, 1.0), "req_put_GBps": 4.0, "req_get_GBps": 6.0},
            {**row("a", 2, 1.0, 1.0), "req_put_GBps": 9.0, "req_get_GBps": 1.0},
            {**row("b", 0, 1.0, 1.0), "req_put_GBps": 3.0}, row("b", 1, 1.0, 1.0)]  # b's second round has none
    by_path = {r["path"]: r for r in median_rows(rows)}
    assert by_path["a"]["req_put_GBps"] == 4.0 and by_path["a"]["req_get_GBps"] == 6.0
    assert "req_put_GBps" not in by_path["b"] and "req_get_GBps" not in by_path["b"]
    assert round_ratios(rows, "m", "a", "b", "req_put") == [2.0 / 3.0]  # round 1: b has no request figure


def test_restart_found_is_the_fewest_any_round_found() -> None:
    rows = [{**row("a", 0, 1.0, 1.0), "restart_found": 16}, {**row("a", 1, 1.0, 1.0), "restart_found": 0},
            {**row("b", 0, 1.0, 1.0), "restart_found": None}]
    by_path = {r["path"]: r for r in median_rows(rows)}
    assert by_path["a"]["restart_found"] == 0 and by_path["b"]["restart_found"] is None


def test_misses_are_counted_over_the_rounds_apart_from_wrong_bytes() -> None:
    rows = [{**row("a", 0, 1.0, 1.0), "misses": 2}, {**row("a", 1, 1.0, 1.0), "misses": 1}]
    (merged,) = median_rows(rows)
    assert merged["misses"] == 3 and merged["bit_exact"] is True


def test_the_durable_plain_reference_writes_flushes_and_reads_back_the_chunks(tmp_path: Path) -> None:
    """`ref: odirect+fdatasync` (plain O_DIRECT files, flushed): every chunk read back equal, its
    files removed after, its row marked durable (it needs no LMCache: real files here)."""
    row_ = run_durable_plain("v41-like", 2, tmp_path)
    assert row_["path"] == "ref: odirect+fdatasync" and row_["durable"] == "fdatasync"
    assert row_["bit_exact"] and row_["chunks"] == 2 and row_["put_GBps"] > 0 and row_["get_GBps"] > 0
    assert not any(tmp_path.iterdir())
