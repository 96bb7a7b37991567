"""TieredStore on real tiers: host RAM, SSD files under tmp_path, the real Redis.

Record sizes are chosen so every id and byte count is predictable: host pages of PAGE bytes
in one-page slabs (no slab slack), so a host of budget N * HOST_FOOTPRINT holds N records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_adapter.base import Retention
from statestore.keys import derive_tenant_salt, hash_block, make_model_fingerprint, tenant_id
from statestore.policy import LRUPolicy, eviction_block_reason
from statestore.store import BudgetExceeded, DurabilityUnavailable, StoreConfig, TieredStore
from statestore.types import Durability, EventKind, StateMeta, TierCost, TierName
from tiers.host import HostTier
from tiers.pools import record_overhead_bytes
from tiers.record import Record, RecordKey, make_record

HOST, SSD, REDIS = TierName.HOST, TierName.SSD, TierName.REDIS
KV = 1
PAGE = 4096
HOST_FOOTPRINT = PAGE + record_overhead_bytes(1)
FP = make_model_fingerprint({"layers": 2}, [1], 1, "weights-a")
OTHER_FP = make_model_fingerprint({"layers": 2}, [1], 1, "weights-b")
ALICE, BOB = tenant_id("alice"), tenant_id("bob")
SALT = derive_tenant_salt(b"test-secret-0123456789", "alice")


def rec(i: int, *, fp: bytes = FP, tenant: bytes = ALICE, size: int = PAGE, kind: int = KV) -> Record:
    block_key = hash_block(None, [i], fp, SALT)
    return make_record(kind, 0, bytes([i % 251]) * size, model_fingerprint=fp, tenant_id=tenant,
                       block_key=block_key, token_start=0, token_end=1)


def host_tier(num_records: int) -> HostTier:
    return HostTier(num_records * HOST_FOOTPRINT, {KV: PAGE}, slab_bytes=PAGE)


def ssd_module():  # type: ignore[no-untyped-def]
    return pytest.importorskip("tiers.ssd", reason="tiers/ssd.py has not landed")


def redis_module():  # type: ignore[no-untyped-def]
    return pytest.importorskip("tiers.redis", reason="tiers/redis.py has not landed")


@pytest.fixture
async def stores() -> AsyncIterator[Callable[..., TieredStore]]:
    """Build stores; every one is closed at teardown (its tiers with it)."""
    made: list[TieredStore] = []

    def make(**kwargs: object) -> TieredStore:
        kwargs.setdefault("config", StoreConfig(enable_events=True))
        store = TieredStore(**kwargs)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def open_ssd(root: Path, budget_bytes: int = 0):  # type: ignore[no-untyped-def]
    return await ssd_module().SSDTier.create(root, budget_bytes)


@pytest.fixture
def redis_prefix() -> str:
    return f"sstest-{uuid.uuid4().hex[:12]}"


async def wipe_redis(url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        async for name in client.scan_iter(match=f"{prefix}:*"):
            await client.delete(name)
    finally:
        await client.aclose()


def ssd_bytes_on_disk(root: Path, index_entry_bytes: int) -> int:
    """What the SSD tier documents as its residency: each record file rounded up to the file
    system block, plus one in-memory index entry per record."""
    block = os.stat(root).st_blksize
    files = [p for p in root.rglob("*.rec") if "quarantine" not in p.parts]
    return sum(-(-p.stat().st_size // block) * block for p in files) + len(files) * index_entry_bytes


# ----- durability levels --------------------------------------------------------------------

async def test_memory_put_get_round_trip(stores: Callable[..., TieredStore]) -> None:
    store = stores(host=host_tier(4))
    r = rec(1)
    result = await store.put(r)
    assert result.durability is Durability.MEMORY and result.tiers == {HOST} and result.evicted == ()
    got = await store.get(r.key)
    assert got is not None and got.payload == r.payload and got.header.block_key == r.header.block_key
    assert await store.get(rec(2).key) is None
    host_stats = store.stats()[HOST].by_kind[KV]
    assert (host_stats.num_records, host_stats.hits, host_stats.misses) == (1, 1, 1)
    assert store.take_events()[0].kind is EventKind.STORED and store.take_events() == []


async def test_local_put_survives_a_new_store_over_the_same_dir(
        stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    first = stores(host=host_tier(4), ssd=await open_ssd(tmp_path / "ssd"))
    r = rec(1)
    assert (await first.put(r, Durability.LOCAL)).tiers == {HOST, SSD}
    await first.aclose()

    second = stores(host=host_tier(4), ssd=await open_ssd(tmp_path / "ssd"))
    report = await second.open()
    assert report.indexed == {HOST: 0, SSD: 1} and report.discarded == {HOST: [], SSD: []}
    meta = second.meta(r.key)
    assert meta is not None and meta.durability is Durability.LOCAL and meta.tiers == {SSD}
    got = await second.get(r.key, expect_fingerprint=FP, expect_tenant=ALICE)
    assert got is not None and got.payload == r.payload
    assert second.meta(r.key).tiers == {HOST, SSD}  # type: ignore[union-attr]  # promoted


async def test_open_reports_what_the_scan_discarded(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    ssd = await open_ssd(tmp_path / "ssd")
    store = stores(ssd=ssd)
    r = rec(1)
    await store.put(r, Durability.LOCAL)
    [path] = list((tmp_path / "ssd").rglob("*.rec"))
    path.write_bytes(path.read_bytes()[:100])  # torn
    report = await stores(ssd=ssd).open()
    assert report.indexed == {SSD: 0}
    assert len(report.discarded[SSD]) == 1 and "quarantined" in report.discarded[SSD][0]


@pytest.mark.redis
async def test_shared_put_is_readable_by_a_second_node(
        stores: Callable[..., TieredStore], tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    redis_tier = redis_module().RedisTier
    node_a = stores(host=host_tier(4), ssd=await open_ssd(tmp_path / "a"),
                    redis=redis_tier(redis_url, prefix=redis_prefix))
    node_b = stores(host=host_tier(4), ssd=await open_ssd(tmp_path / "b"),
                    redis=redis_tier(redis_url, prefix=redis_prefix))
    try:
        r = rec(1)
        assert (await node_a.put(r, Durability.SHARED)).tiers == {HOST, REDIS}
        assert (await node_b.lookup([r.key, rec(2).key])).per_tier == {HOST: 0, SSD: 0, REDIS: 1}
        got = await node_b.get(r.key, expect_fingerprint=FP, expect_tenant=ALICE)
        assert got is not None and got.payload == r.payload
        meta = node_b.meta(r.key)
        assert meta is not None and meta.tiers == {HOST, REDIS} and meta.durability is Durability.SHARED
        assert node_b.stats()[REDIS].by_kind[KV].hits == 1
        assert node_b.stats()[HOST].by_kind[KV].promotions == 1
    finally:
        await wipe_redis(redis_url, redis_prefix)


@pytest.mark.redis
async def test_shared_put_with_redis_down_fails_clearly_while_local_and_memory_work(
        stores: Callable[..., TieredStore], tmp_path: Path, redis_process_factory) -> None:  # type: ignore[no-untyped-def]
    server = redis_process_factory()
    store = stores(host=host_tier(8), ssd=await open_ssd(tmp_path / "ssd"),
                   redis=redis_module().RedisTier(server.url, prefix="down"))
    assert (await store.put(rec(1), Durability.SHARED)).durability is Durability.SHARED
    server.kill()
    with pytest.raises(DurabilityUnavailable, match="SHARED put of .* not acknowledged: the redis tier is unavailable"):
        await store.put(rec(2), Durability.SHARED)
    assert store.meta(rec(2).key) is None  # nothing half-acknowledged is left indexed
    assert (await store.put(rec(3), Durability.LOCAL)).tiers == {HOST, SSD}
    assert (await store.put(rec(4))).tiers == {HOST}
    assert (await store.get(rec(3).key)) is not None and (await store.get(rec(1).key)) is not None
    lookup = await store.lookup([rec(3).key, rec(4).key])
    assert lookup.per_tier == {HOST: 2, SSD: 1, REDIS: 0} and lookup.combined == 2


async def test_durability_without_its_tier_is_refused(stores: Callable[..., TieredStore]) -> None:
    store = stores(host=host_tier(2))
    with pytest.raises(DurabilityUnavailable, match="LOCAL put of .* not acknowledged: no ssd tier is configured"):
        await store.put(rec(1), Durability.LOCAL)
    with pytest.raises(DurabilityUnavailable, match="no redis tier is configured"):
        await store.put(rec(1), Durability.SHARED)


async def test_ephemeral_kinds_are_never_stored(stores: Callable[..., TieredStore]) -> None:
    store = stores(host=host_tier(2), config=StoreConfig(retention_by_kind={KV: Retention.EPHEMERAL}))
    with pytest.raises(ValueError, match="EPHEMERAL"):
        await store.put(rec(1))


# ----- promotion and lookup ----------------------------------------------------------------------

async def test_get_promotes_from_ssd_into_host(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    store = stores(host=host_tier(4), ssd=await open_ssd(tmp_path / "ssd"))
    r = rec(1)
    await store.put(r, Durability.LOCAL)
    assert await store.evict(r.key, [HOST]) == {HOST}
    store.take_events()
    got = await store.get(r.key)
    assert got is not None and got.payload == r.payload
    assert store.meta(r.key).tiers == {HOST, SSD}  # type: ignore[union-attr]
    stats = store.stats()
    assert (stats[HOST].by_kind[KV].misses, stats[SSD].by_kind[KV].hits, stats[HOST].by_kind[KV].promotions) == (1, 1, 1)
    [event] = store.take_events()
    assert (event.kind, event.tier, event.reason) == (EventKind.STORED, HOST, "promoted")
    assert (await store.get(r.key)) is not None
    assert store.stats()[HOST].by_kind[KV].hits == 1  # now served from RAM


async def test_lookup_longest_prefix_per_tier(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    store = stores(host=host_tier(8), ssd=await open_ssd(tmp_path / "ssd"))
    chain = [rec(i) for i in range(5)]
    keys = [r.key for r in chain]
    for r in chain[:3]:
        await store.put(r, Durability.LOCAL)  # host + ssd
    await store.evict(keys[1], [HOST])  # host: k0 _ k2
    await store.put(chain[3])  # host only
    result = await store.lookup(keys)
    # host: k0 | k1 missing ; ssd: k0 k1 k2 | k3 missing ; any tier: k0..k3 | k4 never stored
    assert result.per_tier == {HOST: 1, SSD: 3}
    assert result.combined == 4
    assert (await store.lookup([])).combined == 0


RESIDENCY = ("none", "host", "host+ssd", "ssd")  # where a chain's key is held (see `_place_chain`)


async def _place_chain(store: TieredStore, residency: list[str]) -> list[RecordKey]:
    keys = []
    for i, where in enumerate(residency):
        r = rec(i)
        keys.append(r.key)
        if where == "host":
            await store.put(r)
        elif where in ("host+ssd", "ssd"):
            await store.put(r, Durability.LOCAL)  # host + ssd
            if where == "ssd":
                await store.evict(r.key, [HOST])
    return keys


def _reference_lookup(store: TieredStore, keys: list[RecordKey]) -> tuple[dict[TierName, int], int]:
    """The definition: per tier, the leading keys with an acknowledged copy there; across tiers,
    the leading keys with one anywhere."""
    def prefix(held: Callable[[StateMeta], bool]) -> int:
        n = 0
        for key in keys:
            meta = store.meta(key)
            if meta is None or not meta.acked or not held(meta):
                break
            n += 1
        return n
    return {t: prefix(lambda m, t=t: t in m.tiers) for t in (HOST, SSD)}, prefix(lambda m: bool(m.tiers))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(residency=st.lists(st.sampled_from(RESIDENCY), max_size=9))
def test_lookup_matches_its_definition_for_any_residency(residency: list[str], tmp_path: Path) -> None:
    """Lookup's scans stop at each tier's first miss (a long chain costs its stored prefix):
    whatever each key's residency, the answer is the definition's."""
    async def check() -> None:
        root = tmp_path / uuid.uuid4().hex
        store = TieredStore(host=host_tier(16), ssd=await open_ssd(root))
        try:
            keys = await _place_chain(store, residency)
            result = await store.lookup(keys)
            assert (result.per_tier, result.combined) == _reference_lookup(store, keys)
            assert list(result.per_tier) == [HOST, SSD]  # fastest first, as `TIER_ORDER`
        finally:
            await store.aclose()

    asyncio.run(check())


OPS = st.lists(st.tuples(st.sampled_from(("memory", "local", "get", "evict-host", "evict", "pin", "unpin")),
                         st.integers(0, 5),
                         st.sampled_from((ALICE, BOB)), st.sampled_from((PAGE // 2, PAGE)), st.sampled_from((KV, 2))),
               max_size=24)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, track_first=st.booleans())
def test_per_tenant_bytes_listed_keys_and_evictable_bytes_are_a_pass_over_the_index(
        ops: list[tuple[str, int, bytes, int, int]], track_first: bool, tmp_path: Path) -> None:
    """What a byte quota counts, how a session layer finds its manifests and what a refused put
    reports, kept where the index changes: after any puts (re-puts of other sizes, tenants and
    kinds, LRU evictions from a 3-record host, refusals), hits, pins, explicit evictions and drops,
    each tenant's `acked_bytes` is the sum over its acknowledged index entries, `keys_of_kind`
    lists its entries of a tracked kind (tracked before the puts or after), and each tier's
    `evictable_bytes` sums the copies there that no pin, acknowledgement or durability protects."""
    def agree_with_a_pass(store: TieredStore) -> None:
        metas = [m for m in (store.meta(k) for k in store.keys()) if m is not None]
        for tenant in (ALICE, BOB):
            assert store.acked_bytes(tenant) == sum(m.size_bytes for m in metas if m.acked and m.tenant_id == tenant)
            assert sorted(store.keys_of_kind(tenant, 2)) == sorted(m.key for m in metas
                                                                   if m.kind == 2 and m.tenant_id == tenant)
        for tier in (HOST, SSD):  # what a refused put's message counts as protected, without a pass
            assert store.evictable_bytes(tier) == sum(m.resident_bytes(tier) for m in metas if tier in m.tiers
                                                      and eviction_block_reason(m, tier) is None)

    async def check() -> None:
        host = HostTier(3 * HOST_FOOTPRINT, {KV: PAGE, 2: PAGE}, slab_bytes=PAGE)
        store = TieredStore(host=host, ssd=await open_ssd(tmp_path / uuid.uuid4().hex))
        try:
            if track_first:
                store.track_kind(2)
            for op, i, tenant, size, kind in ops:
                key = rec(i, kind=kind).key
                if op in ("memory", "local"):
                    with contextlib.suppress(BudgetExceeded):  # a host full of pinned records refuses
                        await store.put(rec(i, tenant=tenant, size=size, kind=kind),
                                        Durability.MEMORY if op == "memory" else Durability.LOCAL)
                elif op == "get":
                    await store.get(key)  # a hit re-queues the copies it touched
                elif op == "pin":
                    store.pin(key)
                elif op == "unpin":
                    store.unpin(key)
                elif store.meta(key) is not None:
                    await store.evict(key, [HOST] if op == "evict-host" else None, force=True)
                if track_first:  # after every step, not only at the end: a key that left and came back
                    agree_with_a_pass(store)
            store.track_kind(2)
            agree_with_a_pass(store)
            with pytest.raises(ValueError, match="not listed"):
                store.keys_of_kind(ALICE, KV)
        finally:
            await store.aclose()

    asyncio.run(check())


# ----- budgets, eviction, pins -------------------------------------------------------------------

async def test_filling_host_evicts_in_exact_lru_order_and_residency_is_bytes_held(
        stores: Callable[..., TieredStore]) -> None:
    host = host_tier(4)
    store = stores(host=host)
    recs = [rec(i) for i in range(7)]
    for r in recs[:4]:
        await store.put(r)
    await store.get(recs[0].key)  # LRU now: r1 r2 r3 r0
    assert (await store.put(recs[4])).evicted == ((recs[1].key, HOST),)
    await store.get(recs[2].key)  # LRU now: r3 r0 r4 r2
    assert (await store.put(recs[5])).evicted == ((recs[3].key, HOST),)
    assert (await store.put(recs[6])).evicted == ((recs[0].key, HOST),)
    assert sorted(store.keys()) == sorted(r.key for r in (recs[2], recs[4], recs[5], recs[6]))
    removed = [e.key for e in store.take_events() if e.kind is EventKind.REMOVED]
    assert removed == [recs[1].key, recs[3].key, recs[0].key]
    assert all(e.reason == "evicted" for e in store.take_events())
    stats = store.stats()[HOST]
    assert stats.by_kind[KV].evictions == 3 and stats.by_kind[KV].num_records == 4
    # residency reported = every byte the pools hold (pages, headers, index entries)
    assert stats.resident_bytes == host.pools.held_bytes == 4 * HOST_FOOTPRINT == stats.budget_bytes
    assert stats.fill == 1.0


class _CountingLRU(LRUPolicy):
    """LRU that records how many candidates each eviction showed it."""

    def __init__(self, window: object) -> None:
        self.eviction_window = window  # type: ignore[assignment]
        self.shown: list[int] = []

    def decide_eviction(self, candidates, need_bytes, tier):  # type: ignore[no-untyped-def]
        self.shown.append(len(candidates))
        return super().decide_eviction(candidates, need_bytes, tier)


@pytest.mark.parametrize("window, shown", [(1, 1), (5, 5), (None, 7), (0, 7), ("many", 7)])
async def test_a_policy_sees_the_eviction_window_it_names(stores: Callable[..., TieredStore],
                                                          caplog: pytest.LogCaptureFixture,
                                                          window: object, shown: int) -> None:
    """Each eviction collects the candidates the policy asks for (`eviction_window`; LRU needs
    only those that cover the bytes, since its order is the queue's), else the store's window
    (7 here); a window that is not a positive int is named in a warning. The victims are the
    same either way: LRU's."""
    policy = _CountingLRU(window)
    with caplog.at_level(logging.WARNING, logger="statestore.policy"):
        store = stores(host=host_tier(10), policy=policy, config=StoreConfig(eviction_window=7))
    assert ("is not a positive int" in caplog.text) == (window in (0, "many"))
    recs = [rec(i) for i in range(14)]
    for r in recs[:10]:
        await store.put(r)
    evicted = [(await store.put(r)).evicted for r in recs[10:]]
    assert evicted == [((recs[i].key, HOST),) for i in range(4)]
    assert policy.shown == [shown] * 4
    assert LRUPolicy.eviction_window == 1


async def test_filling_ssd_evicts_in_lru_order_and_residency_is_bytes_on_disk(
        stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    probe = await open_ssd(tmp_path / "probe")
    footprint = probe.footprint(rec(0))
    await probe.aclose()
    ssd = await open_ssd(root, budget_bytes=3 * footprint)
    store = stores(ssd=ssd)  # no host: MEMORY puts land on the SSD as an evictable cache
    recs = [rec(i) for i in range(6)]
    for r in recs[:3]:
        assert (await store.put(r)).tiers == {SSD}
    await store.get(recs[0].key)  # LRU: r1 r2 r0
    assert (await store.put(recs[3])).evicted == ((recs[1].key, SSD),)
    assert (await store.put(recs[4])).evicted == ((recs[2].key, SSD),)
    assert (await store.put(recs[5])).evicted == ((recs[0].key, SSD),)
    on_disk = sorted(p.name for p in root.rglob("*.rec"))
    assert on_disk == sorted(r.key.hex() + ".rec" for r in recs[3:])
    entry = ssd_module().INDEX_ENTRY_BYTES
    assert store.stats()[SSD].resident_bytes == ssd_bytes_on_disk(root, entry) == 3 * footprint


async def test_ssd_evictions_recycle_files_and_reserve_plus_residency_is_bytes_on_disk(
        stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    """O_DIRECT-sized records: an eviction keeps the file as a recycled spare (stats'
    reserve_bytes), the next put of that size writes over it, and records plus reserve are
    the bytes on disk, within the budget."""
    root, size = tmp_path / "ssd", 150_000
    probe = await open_ssd(tmp_path / "probe")
    footprint = probe.footprint(rec(0, size=size))
    await probe.aclose()
    ssd = await ssd_module().SSDTier.create(root, 4 * footprint, recycle_bytes=footprint)
    store = stores(ssd=ssd)
    recs = [rec(i, size=size) for i in range(8)]
    for r in recs[:4]:
        await store.put(r)
    inodes = {p.stat().st_ino for p in root.rglob("*.rec")}
    for r in recs[4:]:
        assert len((await store.put(r)).evicted) == 1
    block = os.stat(root).st_blksize
    spare_bytes = sum(-(-p.stat().st_size // block) * block for p in (root / "spares").iterdir())
    stats = store.stats()[SSD]
    entry = ssd_module().INDEX_ENTRY_BYTES
    assert stats.resident_bytes == ssd_bytes_on_disk(root, entry) == 4 * footprint
    assert stats.reserve_bytes == spare_bytes <= footprint
    assert stats.resident_bytes + stats.reserve_bytes <= 4 * footprint
    reused = inodes & {p.stat().st_ino for p in root.rglob("*.rec")}
    assert reused, "no put wrote over the file of an evicted record"
    for r in recs[4:]:
        got = await store.get(r.key)
        assert got is not None and bytes(got.payload) == bytes(r.payload)


async def test_after_a_restart_scanned_copies_cost_what_the_tier_holds(
        stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    """Records indexed by the start-up scan are priced at the tier's real footprint: residency
    equals the bytes on disk, and one eviction makes room for one record of the same size (an
    estimate from the header alone evicted two, or none when only one was evictable)."""
    root = tmp_path / "ssd"
    probe = await open_ssd(tmp_path / "probe")
    footprint = probe.footprint(rec(0))
    await probe.aclose()
    config = StoreConfig(cache_kinds=frozenset({KV}))  # scanned copies count as LOCAL: evictable as a cache
    store = stores(ssd=await open_ssd(root, budget_bytes=3 * footprint), config=config)
    recs = [rec(i) for i in range(4)]
    for r in recs[:3]:
        await store.put(r)
    await store.aclose()
    store = stores(ssd=await open_ssd(root, budget_bytes=3 * footprint), config=config)
    await store.open()
    entry = ssd_module().INDEX_ENTRY_BYTES
    assert store.stats()[SSD].resident_bytes == ssd_bytes_on_disk(root, entry) == 3 * footprint
    assert len((await store.put(recs[3])).evicted) == 1
    assert len(store.keys()) == 3


async def test_cache_kinds_evict_their_only_local_copy_other_kinds_stay_protected(
        stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    """LOCAL puts into a full SSD: records of a cache kind (here OPAQUE, as LMCache chunks)
    are evicted for room, LRU, even as the only durable copy; a LOCAL record of another kind
    and a pinned cache record never are. After a restart (records indexed by the scan) the
    rule still holds: the kind is in each record's header."""
    root, size, opaque = tmp_path / "ssd", 150_000, 6
    probe = await open_ssd(tmp_path / "probe")
    footprint = probe.footprint(rec(0, size=size))
    await probe.aclose()
    config = StoreConfig(cache_kinds=frozenset({opaque}))
    store = stores(ssd=await open_ssd(root, budget_bytes=3 * footprint), config=config)
    kv, pinned, chunks = rec(1, size=size), rec(2, size=size, kind=opaque), [rec(i, size=size, kind=opaque)
                                                                           for i in range(10, 14)]
    await store.put(kv, Durability.LOCAL)
    await store.put(pinned, Durability.LOCAL, pin=True)
    await store.put(chunks[0], Durability.LOCAL)
    for older, newer in zip(chunks, chunks[1:]):
        assert (await store.put(newer, Durability.LOCAL)).evicted == ((older.key, SSD),)
    assert sorted(store.keys()) == sorted([kv.key, pinned.key, chunks[-1].key])
    assert (await store.put(rec(3, size=size), Durability.LOCAL)).evicted == ((chunks[-1].key, SSD),)
    with pytest.raises(BudgetExceeded):  # kv, pinned and rec 3: nothing left that may be evicted
        await store.put(rec(4, size=size), Durability.LOCAL)
    assert store.meta(kv.key) is not None and store.meta(pinned.key) is not None
    await store.aclose()
    store = stores(ssd=await open_ssd(root, budget_bytes=3 * footprint), config=config)
    await store.open()
    store.pin(pinned.key)
    keys = sorted(store.keys())
    with pytest.raises(BudgetExceeded):  # after the restart: three protected records, nothing to evict
        await store.put(rec(20, size=size, kind=opaque), Durability.LOCAL)
    assert sorted(store.keys()) == keys
    store.unpin(pinned.key)
    assert (await store.put(rec(21, size=size, kind=opaque), Durability.LOCAL)).evicted == ((pinned.key, SSD),)


async def test_pins_survive_budget_pressure(stores: Callable[..., TieredStore]) -> None:
    store = stores(host=host_tier(3))
    recs = [rec(i) for i in range(6)]
    await store.put(recs[0], pin=True)
    await store.put(recs[1])
    await store.put(recs[2])
    assert (await store.put(recs[3])).evicted == ((recs[1].key, HOST),)
    assert store.pin(recs[3].key)
    assert (await store.put(recs[4])).evicted == ((recs[2].key, HOST),)
    assert store.pin(recs[4].key)
    with pytest.raises(BudgetExceeded) as info:
        await store.put(recs[5])
    budget = 3 * HOST_FOOTPRINT
    assert str(info.value) == (
        f"host tier budget of {budget} B cannot fit {HOST_FOOTPRINT} B for record {recs[5].key.hex()}: "
        f"{budget} B resident, {budget} B of it pinned, unacknowledged or the only durable copy; "
        "unpin or evict records, or raise the host budget")
    assert (info.value.tier, info.value.budget_bytes, info.value.need_bytes) == (HOST, budget, HOST_FOOTPRINT)
    assert sorted(store.keys()) == sorted(r.key for r in recs[:5] if r is not recs[1] and r is not recs[2])
    store.unpin(recs[3].key)
    assert (await store.put(recs[5])).evicted == ((recs[3].key, HOST),)
    assert store.meta(recs[0].key).tiers == {HOST}  # type: ignore[union-attr]


async def test_local_records_are_never_evicted_for_room(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    ssd = await open_ssd(tmp_path / "ssd")
    footprint = ssd.footprint(rec(0))
    await ssd.aclose()
    store = stores(ssd=await open_ssd(tmp_path / "ssd", budget_bytes=2 * footprint))
    await store.put(rec(1), Durability.LOCAL)
    await store.put(rec(2), Durability.LOCAL)
    with pytest.raises(BudgetExceeded, match=f"ssd tier budget of {2 * footprint} B cannot fit"):
        await store.put(rec(3), Durability.LOCAL)
    with pytest.raises(BudgetExceeded):
        await store.put(rec(3))  # a MEMORY put may not push out LOCAL data either
    assert len(list((tmp_path / "ssd").rglob("*.rec"))) == 2


async def test_a_record_too_large_for_the_tier_evicts_nothing(stores: Callable[..., TieredStore]) -> None:
    store = stores(host=host_tier(2))
    await store.put(rec(1))
    with pytest.raises(BudgetExceeded):
        await store.put(rec(2, size=3 * PAGE))
    assert store.keys() == [rec(1).key]


async def test_explicit_evict(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    store = stores(host=host_tier(4), ssd=await open_ssd(tmp_path / "ssd"))
    r = rec(1)
    await store.put(r, Durability.LOCAL, pin=True)
    assert await store.evict(r.key) == frozenset()  # pinned
    assert await store.evict(r.key, force=True) == {HOST, SSD}
    assert store.meta(r.key) is None and await store.get(r.key) is None
    assert list((tmp_path / "ssd").rglob("*.rec")) == []


# ----- namespaces ---------------------------------------------------------------------------------

async def test_records_of_another_fingerprint_or_tenant_are_never_returned(
        stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    store = stores(host=host_tier(4), ssd=await open_ssd(tmp_path / "ssd"))
    theirs = rec(1, fp=OTHER_FP)
    bobs = rec(2, tenant=BOB)
    await store.put(theirs, Durability.LOCAL)
    await store.put(bobs, Durability.LOCAL)
    assert await store.get(theirs.key, expect_fingerprint=FP) is None
    assert await store.get(bobs.key, expect_tenant=ALICE) is None
    assert await store.evict(theirs.key, [HOST]) == {HOST}
    assert await store.get(theirs.key, expect_fingerprint=FP, expect_tenant=ALICE) is None  # from SSD too
    assert (await store.get(theirs.key, expect_fingerprint=OTHER_FP)) is not None
    assert (await store.get(bobs.key, expect_tenant=BOB)) is not None


# ----- the policy boundary in the store ------------------------------------------------------------

class EvictsPinned(LRUPolicy):
    name = "evicts-pinned"

    def __init__(self, victim: RecordKey) -> None:
        self.victim = victim

    def decide_eviction(self, candidates: list[StateMeta], need_bytes: int, tier: TierCost) -> list[RecordKey]:  # type: ignore[override]
        return [self.victim]


async def test_a_policy_that_evicts_a_pin_is_overruled(
        stores: Callable[..., TieredStore], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="statestore.policy")
    recs = [rec(i) for i in range(3)]
    store = stores(host=host_tier(2), policy=EvictsPinned(recs[0].key))
    await store.put(recs[0], pin=True)
    await store.put(recs[1])
    assert (await store.put(recs[2])).evicted == ((recs[1].key, HOST),)
    assert "policy evicts-pinned: decide_eviction chose" in caplog.records[0].getMessage()


# ----- concurrency ---------------------------------------------------------------------------------

async def test_concurrent_puts_into_a_full_ssd_all_land_and_accounting_stays_exact(
        stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    import asyncio

    root = tmp_path / "ssd"
    probe = await open_ssd(tmp_path / "probe")
    footprint = probe.footprint(rec(0))
    await probe.aclose()
    store = stores(ssd=await open_ssd(root, budget_bytes=3 * footprint))
    recs = [rec(i) for i in range(12)]
    results = await asyncio.gather(*(store.put(r) for r in recs))
    assert all(res.tiers == {SSD} for res in results)
    kept = {p.name.removesuffix(".rec") for p in root.rglob("*.rec")}
    assert len(kept) == 3 and kept == {k.hex() for k in store.keys()}
    evicted = [k for res in results for k, _ in res.evicted]
    assert len(evicted) == len(set(evicted)) == 9
    entry = ssd_module().INDEX_ENTRY_BYTES
    assert store.stats()[SSD].resident_bytes == ssd_bytes_on_disk(root, entry) == 3 * footprint


async def test_mixed_kinds_under_pressure_keep_host_accounting_exact(stores: Callable[..., TieredStore]) -> None:
    """Two kinds with their own pages and multi-page slabs: free pages stranded in one kind's
    slab make the tier refuse a put the arithmetic allows; the store frees more and retries."""
    idx = 2
    host = HostTier(40_000, {KV: PAGE, idx: 1024}, slab_bytes=4 * PAGE)
    store = stores(host=host)
    for i in range(60):
        kind = KV if i % 3 else idx
        r = rec(i, kind=kind, size=PAGE if kind == KV else 1000)
        result = await store.put(r)
        assert result.tiers == {HOST}
        usage = host.usage()
        assert usage.resident_bytes + host.pools.free_page_bytes == host.pools.held_bytes <= 40_000
    held_keys = {k for k in store.keys()}
    assert await host.contains(sorted(held_keys)) == [True] * len(held_keys)
    assert host.usage().num_records == len(held_keys)
    assert sum(s.num_records for s in store.stats()[HOST].by_kind.values()) == len(held_keys)


# ----- reads into a reader's own layout (GetRecords frames) ----------------------------------------

def in_two(header: bytes, n: int) -> list[tuple[bytes, int, int]]:
    return [(b"H", 0, n // 2), (b"T", n // 2, n)]


async def test_get_slices_serves_host_hits_as_slices_and_anything_else_as_get_does(
        stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    store = stores(host=host_tier(4), ssd=await open_ssd(tmp_path / "ssd"))
    r, local, bobs = rec(1), rec(2), rec(3, tenant=BOB)
    await store.put(r)
    await store.put(local, Durability.LOCAL)
    await store.put(bobs)
    got = await store.get_slices(r.key, in_two, expect_tenant=ALICE)
    assert isinstance(got, tuple)
    header, pieces = got
    assert header.block_key == r.header.block_key and pieces == [b"H" + r.payload[:PAGE // 2], b"T" + r.payload[PAGE // 2:]]
    before = store.meta(r.key).access_count  # type: ignore[union-attr]
    await store.get_slices(r.key, in_two)
    assert store.meta(r.key).access_count == before + 1  # type: ignore[union-attr]  # a hit, as `get` counts it
    assert store.stats()[HOST].by_kind[KV].hits == 2
    assert await store.get_slices(bobs.key, in_two, expect_tenant=ALICE) is None  # another tenant's: a miss
    assert await store.get_slices(rec(9).key, in_two) is None
    # Only on SSD: the Record, promoted into the host as `get` does; the next read is slices again.
    assert await store.evict(local.key, [HOST]) == {HOST}
    from_ssd = await store.get_slices(local.key, in_two)
    assert isinstance(from_ssd, Record) and from_ssd.payload == local.payload
    assert isinstance(await store.get_slices(local.key, in_two), tuple)


async def test_get_slices_never_serves_a_corrupt_host_copy(stores: Callable[..., TieredStore], tmp_path: Path) -> None:
    host = host_tier(4)
    store = stores(host=host, ssd=await open_ssd(tmp_path / "ssd"))
    r, only_ram = rec(1), rec(2)
    await store.put(r, Durability.LOCAL)
    await store.put(only_ram)
    for key in (r.key, only_ram.key):  # flip a byte under each record in RAM
        alloc = host._index[key].alloc
        host.pools.pool_for(KV).write(alloc.page_ids, b"\x00" * (PAGE - 1) + b"\x01")
    got = await store.get_slices(r.key, in_two)
    assert isinstance(got, Record) and got.payload == r.payload  # the SSD copy, verified
    assert await store.get_slices(only_ram.key, in_two) is None  # no good copy anywhere: a miss
    assert store.meta(r.key).tiers == {HOST, SSD}  # type: ignore[union-attr]  # promoted again from the good copy
    assert isinstance(await store.get_slices(r.key, in_two), tuple)
    assert store.meta(only_ram.key) is None or HOST not in store.meta(only_ram.key).tiers  # type: ignore[union-attr]
