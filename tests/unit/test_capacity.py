"""Capacity in a 64 GiB budget: per-kind pools reach the byte-arithmetic bound, one page size does not.

The allocators run for real (accounting-only pools: no memory is touched); `bench/capacity.py`
prints the same table and writes bench/results/capacity.json.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench import capacity
from bench.common import print_table

BUDGET = 64 << 30
SHAPES = ("v41-fp4", "hybrid-bf16", "hybrid-fp8")


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    out = capacity.capacity_rows(BUDGET)
    print()
    print_table(out, ["shape", "context", "bytes_per_seq", "bound", "ours", "ours_over_bound",
                      "single_page", "single_over_bound"])
    return out


def row(rows: list[dict[str, Any]], shape: str, context: int) -> dict[str, Any]:
    return next(r for r in rows if r["shape"] == shape and r["context"] == context)


def test_spec_arithmetic() -> None:
    v41 = capacity.v41_shape()
    assert v41.exact_bytes(1) == 890 + 2_703_360  # 2.5 x (288 + 68) B/token + the SWA rings
    assert v41.exact_bytes(1024) == 890 * 1024 + 2_703_360
    assert capacity.hybrid_shape(2).exact_bytes(0) == 36 * (32 * 128 * 128 + 3 * 8192) * 2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("context", capacity.CONTEXTS, ids=lambda t: f"{t // 1024}K")
def test_per_kind_pools_reach_the_byte_bound(rows: list[dict[str, Any]], shape: str, context: int) -> None:
    r = row(rows, shape, context)
    assert r["ours"] <= r["bound"]  # the bound is a bound: the accounting hides no bytes
    assert r["ours_over_bound"] >= capacity.FLOOR_OURS_OVER_BOUND, r
    assert r["ours"] >= r["single_page"]


def test_single_page_allocator_falls_short(rows: list[dict[str, Any]]) -> None:
    short = [(r["shape"], r["context"]) for r in rows
             if r["shape"] in SHAPES and r["single_over_bound"] < capacity.FLOOR_OURS_OVER_BOUND]
    # Every short context of every shape that has per-sequence state, and more.
    for shape in SHAPES:
        assert (shape, 1024) in short and (shape, 4096) in short
    assert row(rows, "v41-fp4", 1024)["single_over_bound"] < 0.5


def test_fp8_gain_on_the_hybrid_matches_rfc_55196_for_one_page_and_the_bound_for_ours(
        rows: list[dict[str, Any]]) -> None:
    gains = {(g["shape"], g["context"]): g for g in capacity.gain_rows(rows)}
    print_table(list(gains.values()))
    # vLLM's uniform page reproduces the RFC's measurements ...
    assert gains[("hybrid", 32 << 10)]["single_page_gain"] == pytest.approx(1.84, abs=0.01)
    assert gains[("hybrid", 1 << 10)]["single_page_gain"] == pytest.approx(1.00, abs=0.01)
    assert gains[("attn-only", 32 << 10)]["single_page_gain"] == pytest.approx(2.00, abs=0.01)
    # ... while ours delivers what the byte arithmetic promises, at every length.
    for (shape, context), g in gains.items():
        assert g["ours_gain"] == pytest.approx(g["bound_gain"], rel=0.03), (shape, context)
    assert gains[("hybrid", 1 << 10)]["ours_gain"] > 1.2
