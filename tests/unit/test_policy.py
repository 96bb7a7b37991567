"""Policies on hand-built StateMeta; the invoker's validation, fallbacks and warnings."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import pytest

from engine_adapter.base import Retention
from statestore.policy import (
    LRUPolicy,
    PlacementPolicy,
    _PolicyInvoker,
    eviction_block_reason,
    may_evict,
    required_tier,
)
from statestore.types import Durability, StateMeta, TierCost, TierName
from tiers.record import RecordKey

HOST, SSD, REDIS = TierName.HOST, TierName.SSD, TierName.REDIS
HOST_COST = TierCost(HOST, 5e-6, 1e10, budget_bytes=1000, resident_bytes=900)
SSD_COST = TierCost(SSD, 1e-4, 2e9, budget_bytes=1000, resident_bytes=900)
TIERS = {HOST: HOST_COST, SSD: SSD_COST, REDIS: TierCost(REDIS, 5e-4, 1e9)}


def key(i: int) -> RecordKey:
    return RecordKey(b"\x00\x01" + bytes([i]) * 32)


def meta(i: int, last_access: float, size: int = 100, *, tiers: Sequence[TierName] = (HOST,),
         durability: Durability = Durability.MEMORY, pinned: bool = False, acked: bool = True) -> StateMeta:
    m = StateMeta(key(i), 1, size, Retention.MUST_KEEP, durability=durability, acked=acked, pinned=pinned,
                  last_access=last_access)
    for t in tiers:
        m = m.with_copy(t, size)
    return m


@pytest.fixture
def policy_caplog(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="statestore.policy")
    return caplog


# ----- LRU -----------------------------------------------------------------------------------

def test_lru_evicts_least_recently_used_first() -> None:
    lru = LRUPolicy()
    cands = [meta(1, 30.0), meta(2, 10.0), meta(3, 20.0), meta(4, 40.0)]
    assert lru.decide_eviction(cands, 150, HOST_COST) == [key(2), key(3)]
    assert lru.decide_eviction(cands, 1, HOST_COST) == [key(2)]
    assert lru.decide_eviction(cands, 0, HOST_COST) == []
    assert lru.decide_eviction(cands, 10_000, HOST_COST) == [key(2), key(3), key(1), key(4)]
    assert [lru.eviction_score(m, HOST_COST) for m in cands] == [30.0, 10.0, 20.0, 40.0]


def test_lru_ties_keep_queue_order() -> None:
    cands = [meta(5, 1.0), meta(6, 1.0), meta(7, 1.0)]
    assert LRUPolicy().decide_eviction(cands, 200, HOST_COST) == [key(5), key(6)]


def test_lru_counts_the_bytes_in_the_tier_evicted_from() -> None:
    small_on_ssd = meta(1, 1.0).with_copy(SSD, 10)
    assert LRUPolicy().decide_eviction([small_on_ssd, meta(2, 2.0, tiers=(SSD,))], 50, SSD_COST) == [key(1), key(2)]


def test_lru_put_caches_in_host_and_reaches_the_durable_tier() -> None:
    lru = LRUPolicy()
    assert lru.decide_put(meta(1, 0.0, durability=Durability.MEMORY), TIERS) == {HOST}
    assert lru.decide_put(meta(1, 0.0, durability=Durability.LOCAL), TIERS) == {HOST, SSD}
    assert lru.decide_put(meta(1, 0.0, durability=Durability.SHARED), TIERS) == {HOST, REDIS}
    assert lru.decide_put(meta(1, 0.0), {SSD: SSD_COST}) == {SSD}  # no host: the fastest tier


def test_required_tier() -> None:
    assert required_tier(Durability.MEMORY, [SSD, HOST]) is HOST
    assert required_tier(Durability.MEMORY, [REDIS, SSD]) is SSD
    assert required_tier(Durability.LOCAL, [HOST]) is None
    assert required_tier(Durability.SHARED, [HOST, REDIS]) is REDIS


def test_default_promotion_is_into_host() -> None:
    lru = LRUPolicy()
    assert lru.decide_promote(meta(1, 0.0), SSD, TIERS) == {HOST}
    assert lru.decide_promote(meta(1, 0.0), HOST, TIERS) == frozenset()


# ----- protection rules ----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("m", "tier", "reason"),
    [
        (meta(1, 0, pinned=True), HOST, "pinned"),
        (meta(1, 0, acked=False), HOST, "not yet acknowledged"),
        (meta(1, 0, tiers=(HOST, SSD), durability=Durability.LOCAL), SSD, "the only LOCAL copy"),
        (meta(1, 0, tiers=(HOST, REDIS), durability=Durability.SHARED), REDIS, "the only SHARED copy"),
        (meta(1, 0, tiers=(HOST, SSD), durability=Durability.LOCAL), HOST, None),  # host copy is a cache
        (meta(1, 0, tiers=(SSD, REDIS), durability=Durability.LOCAL), SSD, None),  # Redis keeps it durable
        (meta(1, 0, tiers=(SSD,), durability=Durability.MEMORY), SSD, None),  # MEMORY data is a cache
    ],
)
def test_eviction_block_reason(m: StateMeta, tier: TierName, reason: str | None) -> None:
    assert eviction_block_reason(m, tier) == reason
    assert may_evict(m, tier) is (reason is None)  # the store's check, without the message


# ----- the invoker ---------------------------------------------------------------------------

class RoguePolicy(LRUPolicy):
    """Evicts exactly the keys it was told to, whatever the candidates."""

    name = "rogue"

    def __init__(self, victims: list[RecordKey]) -> None:
        self.victims = victims

    def decide_eviction(self, candidates: Sequence[StateMeta], need_bytes: int, tier: TierCost) -> list[RecordKey]:
        return list(self.victims)


CANDIDATES = [
    meta(1, 10.0, pinned=True),
    meta(2, 20.0, acked=False),
    meta(3, 30.0, tiers=(SSD,), durability=Durability.LOCAL),
    meta(4, 40.0, tiers=(SSD,)),
    meta(5, 50.0, tiers=(SSD,)),
    meta(6, 60.0, tiers=(SSD,)),
]


@pytest.mark.parametrize(
    ("victim", "why"),
    [(1, "it is pinned"), (2, "it is not yet acknowledged"), (3, "it is the only LOCAL copy")],
)
def test_invoker_rejects_evicting_protected_data_and_falls_back_to_lru(
        victim: int, why: str, policy_caplog: pytest.LogCaptureFixture) -> None:
    invoker = _PolicyInvoker(RoguePolicy([key(victim), key(5)]))
    tier = SSD_COST
    cands = [m if m.tiers >= {SSD} else m.with_copy(SSD, 100) for m in CANDIDATES]
    chosen = invoker.decide_eviction(cands, 150, tier)
    assert chosen == [key(4), key(5)]  # LRU over the evictable ones only
    [rec] = policy_caplog.records
    assert rec.levelno == logging.WARNING
    assert f"policy rogue: decide_eviction tried to evict {key(victim).hex()} from ssd: {why}" in rec.getMessage()
    assert "falling back to LRU" in rec.getMessage()


def test_invoker_rejects_unknown_keys_and_short_choices(policy_caplog: pytest.LogCaptureFixture) -> None:
    cands = [meta(4, 40.0), meta(5, 50.0)]
    assert _PolicyInvoker(RoguePolicy([key(9)])).decide_eviction(cands, 100, HOST_COST) == [key(4)]
    assert _PolicyInvoker(RoguePolicy([key(5)])).decide_eviction(cands, 150, HOST_COST) == [key(4), key(5)]
    assert _PolicyInvoker(RoguePolicy([key(5)])).decide_eviction(cands, 100, HOST_COST) == [key(5)]  # valid choice
    messages = [r.getMessage() for r in policy_caplog.records]
    assert len(messages) == 2
    assert "which is not a candidate" in messages[0]
    assert "frees 100 B of the 150 B needed" in messages[1]


class RaisingPolicy(PlacementPolicy):
    name = "raising"

    def decide_put(self, meta: StateMeta, tiers: Mapping[TierName, TierCost]) -> frozenset[TierName]:
        raise RuntimeError("boom-put")

    def eviction_score(self, meta: StateMeta, tier: TierCost) -> float:
        raise RuntimeError("boom-score")

    def decide_eviction(self, candidates: Sequence[StateMeta], need_bytes: int, tier: TierCost) -> list[RecordKey]:
        raise RuntimeError("boom-evict")

    def on_access(self, meta: StateMeta, tier: TierName) -> None:
        raise RuntimeError("boom-hook")


def test_invoker_catches_policy_exceptions(policy_caplog: pytest.LogCaptureFixture) -> None:
    invoker = _PolicyInvoker(RaisingPolicy())
    m = meta(1, 7.0, durability=Durability.LOCAL)
    assert invoker.decide_put(m, TIERS) == {HOST, SSD}
    assert invoker.eviction_score(m, HOST_COST) == 7.0
    assert invoker.decide_eviction([meta(2, 2.0), meta(3, 1.0)], 100, HOST_COST) == [key(3)]
    invoker.on_access(m, HOST)  # swallowed
    records = policy_caplog.records
    assert [r.getMessage().split(":")[0] for r in records] == ["policy raising"] * 4
    assert all(r.exc_info is not None for r in records)
    assert [str(r.exc_info[1]) for r in records] == ["boom-put", "boom-score", "boom-evict", "boom-hook"]


class BadDecisions(LRUPolicy):
    name = "bad"

    def decide_put(self, meta: StateMeta, tiers: Mapping[TierName, TierCost]) -> frozenset[TierName]:
        return frozenset({HOST})  # drops the durable tier

    def eviction_score(self, meta: StateMeta, tier: TierCost) -> float:
        return float("nan")

    def decide_promote(self, meta: StateMeta, source: TierName,
                       tiers: Mapping[TierName, TierCost]) -> frozenset[TierName]:
        return frozenset({REDIS})  # slower than the source


def test_invoker_validates_placements_and_scores(policy_caplog: pytest.LogCaptureFixture) -> None:
    invoker = _PolicyInvoker(BadDecisions())
    m = meta(1, 3.0, durability=Durability.LOCAL)
    assert invoker.decide_put(m, TIERS) == {HOST, SSD}
    assert invoker.eviction_score(m, HOST_COST) == 3.0
    assert invoker.decide_promote(m, SSD, TIERS) == {HOST}
    messages = [r.getMessage() for r in policy_caplog.records]
    assert "omits ssd, which LOCAL durability requires" in messages[0]
    assert "returned nan, not a finite number" in messages[1]
    assert "is not faster than ssd" in messages[2]


def test_valid_decisions_pass_without_warnings(policy_caplog: pytest.LogCaptureFixture) -> None:
    invoker = _PolicyInvoker(LRUPolicy())
    assert invoker.decide_put(meta(1, 0.0, durability=Durability.SHARED), TIERS) == {HOST, REDIS}
    assert invoker.decide_eviction([meta(2, 2.0), meta(3, 1.0)], 150, HOST_COST) == [key(3), key(2)]
    assert policy_caplog.records == []
