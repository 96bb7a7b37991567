"""The trace simulator's accounting: virtual tiers, V4.1 byte totals of the trace, a short run."""

from __future__ import annotations

import asyncio

import pytest

from bench.trace import (
    GLOBAL,
    BREAKDOWN,
    GIB,
    HINDSIGHT,
    HindsightReuse,
    FP8_BYTES_PER_TOKEN,
    OUR_BYTES_PER_TOKEN,
    Request,
    Simulator,
    budget_for_share,
    default_trace_path,
    hindsight_odds,
    load_trace,
    unique_block_bytes,
)
from statestore.profile import CostProfile
from statestore.reuse import NO_CONTEXT, ReuseConfig, chain_context, describe_context, with_outcome
from tiers.record import HEADER_SIZE, make_record, make_record_key
from tiers.virtual import AccountingHostTier, VirtualTier


def rec(i: int, size: int):  # type: ignore[no-untyped-def]
    return make_record(1, 0, bytes(size), model_fingerprint=b"f" * 16, tenant_id=b"t" * 16, block_key=bytes([i]) * 32)


async def test_virtual_tier_sizes_without_storing() -> None:
    t = VirtualTier("ssd", budget_bytes=3 * 8192 + 3 * 128)
    assert t.footprint(rec(1, 5000)) == 8192 + 128  # header + payload rounded to 4 KiB, plus an index entry
    assert await t.put(rec(1, 5000)) and await t.put(rec(2, 5000)) and await t.put(rec(3, 5000))
    assert not await t.put(rec(4, 5000))  # over budget: refused, nothing changed
    assert t.usage().resident_bytes == 3 * (8192 + 128) and t.usage().num_records == 3
    got = await t.get(rec(2, 5000).key)
    assert got is not None and got.payload == bytes(5000)
    assert await t.delete(rec(2, 5000).key) and t.usage().num_records == 2
    assert t.bytes_written == 3 * (HEADER_SIZE + 5000) and t.num_puts == 3


async def test_accounting_host_tier_uses_the_page_pools_without_memory() -> None:
    t = AccountingHostTier(1 << 20, {1: 4096}, slab_bytes=4096)
    assert await t.put(rec(1, 4000))
    assert t.usage().resident_bytes == t.footprint(rec(1, 4000))
    got = await t.get(rec(1, 4000).key)
    assert got is not None and len(got.payload) == 4000


def test_budget_for_share_interpolates_in_log_budget() -> None:
    pts = [(1.0, 0.2), (2.0, 0.4), (4.0, 0.6)]
    assert budget_for_share(pts, 0.2) == 1.0
    assert budget_for_share(pts, 0.5) == pytest.approx(2 ** 1.5)
    assert budget_for_share(pts, 0.7) == float("inf")


def test_trace_unique_blocks_take_18_6_gib_ours_and_34_6_gib_fp8() -> None:
    path = default_trace_path()  # ../shared/data, else the copy in bench/data: always there
    assert path.exists(), path
    reqs = load_trace(path)
    assert unique_block_bytes(reqs, OUR_BYTES_PER_TOKEN) / GIB == pytest.approx(18.6, abs=0.05)
    assert unique_block_bytes(reqs, FP8_BYTES_PER_TOKEN) / GIB == pytest.approx(34.6, abs=0.05)


def test_a_short_run_goes_through_the_store_and_never_beats_physics() -> None:
    reqs = [Request(0.0, 1500, 1, (1, 2, 3)), Request(1.0, 1100, 1, (1, 2, 4)), Request(2.0, 1500, 1, (1, 2, 3)),
            Request(3.0, 600, 1, (9, 10))]
    sim = Simulator(reqs, CostProfile.v41_h200())
    recompute = sim.recompute(1.0, 0.0)
    for name in ("lru-ours", "cost", "lru-all"):
        r = asyncio.run(sim.run(name, 1.0, 0.0))
        assert r.blocks == 11 and all(t <= full + 1e-12 for t, full in zip(r.ttft_s, recompute.ttft_s))
        # Request 2 re-reads blocks 1, 2 and request 3 re-reads 1, 2, 3: 5 hits in all.
        assert sum(r.hits.values()) == 5, name
    ours = asyncio.run(sim.run("lru-ours", 1.0, 0.0))
    assert ours.ttft_s[3] == pytest.approx(recompute.ttft_s[3])  # a cold request pays the full prefill
    assert ours.row()["gpu_s_saved"] > 0


