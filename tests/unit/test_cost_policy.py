"""CostAwarePolicy decisions on hand-built StateMeta, the reuse estimator, explanations, and
the durability rule through a real store (host RAM + SSD files under tmp_path)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine_adapter.base import Retention, StateKind
from statestore.cost_policy import PINNED_SCORE, CostAwarePolicy, CostPolicyConfig
from statestore.policy import _PolicyInvoker
from statestore.profile import CostProfile, EngineProfile
from statestore.reuse import ReuseEstimator
from statestore.store import BudgetExceeded, StoreConfig, TieredStore
from statestore.types import Durability, PutHints, StateMeta, TierCost, TierName
from tiers.host import HostTier
from tiers.pools import record_overhead_bytes
from tiers.record import RecordKey, make_record

HOST, SSD = TierName.HOST, TierName.SSD
GLOBAL, RING = int(StateKind.GLOBAL_KV), int(StateKind.SWA_RING)
ALICE, BOB = b"a" * 16, b"b" * 16
SIZE = 10_000
HOST_COST = TierCost(HOST, 1e-5, 1e10, budget_bytes=100 * SIZE, resident_bytes=95 * SIZE)
SSD_COST = TierCost(SSD, 1e-4, 1e9, budget_bytes=1000 * SIZE, resident_bytes=100 * SIZE)
TIERS = {HOST: HOST_COST, SSD: SSD_COST}


def make_profile(encoder_s: float = 1e-3, replay_s: float = 1e-4, deep_factor: float = 4.0) -> CostProfile:
    """B = 16, lead-in 7, R = 8; encoder cost per token grows `deep_factor`x from context 16 to 1600."""
    engine = EngineProfile(model="test", device="cpu", measured=False, block_tokens=16, lead_in_tokens=7,
                           replay_tokens=8, prefill=((16, encoder_s), (1600, encoder_s * deep_factor)),
                           decode=((16, replay_s),), replay=((16, replay_s),),
                           encoder=((16, encoder_s), (1600, encoder_s * deep_factor)))
    return CostProfile(engine)


def key(i: int, kind: int = GLOBAL) -> RecordKey:
    return RecordKey(kind.to_bytes(2, "big") + bytes([i]) * 32)


def meta(i: int, *, kind: int = GLOBAL, retention: Retention = Retention.MUST_KEEP, start: int = 0, end: int = 16,
         last_access: float = 100.0, size: int = SIZE, tiers: tuple[TierName, ...] = (HOST,), tenant: bytes = ALICE,
         hints: PutHints | None = None, pinned: bool = False, durability: Durability = Durability.MEMORY) -> StateMeta:
    m = StateMeta(key(i, kind), kind, size, retention, durability=durability, acked=True, pinned=pinned,
                  last_access=last_access, hints=hints, tenant_id=tenant, token_start=start, token_end=end)
    for t in tiers:
        m = m.with_copy(t, size)
    return m


def policy(**kw: object) -> CostAwarePolicy:
    """A policy that has seen 100 s of puts (SIZE bytes a second into host and SSD): its host
    turns over in 100 s and its SSD in 1,000 s (budget / inflow)."""
    p = CostAwarePolicy(make_profile(**kw))  # type: ignore[arg-type]
    p.decide_put(meta(200, tiers=(), tenant=b"w" * 16), TIERS)
    for t in range(101):
        m = meta(201 + t % 50, tiers=(HOST, SSD), last_access=float(t), tenant=b"w" * 16)
        p.on_put(m, m.tiers)
    return p


# ----- costs ---------------------------------------------------------------------------------

def test_rebuild_prices_a_block_by_encoder_pass_plus_lead_in_and_a_ring_by_replay() -> None:
    p = policy(encoder_s=1e-3, replay_s=1e-4, deep_factor=1.0)
    assert p.rebuild_s(meta(1, start=0, end=16)) == pytest.approx(16 * 1e-3)  # no lead-in at position 0
    assert p.rebuild_s(meta(2, start=160, end=176)) == pytest.approx((16 + 7) * 1e-3)
    ring = meta(3, kind=RING, retention=Retention.REBUILDABLE, start=176, end=176)
    assert p.rebuild_s(ring) == pytest.approx(8 * 1e-4)  # R = 8 rows of replay


def test_cheap_to_rebuild_loses_to_expensive_at_equal_bytes() -> None:
    p = policy()
    cheap = meta(1, kind=RING, retention=Retention.REBUILDABLE, start=1600, end=1600)  # 8 replay rows
    early = meta(2, start=0, end=16)  # encoder pass over 16 tokens at context 16
    deep = meta(3, start=1584, end=1600)  # the same pass at context 1600 (4x per token) + lead-in
    for m in (cheap, early, deep):
        p.on_put(m, m.tiers)
    scores = [p.eviction_score(m, HOST_COST) for m in (cheap, early, deep)]
    assert scores[0] < scores[1] < scores[2]
    assert p.decide_eviction([deep, early, cheap], 1, HOST_COST) == [cheap.key]
    assert p.decide_eviction([deep, early, cheap], SIZE + 1, HOST_COST) == [cheap.key, early.key]


def test_equal_value_records_are_evicted_in_lru_order() -> None:
    p = policy()
    ms = [meta(i, last_access=t) for i, t in ((1, 30.0), (2, 10.0), (3, 20.0))]
    assert p.decide_eviction(ms, 2 * SIZE, HOST_COST) == [key(2), key(3)]


def test_pins_always_win() -> None:
    p = policy()
    pinned = meta(1, kind=RING, retention=Retention.REBUILDABLE, start=16, end=16, last_access=0.0, pinned=True,
                  hints=PutHints(ttl_s=1.0))
    expensive = meta(2, start=1584, end=1600, last_access=1e6)
    assert p.eviction_score(pinned, HOST_COST) == PINNED_SCORE > p.eviction_score(expensive, HOST_COST)
    # Through the invoker a pinned record is never a victim, whatever the need.
    assert _PolicyInvoker(p).decide_eviction([pinned, expensive], 10 * SIZE, HOST_COST) == [expensive.key]


def test_hints_keep_the_session_that_returns_in_10_s_over_the_one_that_returns_in_a_day() -> None:
    p = policy()
    soon = meta(1, hints=PutHints(expected_return_s=10.0))
    tomorrow = meta(2, hints=PutHints(expected_return_s=86_400.0))
    ph = p.price(soon, HOST_COST).p_reuse, p.price(tomorrow, HOST_COST).p_reuse
    assert ph[0] == pytest.approx(0.9) and ph[1] < 0.01
    assert p.decide_eviction([soon, tomorrow], 1, HOST_COST) == [tomorrow.key]
    # An expired ttl makes a record worthless: it goes first and is not admitted anywhere.
    expired = meta(3, start=1584, end=1600, hints=PutHints(ttl_s=5.0), last_access=100.0)
    assert p.p_reuse(expired, 60.0, idle_s=6.0)[0] == 0.0
    assert p.eviction_score(expired, HOST_COST) <= 105.0 < p.eviction_score(meta(4, last_access=100.0), HOST_COST)


def test_swa_ring_is_held_while_a_resume_is_likely_then_dropped_for_replay() -> None:
    p = policy()
    ring = meta(1, kind=RING, retention=Retention.REBUILDABLE, start=800, end=800,
                hints=PutHints(expected_return_s=60.0), tiers=())
    full_ssd = {HOST: HOST_COST, SSD: TierCost(SSD, 1e-4, 1e9, budget_bytes=1000 * SIZE, resident_bytes=950 * SIZE)}
    assert p.decide_put(ring, full_ssd) == {HOST}  # RAM covers the return: a full SSD gains nothing
    assert p.decide_put(ring, TIERS) == {HOST, SSD}  # an SSD with room takes any copy worth its write
    fresh = p.price(ring, HOST_COST, idle_s=0.0).value_s
    late = p.price(ring, HOST_COST, idle_s=3600.0).value_s
    assert fresh > 0 and late < fresh / 1000  # an hour late: replay is the better bet


def test_learned_gaps_change_p_reuse() -> None:
    est = ReuseEstimator()
    for i in range(200):  # alice re-reads every block after ~5 s; bob never re-reads
        k = bytes([1]) + i.to_bytes(4, "big")
        est.observe(k, ALICE, float(i))
        est.observe(k, ALICE, float(i) + 5.0)
        est.observe(bytes([2]) + i.to_bytes(4, "big"), BOB, float(i))
    # Bob's blocks are open questions until they have been idle for his resolve time (no gaps
    # seen: 3 x the 300 s prior): not yet evidence against reuse.
    assert est.p_next(BOB, 1) == pytest.approx(0.5) and est.resolve_s(BOB) == 900.0
    est.observe(b"later", BOB, 1200.0)
    assert est.p_next(ALICE, 1) > 0.9 and est.p_next(BOB, 1) < 0.05
    assert 5.0 <= est.mean_gap_s(ALICE) < 8.0  # 200 gaps of 5 s and the 300 s prior worth 2
    assert est.p_reuse_within(ALICE, 1, 0.0, 60.0) > 0.9
    # Idle far past every gap seen: a reuse is no longer expected.
    assert est.p_reuse_within(ALICE, 1, 600.0, 60.0) < 0.05
    p = policy()
    p.reuse = est
    a, b = meta(1, tenant=ALICE), meta(2, tenant=BOB)
    assert p.price(a, HOST_COST).p_reuse > 10 * p.price(b, HOST_COST).p_reuse
    assert p.decide_eviction([a, b], 1, HOST_COST) == [b.key]


def test_frequency_raises_p_reuse() -> None:
    est = ReuseEstimator()
    for i in range(300):  # blocks read once stay at one read 2/3 of the time; read twice, always a third
        k = i.to_bytes(4, "big")
        est.observe(k, ALICE, float(i))
        if i % 3 == 0:
            est.observe(k, ALICE, i + 1.0)
            est.observe(k, ALICE, i + 2.0)
    assert est.p_next(ALICE, 2) > 0.9 > 0.5 > est.p_next(ALICE, 1)


def test_a_host_copy_backed_by_ssd_is_demoted_before_a_host_only_record() -> None:
    p = policy()
    p.decide_put(meta(9, tiers=()), TIERS)  # learns the tier costs
    backed = meta(1, tiers=(HOST, SSD))
    alone = meta(2, tiers=(HOST,))
    v = p.price(backed, HOST_COST, TIERS)
    assert v.fallback_s == pytest.approx(SSD_COST.load_time_s(SIZE))
    assert p.decide_eviction([alone, backed], 1, HOST_COST) == [backed.key]


def test_admission_skips_tiers_where_a_copy_saves_nothing() -> None:
    p = policy(encoder_s=1e-9, replay_s=1e-9)  # rebuilding is cheaper than any load
    assert p.decide_put(meta(1, tiers=()), TIERS) == {HOST}  # MEMORY durability needs host, nothing more
    assert p.decide_put(meta(2, tiers=(), durability=Durability.LOCAL), TIERS) == {SSD}  # durability still rules
    # Learned reuse (prior gaps ~300 s): host covers the next 100 s, SSD adds (100 s, 1,000 s].
    assert policy().decide_put(meta(3, tiers=()), TIERS) == {HOST, SSD}


def test_explain_names_value_reuse_rebuild_load_bytes_and_fill() -> None:
    p = policy()
    m = meta(1, start=160, end=176, hints=PutHints(expected_return_s=10.0))
    d = p.explain_dict(m, TIERS)
    assert d["rebuild_s"] == pytest.approx(23e-3 * (1 + 3 * 160 / 1584), rel=1e-6) or d["rebuild_s"] > 0
    assert d["reuse_source"] == "hint: returns 10 s after its last access"
    host = d["tiers"]["host"]
    assert host["resident"] is True and host["bytes"] == SIZE and host["fill"] == pytest.approx(0.95)
    assert host["value_s"] == pytest.approx(host["p_reuse"] * (host["fallback_s"] - host["load_s"]))
    assert host["value_per_byte"] == pytest.approx(host["value_s"] / SIZE)
    text = p.explain(m, TIERS)
    for word in ("MUST_KEEP", "rebuild", "P(reuse within", "load", "value", "s/B", "fill 95%", "host: held",
                 "ssd: not held"):
        assert word in text, word


def test_bad_profile_values_are_refused() -> None:
    with pytest.raises(ValueError, match="hint_confidence"):
        CostPolicyConfig(hint_confidence=0.0)


# ----- through the store: durability is never traded for value ------------------------------------

PAGE = 4096
HOST_FOOTPRINT = PAGE + record_overhead_bytes(1)


def rec(i: int, size: int = PAGE):  # type: ignore[no-untyped-def]
    return make_record(GLOBAL, 0, bytes([i % 251]) * size, model_fingerprint=b"f" * 16, tenant_id=ALICE,
                       block_key=bytes([i]) * 32, token_start=16 * i, token_end=16 * i + 16)


async def test_cost_policy_never_evicts_local_only_copies_through_the_store(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tiers.ssd import SSDTier

    caplog.set_level(logging.WARNING, logger="statestore.policy")
    profile = make_profile()
    ssd = SSDTier(tmp_path / "ssd", budget_bytes=6 * 8192 + 6 * 4096)
    await ssd.open()
    probe = ssd.footprint(rec(0))
    await ssd.aclose()
    ssd = SSDTier(tmp_path / "ssd", budget_bytes=6 * probe)
    await ssd.open()
    store = TieredStore(host=HostTier(3 * HOST_FOOTPRINT, {GLOBAL: PAGE}, slab_bytes=PAGE), ssd=ssd,
                        policy=CostAwarePolicy(profile), config=StoreConfig(tier_profiles=profile.tier_profiles()),
                        clock=iter(float(t) for t in range(1000)).__next__)
    async with store:
        local = [rec(i) for i in range(1, 5)]
        for r in local:
            await store.put(r, Durability.LOCAL)
        for i in range(10, 30):  # MEMORY puts past both budgets: only cache copies may go
            await store.put(rec(i), Durability.MEMORY)
        for r in local:
            m = store.meta(r.key)
            assert m is not None and SSD in m.tiers and m.durability is Durability.LOCAL
            got = await store.get(r.key)
            assert got is not None and got.payload == r.payload
        assert ssd.usage().resident_bytes <= 6 * probe
        # Two more LOCAL records fit (evicting MEMORY copies); the third cannot without dropping a LOCAL one.
        await store.put(rec(40), Durability.LOCAL)
        await store.put(rec(41), Durability.LOCAL)
        with pytest.raises(BudgetExceeded, match="the only durable copy"):
            await store.put(rec(42), Durability.LOCAL)
        assert all(SSD in store.meta(r.key).tiers for r in local)  # type: ignore[union-attr]
        explained = store.explain(local[0].key)
        assert explained is not None and explained["protected"]["ssd"] == "the only LOCAL copy"
        assert explained["policy"]["policy"] == "cost" and "ssd" in explained["policy"]["tiers"]
        assert store.explain(RecordKey(bytes(34))) is None
    assert not [r for r in caplog.records if "falling back" in r.getMessage()]  # no decision was rejected
