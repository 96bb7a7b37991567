"""What the cost-aware policy learns online: reuse odds by access count and by where a block
sat in the chain a reader looked up, admission refusals, and the store passing lookups on.

Constructed cases only; each could fail: a policy that ignored the chain context, priced a hit
without the access it brings, or admitted every copy would break one of them.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statestore.cost_policy import CostAwarePolicy
from statestore.reuse import NO_CONTEXT, ReuseEstimator, chain_context, describe_context, outcome_bucket, with_outcome
from statestore.store import StoreConfig, TieredStore
from statestore.types import Durability, StateMeta, TierCost, TierName
from tests.unit.test_cost_policy import ALICE, GLOBAL, HOST, HOST_COST, SIZE, SSD, TIERS, key, make_profile, meta
from tiers.host import HostTier
from tiers.record import RecordKey, make_record, make_record_key

FULL_HOST = TierCost(HOST, 1e-5, 1e10, budget_bytes=100 * SIZE, resident_bytes=100 * SIZE)


# ----- chain context labels -------------------------------------------------------------------------

@given(st.integers(1, 5000), st.data(), st.booleans())
def test_chain_context_labels_are_small_and_describe_the_chain(length: int, data: st.DataObject,
                                                              extends: bool) -> None:
    position = data.draw(st.integers(0, length - 1))
    label = chain_context(length, position, extends)
    assert 0 <= label < 80
    text = describe_context(label)
    assert text.startswith("chain ") and ("new after a known prefix" in text) == extends
    assert ("last" in text) == (position == length - 1)


@given(st.integers(-3, 50), st.integers(-3, 60))
def test_chain_context_refuses_a_position_outside_the_chain(length: int, position: int) -> None:
    if length >= 1 and 0 <= position < length:
        assert chain_context(length, position) >= 0
    else:
        with pytest.raises(ValueError, match="not in a chain"):
            chain_context(length, position)


def test_chain_context_buckets() -> None:
    assert chain_context(40, 39) != chain_context(40, 10)  # the chain's end vs its inside
    assert chain_context(40, 10) == chain_context(47, 0)  # 32-47 blocks, 3+ from the end
    assert chain_context(40, 10) != chain_context(48, 0)  # another length bucket
    assert chain_context(130, 5) == chain_context(5000, 5)  # 128 blocks and more: one bucket
    assert describe_context(chain_context(40, 38)) == "chain 32-47, 1 from end"
    assert describe_context(chain_context(3, 0)) == "chain 1-15, 2 from end"
    assert describe_context(chain_context(200, 199, True)) == "chain 128+, last, new after a known prefix"
    assert describe_context(NO_CONTEXT) == "no chain"


# ----- the estimator ----------------------------------------------------------------------------------

def test_reuse_is_learned_per_chain_context_and_shrunk_towards_the_count_only_odds() -> None:
    est = ReuseEstimator()
    inner, tail = chain_context(40, 5), chain_context(40, 39)
    for i in range(300):  # inner blocks come back 10 s later; chain tails never do
        k_in, k_tail = b"i" + i.to_bytes(4, "big"), b"t" + i.to_bytes(4, "big")
        est.observe(k_in, ALICE, float(i), inner)
        est.observe(k_tail, ALICE, float(i), tail)
        est.observe(k_in, ALICE, i + 10.0, inner)
    est.observe(b"later", ALICE, 2000.0)  # resolves every open question
    base = est.p_next(ALICE, 1)
    assert 0.4 < base < 0.6  # half the first reads came back
    assert est.p_next(ALICE, 1, inner) > 0.95 and est.p_next(ALICE, 1, tail) < 0.05
    # An unseen context knows nothing more than the access count.
    assert est.p_next(ALICE, 1, chain_context(3, 0)) == pytest.approx(base)
    table = est.context_table(ALICE)
    assert table[1, inner][1] == 300 and table[1, tail][1] == 300


def test_a_context_seen_a_few_times_already_moves_away_from_the_count_only_odds() -> None:
    """Six resolved reads of a context, all of them read again, outweigh the count-only odds
    (about one half here): a context is told apart early in a workload, not after dozens."""
    est = ReuseEstimator()
    inner = chain_context(40, 5)
    for i in range(40):  # reads in no chain: every other one comes back 10 s later
        k = b"n" + i.to_bytes(4, "big")
        est.observe(k, ALICE, float(i))
        if i % 2 == 0:
            est.observe(k, ALICE, i + 10.0)
    for i in range(6):
        k = b"c" + i.to_bytes(4, "big")
        est.observe(k, ALICE, 100.0 + i, inner)
        est.observe(k, ALICE, 110.0 + i, inner)
    est.observe(b"later", ALICE, 2000.0)  # resolves every open question
    base = est.p_next(ALICE, 1)
    assert 0.5 < base < 0.6  # 26 of 46 first reads came back
    assert est.p_next(ALICE, 1, inner) > 0.85  # (6 + 2 x base) / (6 + 2); at 8 pseudo-counts it was 0.75
    assert est.context_table(ALICE)[1, inner] == (pytest.approx(est.p_next(ALICE, 1, inner)), 6)


def test_one_readers_chain_is_one_sample_of_its_context() -> None:
    """A 130-block document put once and never read again is one reader's outcome: its 127
    inner blocks share one sample of their context, so the context's odds move from the
    count-only odds as after one failure, not as after 127 (which would price the next long
    document near zero and, with an SSD, refuse its copies)."""
    p = CostAwarePolicy(make_profile())
    for i in range(40):  # reads in no chain: every other one comes back 10 s later
        k = b"n" + i.to_bytes(4, "big")
        p.reuse.observe(k, ALICE, float(i))
        if i % 2 == 0:
            p.reuse.observe(k, ALICE, i + 10.0)
    keys = [RecordKey(GLOBAL.to_bytes(2, "big") + b"doc" + i.to_bytes(4, "big") + bytes(25)) for i in range(130)]
    p.on_lookup(keys)
    for i, k in enumerate(keys):
        m = StateMeta(k, GLOBAL, SIZE, meta(0).retention, acked=True, last_access=100.0, tenant_id=ALICE,
                      token_start=16 * i, token_end=16 * i + 16).with_copy(HOST, SIZE)
        p.on_put(m, frozenset({HOST}))
    p.on_lookup([key(99)])
    p.on_put(meta(99, last_access=5000.0), frozenset({HOST}))  # resolves every open question
    inner, last = chain_context(130, 5), chain_context(130, 129)
    table = p.reuse.context_table(ALICE)
    assert table[1, inner][1] == pytest.approx(1.0) and table[1, last][1] == pytest.approx(1.0)
    base = p.reuse.p_next(ALICE, 1)
    # (0 + 2 x base) / (1 + 2): one failure against two pseudo-counts; per block it was ~0.01
    assert p.reuse.p_next(ALICE, 1, inner) == pytest.approx(2 * base / 3)


# ----- decisions --------------------------------------------------------------------------------------

def trained_policy() -> CostAwarePolicy:
    """A policy that saw 200 chains of 40 blocks looked up, put, and read again 30 s later
    except their last block (a reader's own tail)."""
    p = CostAwarePolicy(make_profile())
    for c in range(200):
        keys = [RecordKey(GLOBAL.to_bytes(2, "big") + c.to_bytes(4, "big") + bytes([b]) * 28) for b in range(40)]
        for when, reread in ((float(c), False), (c + 30.0, True)):
            chain = keys if reread else keys
            p.on_lookup(chain)
            for b, k in enumerate(chain):
                if reread and b == 39:
                    continue  # the tail is not read again
                m = StateMeta(k, GLOBAL, SIZE, meta(0).retention, acked=True, last_access=when, tenant_id=ALICE,
                              token_start=16 * b, token_end=16 * b + 16).with_copy(HOST, SIZE)
                (p.on_access if reread else p.on_put)(m, HOST)  # type: ignore[operator, arg-type]
        p.decide_put(meta(250, tiers=()), TIERS)
    p.on_lookup([key(99)])  # a much later lookup resolves the open questions
    p.on_put(meta(99, last_access=5000.0), frozenset({HOST}))
    return p


def fresh_in_chain(i: int, length: int, position: int, p: CostAwarePolicy, when: float = 5000.0,
                   tiers: tuple[TierName, ...] = (HOST,)) -> StateMeta:
    """A new block at `position` of a looked-up chain of `length`, equal in bytes and rebuild cost."""
    chain = [key(i) if j == position else RecordKey(b"\x00\x01" + bytes([i, j]) * 16) for j in range(length)]
    p.on_lookup(chain)
    return meta(i, start=160, end=176, last_access=when, tiers=tiers)


def test_a_chain_tail_is_evicted_before_an_inner_block_of_equal_bytes_cost_and_age() -> None:
    p = trained_policy()
    tail = fresh_in_chain(1, 40, 39, p)
    inner = fresh_in_chain(2, 40, 10, p)
    pt, pi = p.price(tail, HOST_COST).p_reuse, p.price(inner, HOST_COST).p_reuse
    assert pi > 5 * pt
    assert p.eviction_score(tail, HOST_COST) < p.eviction_score(inner, HOST_COST)
    assert p.decide_eviction([inner, tail], 1, HOST_COST) == [tail.key]
    reason = p.explain(tail, TIERS)
    assert "last in chain 32-47, last" in reason


def test_a_hit_is_priced_with_the_access_it_brings() -> None:
    """The store prices a copy before the hook reports the access: the second read must be
    priced as a record read twice, not once."""
    p = CostAwarePolicy(make_profile())
    for i in range(200):  # read once: never again; read twice: always a third time
        k = i.to_bytes(4, "big")
        m = meta(0, last_access=float(i))
        m = StateMeta(RecordKey(b"\x00\x01" + k * 8), GLOBAL, SIZE, m.retention, acked=True, last_access=float(i),
                      tenant_id=ALICE, token_start=160, token_end=176).with_copy(HOST, SIZE)
        p.on_put(m, m.tiers)
        if i % 2 == 0:
            for t in (1.0, 2.0):
                p.on_access(StateMeta(m.key, GLOBAL, SIZE, m.retention, acked=True, last_access=i + t,
                                      tenant_id=ALICE, token_start=160, token_end=176).with_copy(HOST, SIZE), HOST)
    p.on_put(meta(201, last_access=5000.0), frozenset({HOST}))
    assert p.reuse.p_next(ALICE, 2) > 0.9 > 0.6 > p.reuse.p_next(ALICE, 1)
    once = meta(7, last_access=6000.0)
    p.on_put(once, once.tiers)
    again = meta(7, last_access=6010.0)  # the store's meta of a second read, before on_access
    assert p.p_reuse(again, 60.0, 0.0)[1].startswith("learned: 2 access(es)")
    assert p.price(again, HOST_COST).p_reuse > p.price(once, HOST_COST).p_reuse


def test_admission_refuses_an_ssd_copy_that_does_not_pay_its_write_and_counts_it() -> None:
    p = trained_policy()
    tail = fresh_in_chain(1, 40, 39, p, tiers=())  # being put: no copy anywhere yet
    inner = fresh_in_chain(2, 40, 10, p, tiers=())
    # a write takes 10 ms, weighted 0.25: a copy must save more than 2.5 ms
    slow_ssd = TierCost(SSD, 1e-4, 1e6, budget_bytes=100_000 * SIZE, resident_bytes=0)
    tiers = {HOST: HOST_COST, SSD: slow_ssd}
    assert p.decide_put(inner, tiers) == {HOST, SSD}
    assert p.decide_put(tail, tiers) == {HOST}  # unlikely to be read again: not worth an SSD write
    assert p.decisions["ssd refused"] >= 1 and p.decisions["ssd admitted"] >= 1
    # Durability still rules: a LOCAL put of the same tail goes to SSD.
    local = StateMeta(tail.key, GLOBAL, SIZE, tail.retention, durability=Durability.LOCAL, last_access=5000.0,
                      tenant_id=ALICE, token_start=160, token_end=176)
    assert SSD in p.decide_put(local, tiers)


def test_a_full_host_refuses_to_promote_a_copy_worth_less_than_what_it_evicts() -> None:
    p = trained_policy()
    on_ssd = {HOST: FULL_HOST, SSD: TierCost(SSD, 1e-4, 1e9, budget_bytes=1000 * SIZE, resident_bytes=0)}
    p.decide_put(meta(250, tiers=()), on_ssd)  # learns the SSD's costs
    # The full host has been evicting SSD-backed copies of inner blocks: that is its price.
    for i in range(100):
        victim = fresh_in_chain(100 + i, 40, 10, p, tiers=(HOST, SSD))
        p.eviction_score(victim, FULL_HOST)
        p.on_remove(victim.without_copy(HOST), HOST)
    tail = fresh_in_chain(1, 40, 39, p, tiers=(SSD,))
    assert p.decide_promote(tail, SSD, on_ssd) == frozenset()  # 27x less likely read: not worth the room
    assert p.decisions["host promotion refused"] == 1
    inner = fresh_in_chain(2, 40, 10, p, tiers=(SSD,))
    assert p.decide_promote(inner, SSD, on_ssd) == {HOST}
    assert p.decisions["host promoted"] == 1


# ----- through a real store ------------------------------------------------------------------------------

async def test_the_store_passes_lookups_to_the_policy_and_inspect_shows_the_context() -> None:
    profile = make_profile()
    policy = CostAwarePolicy(profile)
    store = TieredStore(host=HostTier(1 << 20, {GLOBAL: 4096}), policy=policy,
                        config=StoreConfig(tier_profiles=profile.tier_profiles()),
                        clock=iter(float(t) for t in range(1000)).__next__)
    records = [make_record(GLOBAL, 0, bytes([b]) * 4096, model_fingerprint=b"f" * 16, tenant_id=ALICE,
                           block_key=bytes([b]) * 32, token_start=16 * b, token_end=16 * b + 16) for b in range(5)]
    keys = [make_record_key(GLOBAL, r.header.block_key) for r in records]
    assert keys == [r.key for r in records]
    async with store:
        result = await store.lookup(keys)
        assert result.combined == 0
        for r in records:
            await store.put(r, Durability.MEMORY)
        explained = store.explain(keys[-1])
        assert explained is not None
        assert "last in chain 1-15, last" in explained["policy"]["reuse_source"]
        assert "last in chain 1-15, 3+ from end" in store.explain(keys[0])["policy"]["reuse_source"]  # type: ignore[index]
        # A lookup that finds them: the hit is learned as a reuse in that context.
        assert (await store.lookup(keys)).combined == 5
        assert await store.get(keys[0]) is not None
        assert policy.reuse.latest(keys[0])[0] == 2


# ----- the outcome of the reader's request --------------------------------------------------------------

@given(st.one_of(st.just(NO_CONTEXT), st.integers(1, 300).flatmap(
    lambda n: st.builds(chain_context, st.just(n), st.integers(0, n - 1), st.booleans()))), st.integers(0, 1 << 40))
def test_an_outcome_refines_a_context_once_and_is_described(context: int, generated: int) -> None:
    refined = with_outcome(context, generated)
    assert refined != context and refined >= 0
    assert with_outcome(refined, 5) == refined  # a second outcome does not overwrite the first
    assert with_outcome(context, generated) == refined  # deterministic
    text = describe_context(refined)
    assert text.startswith(describe_context(context) + ", the request generated ")
    low = max(edge for edge in (0, 16, 64, 256, 1024) if edge <= generated)
    assert f"generated {low}" in text


def test_outcome_buckets_grow_by_factors_of_four() -> None:
    assert [outcome_bucket(n) for n in (0, 15, 16, 63, 64, 255, 256, 1023, 1024, 10**9)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert describe_context(with_outcome(chain_context(40, 38), 70)) == \
        "chain 32-47, 1 from end, the request generated 64-255 tokens"
    assert describe_context(with_outcome(NO_CONTEXT, 3000)) == "no chain, the request generated 1024+ tokens"
    with pytest.raises(ValueError, match="generated_tokens"):
        outcome_bucket(-1)


def test_reuse_odds_are_learned_per_outcome_of_the_request() -> None:
    """Two kinds of turns read the same chain position; only the turns that generated a few
    tokens come back. Refined at request end, the odds tell them apart; unrefined they cannot."""
    est = ReuseEstimator()
    inner = chain_context(40, 5)
    for i in range(200):
        short, long = b"s" + i.to_bytes(4, "big"), b"l" + i.to_bytes(4, "big")
        est.observe(short, ALICE, float(i), inner)
        est.observe(long, ALICE, float(i), inner)
        assert est.refine(short, 8) and est.refine(long, 900)
        assert not est.refine(short, 900)  # its latest access already has an outcome
        est.observe(short, ALICE, i + 10.0, inner)  # the short turn's conversation goes on
    est.observe(b"later", ALICE, 2000.0)  # resolves every open question
    assert est.p_next(ALICE, 1, inner) == pytest.approx(est.p_next(ALICE, 1), abs=0.05)  # unrefined: no signal
    assert est.p_next(ALICE, 1, with_outcome(inner, 8)) > 0.95
    assert est.p_next(ALICE, 1, with_outcome(inner, 900)) < 0.05
    assert not est.refine(b"never seen", 3)


async def test_request_done_moves_the_eviction_order_of_the_store() -> None:
    """A real store: after the policy learned that long answers end conversations, two equal
    blocks of the current requests are ranked by their requests' outcomes once `request_done`
    reports them (it re-scores their copies at once), and not before."""
    profile = make_profile()
    policy = CostAwarePolicy(profile)
    now = [0.0]
    store = TieredStore(host=HostTier(64 * 4096, {GLOBAL: 4096}), policy=policy,
                        config=StoreConfig(tier_profiles=profile.tier_profiles()), clock=lambda: now[0])

    def record(tag: bytes, i: int):  # type: ignore[no-untyped-def]
        return make_record(GLOBAL, 0, tag * 4096, model_fingerprint=b"f" * 16, tenant_id=ALICE,
                           block_key=tag + i.to_bytes(31, "big"), token_start=0, token_end=16)

    async with store:
        for i in range(150):  # history: one-block requests; short answers come back, long ones never
            now[0] = float(i)
            for tag, generated in ((b"s", 5), (b"l", 700)):
                r = record(tag, i)
                await store.lookup([r.key])
                await store.put(r, Durability.MEMORY)
                store.request_done([r.key], generated)
            now[0] = i + 0.5
            await store.lookup([record(b"s", i).key])
            assert await store.get(record(b"s", i).key) is not None
            store.request_done([record(b"s", i).key], 5)
            for tag in (b"s", b"l"):
                await store.evict(record(tag, i).key, force=True)
        now[0] = 1000.0
        short, long = record(b"a", 0), record(b"b", 0)
        for r in (short, long):  # equal but for their requests' outcomes; the short one is older
            await store.lookup([r.key])
            await store.put(r, Durability.MEMORY)
        p_short, p_long = (policy.p_reuse(store.meta(r.key), 60.0, 0.0)[0] for r in (short, long))  # type: ignore[arg-type]
        assert p_short == pytest.approx(p_long)  # no outcome yet: equal
        store.request_done([short.key], 5)
        store.request_done([long.key], 700)
        p_short, p_long = (policy.p_reuse(store.meta(r.key), 60.0, 0.0)[0] for r in (short, long))  # type: ignore[arg-type]
        assert p_short > 5 * p_long
        assert "the request generated 256-1023 tokens" in store.explain(long.key)["policy"]["reuse_source"]  # type: ignore[index]
        # Fill the host until a put evicts: the long answer's block leaves first, though it is the
        # newer of the two (equal odds would evict the older one first, and so would stale scores).
        evicted: tuple[tuple[RecordKey, TierName], ...] = ()
        for i in range(1, 200):
            filler = record(b"f", i)
            await store.lookup([filler.key])
            evicted = (await store.put(filler, Durability.MEMORY)).evicted
            if evicted:
                break
        assert evicted[:1] == ((long.key, HOST),)
        assert store.meta(short.key) is not None and HOST in store.meta(short.key).tiers  # type: ignore[union-attr]
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(ValueError, match="generated_tokens"):
                store.request_done([short.key], bad)  # type: ignore[arg-type]


async def test_request_done_reaches_a_policy_that_learns_and_is_accepted_by_lru() -> None:
    """A policy overriding `on_request_end` hears every report (the store skips the hook and
    the re-scoring for policies that do not: LRU)."""
    from statestore.policy import LRUPolicy

    class Listening(LRUPolicy):
        def __init__(self) -> None:
            self.heard: list[tuple[int, int]] = []

        def on_request_end(self, keys, generated_tokens):  # type: ignore[no-untyped-def]
            self.heard.append((len(keys), generated_tokens))

    listening = Listening()
    for policy in (LRUPolicy(), listening):
        store = TieredStore(host=HostTier(1 << 20, {GLOBAL: 4096}), policy=policy)
        async with store:
            r = make_record(GLOBAL, 0, b"x" * 4096, model_fingerprint=b"f" * 16, tenant_id=ALICE,
                            block_key=b"k" * 32, token_end=16)
            await store.put(r, Durability.MEMORY)
            store.request_done([r.key, r.key], 9)
            assert (await store.get(r.key)) is not None
    assert listening.heard == [(2, 9)]