def test_the_ttft_breakdown_adds_up_and_books_each_part_where_it_belongs() -> None:
    # Request 1 re-reads 1, 2 (a new tail 4); request 2 repeats request 0's chain exactly;
    # request 3 is cold.
    reqs = [Request(0.0, 1500, 1, (1, 2, 3)), Request(1.0, 1100, 1, (1, 2, 4)), Request(2.0, 1500, 1, (1, 2, 3)),
            Request(3.0, 600, 1, (9, 10))]
    sim = Simulator(reqs, CostProfile.v41_h200())
    recompute = sim.recompute(1.0, 0.0)
    for r in (recompute, *(asyncio.run(sim.run(name, 1.0, 0.0)) for name in ("lru-ours", "cost", "lru-all"))):
        row = r.row()
        assert sum(row[f"ttft_{name}_s"] for name in BREAKDOWN if name != "repeat_tail") == pytest.approx(
            row["ttft_mean_s"]), r.policy
        first = sum(sim.block_compute_s(reqs[i], j) for i, j in ((0, 0), (0, 1), (0, 2), (1, 2), (3, 0), (3, 1)))
        if r is not recompute:  # request 1's new tail 4 follows two hits: its run pays the lead-in (a prefill does not)
            first += sim.lead_in_s(2)
        assert row["ttft_first_read_s"] == pytest.approx(first / 4), r.policy
        assert not hasattr(r, "read_ids")  # run bookkeeping (`Breakdown`), not part of the result
    # Always-recompute rebuilds the 5 re-read blocks and pays every tail; request 2's is a repeat.
    reread = sum(sim.block_compute_s(reqs[i], j) for i, j in ((1, 0), (1, 1), (2, 0), (2, 1), (2, 2)))
    assert recompute.row()["ttft_reuse_miss_s"] == pytest.approx(reread / 4)
    assert recompute.seconds["repeat_tail"] == pytest.approx(sim.tail_s(reqs[2]))
    ours = asyncio.run(sim.run("lru-ours", 1.0, 0.0))  # 1 GiB holds everything: no reuse misses, no lead-ins
    assert ours.seconds["reuse_miss"] == ours.seconds["lead_in"] == 0.0 < ours.seconds["load"]
    assert ours.seconds["tail"] == pytest.approx(sum(sim.tail_s(r) for r in reqs))


def test_hindsight_odds_count_each_read_that_is_not_its_blocks_last_in_the_policys_cells() -> None:
    reqs = [Request(0.0, 1500, 1, (1, 2, 3)), Request(10.0, 1500, 1, (1, 2, 4)), Request(20.0, 500, 1, (5,)),
            Request(30.0, 500, 400, (6,))]
    odds = hindsight_odds(reqs)

    def cell(length: int, position: int, extends: bool = False, generated: int = 1) -> int:
        return with_outcome(chain_context(length, position, extends), generated)

    # Request 0's blocks 1 and 2 are read again (request 1), its tail 3 is not; request 1 reads
    # 1, 2 a second time (their last reads) and appends 4 after a known prefix; 5 and 6 are
    # one-offs, 6 of a request that generated 400 tokens (another cell: the outcome refines it).
    assert odds[1, cell(3, 0)] == pytest.approx(1.5 / 2)
    assert odds[1, cell(3, 2)] == pytest.approx(0.5 / 3)  # the last of a 1-15 chain: 3's and 5's reads
    assert chain_context(3, 2) == chain_context(1, 0)
    assert odds[1, cell(1, 0, generated=400)] == pytest.approx(0.5 / 2)
    assert odds[1, cell(3, 2, True)] == pytest.approx(0.5 / 2)
    assert odds[2, cell(3, 0)] == pytest.approx(0.5 / 2)
    assert odds[1, NO_CONTEXT] == pytest.approx(2.5 / 7)  # 2 of the 6 first reads came back
    assert odds[2, NO_CONTEXT] == pytest.approx(0.5 / 3)
    est = HindsightReuse(ReuseConfig(), odds)
    assert est.p_next(b"t" * 16, 1, cell(3, 0)) == pytest.approx(0.75)
    assert est.p_next(b"t" * 16, 1, cell(200, 5)) == pytest.approx(2.5 / 7)  # unseen cell: count-only
    assert est.p_next(b"t" * 16, 9) == ReuseConfig().prior_p_next  # no 4th reads at all: the prior


def test_the_hindsight_run_is_the_cost_policy_with_those_odds() -> None:
    reqs = [Request(0.0, 1500, 1, (1, 2, 3)), Request(1.0, 1100, 1, (1, 2, 4)), Request(2.0, 1500, 1, (1, 2, 3))]
    r = asyncio.run(Simulator(reqs, CostProfile.v41_h200()).run(HINDSIGHT, 1.0, 0.0))
    assert isinstance(r.policy_obj.reuse, HindsightReuse) and r.policy_obj.name == "cost"  # type: ignore[union-attr]
    assert sum(r.hits.values()) == 5 and r.blocks == 9


def test_each_request_reports_its_generated_tokens_to_the_cost_policy() -> None:
    """The simulator tells the store when a request ends (`request_done`, at its modeled end:
    TTFT plus decode): the cost policy's learned context of each block's latest read carries
    that request's output length."""
    reqs = [Request(0.0, 1500, 3, (1, 2, 3)), Request(100.0, 1100, 700, (1, 2, 4))]
    sim = Simulator(reqs, CostProfile.v41_h200())
    r = asyncio.run(sim.run("cost", 1.0, 0.0))
    reuse = r.policy_obj.reuse  # type: ignore[union-attr]
    latest = {h: reuse.latest(make_record_key(GLOBAL, sim.block_key(req, i)))[2]
              for req in reqs for i, h in enumerate(req.hash_ids)}
    assert describe_context(latest[3]).endswith("the request generated 0-15 tokens")
    for h in (1, 2, 4):  # read last by the second request
        assert describe_context(latest[h]).endswith("the request generated 256-1023 tokens")
