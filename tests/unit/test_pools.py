"""Per-kind page pools and the host tier: allocation, exact residency, budget, slab reuse."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.host import HostTier
from tiers.pools import (
    INDEX_BYTES_PER_PAGE,
    INDEX_ENTRY_BASE_BYTES,
    ByteBudget,
    PagePool,
    PerKindPools,
    SinglePagePool,
    page_bytes_for,
    record_overhead_bytes,
    uniform_page_layout,
)
from tiers.record import HEADER_SIZE, Record, make_record

KV, IDX, RING = 1, 2, 3
PAGES = {KV: 1024, IDX: 256, RING: 4096}


def make_rec(kind: int, n: int, tag: int = 0) -> Record:
    key = bytes([kind, tag]) + bytes(30)
    return make_record(kind, 0, bytes([tag % 256]) * n, model_fingerprint=b"f" * 16, tenant_id=b"t" * 16,
                       block_key=key)


def held_by_hand(pools: PerKindPools) -> int:
    """What the allocator really holds: every slab's bytes plus each live record's overhead."""
    slabs = sum(len(s.buf) if s.buf is not None else s.num_pages * p.page_bytes
                for p in pools._pools.values() for s in p._slabs if s is not None)
    overhead = sum(t.footprint_bytes for t in pools._tally.values()) - sum(
        (p.num_used_pages * p.page_bytes) for p in pools._pools.values())
    return slabs + overhead


# ----- PagePool ------------------------------------------------------------------------------

def test_page_pool_allocates_fresh_pages_in_order_and_grows_slabs_lazily() -> None:
    budget = ByteBudget(64 * 100)
    pool = PagePool(100, budget, slab_bytes=400)  # 4 pages per slab
    assert pool.num_slabs == 0 and budget.held_bytes == 0
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_slabs == 1 and budget.held_bytes == 400
    assert pool.allocate(3) == [3, 4, 5]  # fills slab 0, opens slab 1
    assert pool.num_slabs == 2 and pool.num_free_pages == 2 and budget.held_bytes == 800


def test_page_pool_reuses_freed_pages_before_growing() -> None:
    budget = ByteBudget(10_000)
    pool = PagePool(100, budget, slab_bytes=400)
    a = pool.allocate(2)
    b = pool.allocate(2)
    pool.free(a)
    assert pool.allocate(2) == a  # freed pages come back in order (one run), same slab
    assert pool.num_slabs == 1 and budget.held_bytes == 400
    del b


def test_large_records_round_trip_through_runs_of_pages() -> None:
    """A record of many small pages is copied by runs of consecutive pages, also after reuse."""
    budget = ByteBudget(1 << 20)
    pool = PagePool(64, budget, slab_bytes=64 * 64)
    data = bytes(range(256)) * 40  # 10,240 B: 160 pages over 3 slabs
    ids = pool.allocate(160)
    pool.write(ids, data)
    assert pool.read(ids, len(data)) == data
    assert len(pool._runs(ids, len(data))) == 3  # one run per slab
    pool.free(ids)
    again = pool.allocate(160)
    pool.write(again, data[::-1])
    assert pool.read(again, len(data)) == data[::-1]
    # Fragmented: pages 10..19 freed in the middle of a held run, then reused with fresh ones.
    pool.free(again[10:20])
    mixed = pool.allocate(30)
    assert mixed[:10] == again[10:20] and mixed[10] != again[19] + 1  # not one range
    pool.write(mixed, data[:30 * 64])
    assert pool.read(mixed, 30 * 64) == data[:30 * 64]
    assert len(pool._runs(mixed, 30 * 64)) >= 2


def test_page_pool_returns_an_empty_slab_to_the_budget() -> None:
    budget = ByteBudget(10_000)
    pool = PagePool(100, budget, slab_bytes=400)
    first = pool.allocate(4)
    second = pool.allocate(1)  # slab 1
    assert budget.held_bytes == 800
    pool.free(second)
    assert pool.num_slabs == 1 and budget.held_bytes == 400
    pool.free(first)
    assert pool.num_slabs == 0 and budget.held_bytes == 0
    assert pool.allocate(1) == [0]  # slot 0 reused


def test_page_pool_reuses_a_released_slabs_memory_outside_the_budget() -> None:
    budget = ByteBudget(10_000)
    pool = PagePool(100, budget, slab_bytes=400)
    ids = pool.allocate(4)
    buf = pool._slabs[0].buf  # type: ignore[union-attr]
    pool.free(ids)
    assert pool.num_slabs == 0 and budget.held_bytes == 0 and pool.arena_bytes == 0  # the budget got it back
    assert pool.allocate(4) == [0, 1, 2, 3]
    assert pool._slabs[0].buf is buf and budget.held_bytes == 400  # the same (warm) memory, held again
    pool.free(pool.allocate(4))  # a second slab: one spare is kept, the other mapping is closed
    pool.free([0, 1, 2, 3])
    assert budget.held_bytes == 0 and pool._spare is not None


def test_page_pool_maps_fresh_memory_when_the_spare_has_another_size() -> None:
    budget = ByteBudget(700)
    pool = PagePool(100, budget, slab_bytes=400)
    full = pool.allocate(4)
    cut = pool.allocate(3)  # the budget allows a 300 B slab only
    spare = pool._slabs[1].buf  # type: ignore[union-attr]
    pool.free(cut)  # the 300 B slab's memory is the spare
    pool.free(full)
    assert pool._spare is spare and budget.held_bytes == 0
    pool.allocate(4)  # a 400 B slab: the spare does not fit, fresh memory
    buf = pool._slabs[0].buf  # type: ignore[union-attr]
    assert buf is not spare and len(buf) == 400 and pool._spare is None  # type: ignore[arg-type]


def test_page_pool_last_slab_is_cut_to_the_budget() -> None:
    budget = ByteBudget(650)
    pool = PagePool(100, budget, slab_bytes=400)
    pool.allocate(4)
    assert pool.allocate(2) == [4, 5]  # slab 1 gets the 2 pages the budget still allows
    assert budget.held_bytes == 600 and pool.num_free_pages == 0


def test_page_pool_double_free_is_caught() -> None:
    pool = PagePool(100, ByteBudget(1000), slab_bytes=400)
    ids = pool.allocate(2)
    pool.free(ids[:1])
    pool.free(ids[1:])  # slab released
    with pytest.raises(AssertionError, match="is not allocated"):
        pool.free(ids[:1])


# ----- PoolSet ------------------------------------------------------------------------------

def test_record_pages_and_overheads_are_exact() -> None:
    pools = PerKindPools(1 << 20, PAGES, default_page_bytes=512, slab_bytes=8192)
    a = pools.reserve(KV, 2500)  # ceil(2500 / 1024) = 3 pages
    assert a is not None and len(a.page_ids) == 3
    assert a.footprint_bytes == 3 * 1024 + HEADER_SIZE + INDEX_ENTRY_BASE_BYTES + 3 * INDEX_BYTES_PER_PAGE
    b = pools.reserve(IDX, 256)  # exactly one page: no padding
    c = pools.reserve(99, 1)  # unknown kind: default page
    assert b is not None and c is not None and len(b.page_ids) == 1 and c.page_bytes == 512
    usage = pools.usage_by_kind()
    assert usage[KV].payload_bytes == 2500
    assert usage[KV].overhead_bytes == 3 * 1024 - 2500 + record_overhead_bytes(3)
    assert usage[IDX].overhead_bytes == record_overhead_bytes(1)
    assert pools.resident_bytes == sum(u.resident_bytes for u in usage.values())
    assert pools.resident_bytes + pools.free_page_bytes == pools.held_bytes == held_by_hand(pools)


def test_budget_refusal_leaves_nothing_behind() -> None:
    page = 1000
    overhead = record_overhead_bytes(1)
    pools = PerKindPools(3 * (page + overhead), {KV: page}, slab_bytes=page)  # one page per slab
    got = [pools.reserve(KV, page) for _ in range(3)]
    assert all(got)
    before = (pools.held_bytes, pools.resident_bytes, dict(pools.usage_by_kind()))
    assert not pools.can_reserve(KV, 1)
    assert pools.reserve(KV, 1) is None
    assert (pools.held_bytes, pools.resident_bytes, dict(pools.usage_by_kind())) == before
    pools.release(got[0])
    assert pools.reserve(KV, page) is not None


def test_reserve_many_is_all_or_nothing() -> None:
    pools = PerKindPools(10_000, {KV: 1000}, slab_bytes=1000)
    assert pools.reserve_many(KV, 1000, 20) is None
    assert pools.held_bytes == 0
    bulk = pools.reserve_many(KV, 1000, 5)
    assert bulk is not None and len(set(bulk.page_ids)) == 5 and bulk.pages_per_record == 1
    assert pools.usage_by_kind()[KV].num_records == 5
    assert pools.resident_bytes == 5 * (1000 + record_overhead_bytes(1)) == bulk.footprint_bytes
    pools.release(bulk)
    assert pools.held_bytes == 0 and pools.usage_by_kind() == {}


def test_release_restores_exact_accounting() -> None:
    pools = PerKindPools(1 << 20, PAGES, slab_bytes=8192)
    allocs = [pools.reserve(k, n) for k, n in [(KV, 100), (KV, 3000), (IDX, 10), (RING, 4096)]]
    for a in allocs:
        assert a is not None
        pools.release(a)
    assert pools.usage_by_kind() == {} and pools.resident_bytes == 0
    assert pools.held_bytes == 0 and pools.arena_bytes == 0  # every slab went back


def test_single_page_pool_pads_every_kind_to_the_largest_page() -> None:
    pools = SinglePagePool(1 << 20, 4096, slab_bytes=8192)
    a = pools.reserve(IDX, 256)
    assert a is not None and a.page_bytes == 4096
    assert pools.usage_by_kind()[IDX].overhead_bytes == 4096 - 256 + record_overhead_bytes(1)


def test_page_sizes_from_specs_and_vllm_uniform_layout() -> None:
    assert page_bytes_for(block_size=256, bytes_per_token=720) == 184_320
    assert page_bytes_for(block_size=256, bytes_per_sequence=2_703_360) == 2_703_360
    with pytest.raises(ValueError, match="not whole bytes"):
        page_bytes_for(block_size=3, bytes_per_token=0.5)
    # Qwen3-Next-like: 36 GDN layers of bf16 state, 12 attention layers of bf16 KV.
    layout = uniform_page_layout({KV: 24_576}, {RING: 39_518_208})
    assert layout.tokens_per_page == {KV: 1616}  # vLLM logs "Setting attention block size to 1616"
    assert layout.page_bytes == 1616 * 24_576


# ----- HostTier -----------------------------------------------------------------------------

async def test_host_tier_round_trip_and_exact_usage() -> None:
    tier = HostTier(1 << 20, PAGES, default_page_bytes=512, slab_bytes=8192)
    recs = [make_rec(KV, 2500, 1), make_rec(IDX, 256, 2), make_rec(RING, 4000, 3), make_rec(7, 0, 4)]
    for r in recs:
        before = tier.usage().resident_bytes
        assert await tier.put(r)
        assert tier.usage().resident_bytes - before == tier.footprint(r)  # the Tier invariant
    for r in recs:
        got = await tier.get(r.key)
        assert got is not None and got.payload == r.payload and got.key == r.key
    assert await tier.contains([recs[0].key, b"\x00" * 34]) == [True, False]
    usage = tier.usage()
    assert usage.num_records == 4
    assert usage.resident_bytes + tier.pools.free_page_bytes == tier.pools.held_bytes
    assert tier.pools.held_bytes == held_by_hand(tier.pools)
    assert len((await tier.scan()).headers) == 4
    assert await tier.delete(recs[0].key) and not await tier.delete(recs[0].key)
    assert await tier.get(recs[0].key) is None


async def test_host_tier_refuses_what_the_budget_cannot_fit_and_keeps_the_old_copy() -> None:
    page = 1024
    tier = HostTier(2 * (page + record_overhead_bytes(1)), {KV: page}, slab_bytes=page)
    a, b, c = make_rec(KV, page, 1), make_rec(KV, page, 2), make_rec(KV, page, 3)
    assert await tier.put(a) and await tier.put(b)
    assert not await tier.put(c)
    assert await tier.get(c.key) is None
    assert (await tier.get(a.key)).payload == a.payload  # type: ignore[union-attr]
    assert tier.usage().resident_bytes == tier.pools.held_bytes == tier.usage().budget_bytes


async def test_host_tier_put_takes_the_pages_a_payload_was_staged_in() -> None:
    """`stage` copies a payload into pages reserved at once; the put of a record with that very
    payload object (another header: a server re-stamps the tenant) takes them, already written,
    and usage is exact throughout; pages no put took go back with `unstage`; a budget without
    room stages nothing; `occupancy` leaves staged pages out (the store counts them at the put)."""
    page = 1024
    tier = HostTier(3 * (page + record_overhead_bytes(1)), {KV: page}, slab_bytes=page)
    old = make_rec(KV, page, 1)
    assert await tier.put(old)
    payload = bytearray(b"n" * page)
    new = Record(old.header, payload)  # a new version of the same key
    resident = tier.usage().resident_bytes
    assert tier.stage(new) and not tier.stage(new)  # (staged once)
    assert tier.usage().resident_bytes == resident + tier.footprint(new)  # held, and reported as held
    assert tier.occupancy()[1] == resident  # but not counted twice by a store about to put it
    payload[:] = b"x" * page  # what was staged is what the put stores: it was copied at staging
    restamped = Record(replace(old.header, tenant_id=b"u" * 16), payload)  # (its checksum: of the bytes staged)
    assert await tier.put(restamped)
    got = await tier.get(old.key)
    assert got is not None and got.payload == b"n" * page and got.header.tenant_id == b"u" * 16
    assert tier.usage().resident_bytes == resident == tier.occupancy()[1]  # the old copy's pages were freed
    assert tier.usage().resident_bytes + tier.pools.free_page_bytes == tier.pools.held_bytes

    spare = make_rec(KV, page, 2)
    assert tier.stage(spare)
    tier.unstage(spare.payload)
    tier.unstage(spare.payload)  # (a second time: nothing)
    assert tier.usage().resident_bytes == resident and await tier.get(spare.key) is None
    fill = [make_rec(KV, page, 3), make_rec(KV, page, 4)]
    assert await tier.put(fill[0]) and await tier.put(fill[1])
    assert not tier.stage(make_rec(KV, page, 5))  # the budget is full: nothing staged, nothing held
    assert tier.usage().resident_bytes == tier.pools.held_bytes == tier.usage().budget_bytes


async def test_host_tier_reuses_freed_pages() -> None:
    tier = HostTier(1 << 20, {KV: 1024}, slab_bytes=4096)
    a, b, c = make_rec(KV, 2048, 1), make_rec(KV, 1024, 2), make_rec(KV, 2048, 3)
    await tier.put(a)
    await tier.put(b)
    pages_a = tier._index[a.key].alloc.page_ids
    await tier.delete(a.key)
    await tier.put(c)
    assert sorted(tier._index[c.key].alloc.page_ids) == sorted(pages_a)
    assert tier.pools.arena_bytes == 4096  # still the one slab
    assert (await tier.get(c.key)).payload == c.payload  # type: ignore[union-attr]


async def test_host_tier_corrupted_page_is_a_miss() -> None:
    tier = HostTier(1 << 20, {KV: 1024}, slab_bytes=4096)
    r = make_rec(KV, 1000, 1)
    await tier.put(r)
    alloc = tier._index[r.key].alloc
    tier.pools.pool_for(KV).write(alloc.page_ids, b"\xff" * 1000)  # flip the bytes under it
    assert await tier.get(r.key) is None
    assert tier.usage().num_records == 0 and tier.pools.held_bytes == 0


# ----- reads straight into a caller's layout (GetRecords frames) --------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_read_slices_are_prefixed_slices_of_the_record_over_any_pages(data: st.DataObject) -> None:
    """Each slice is its prefix then exactly those record bytes, whichever slabs and runs of
    pages they cross (fragmented allocations included)."""
    pool = PagePool(64, ByteBudget(1 << 20), slab_bytes=64 * 8)
    pool.allocate(data.draw(st.integers(0, 12)))
    hole = pool.allocate(data.draw(st.integers(0, 5)))
    pool.allocate(3)
    pool.free(hole)  # the record's first pages may come from this hole, the rest from elsewhere
    length = data.draw(st.integers(0, 1500))
    ids = pool.allocate(pool.num_pages_for(length))
    payload = os.urandom(length)
    pool.write(ids, payload)
    cuts = sorted(data.draw(st.lists(st.integers(0, length), max_size=5)))
    bounds = [0, *cuts, length]
    slices = [(data.draw(st.binary(max_size=6)), a, b) for a, b in zip(bounds, bounds[1:])]
    out = pool.read_slices(ids, length, slices)
    assert out == [prefix + payload[a:b] for prefix, a, b in slices]
    assert all(type(piece) is bytes for piece in out)
    seen: list[bytes] = []  # `each` sees each piece's record bytes, without its prefix, in order
    assert pool.read_slices(ids, length, slices, lambda view: seen.append(bytes(view))) == out
    assert seen == [payload[a:b] for _, a, b in slices]


def test_read_slices_refuse_bytes_outside_the_record() -> None:
    pool = PagePool(64, ByteBudget(1 << 20), slab_bytes=512)
    ids = pool.allocate(2)
    with pytest.raises(ValueError, match="outside a record"):
        pool.read_slices(ids, 100, [(b"", 50, 101)])


def halves(header: bytes, n: int) -> list[tuple[bytes, int, int]]:
    return [(b"<" + header[:2], 0, n // 2), (b">", n // 2, n)]


async def test_host_tier_reads_a_record_into_a_callers_slices_verified() -> None:
    tier = HostTier(1 << 20, {KV: 1024}, slab_bytes=4096)
    r = make_record(KV, 0, os.urandom(3000), model_fingerprint=b"f" * 16, tenant_id=b"t" * 16,
                    block_key=b"k" * 32)
    await tier.put(r)
    got = tier.read_slices(r.key, halves)
    assert got is not None
    header, pieces, checksum = got
    assert replace(header, stored_length=0) == r.header and checksum == r.payload_sum()
    assert pieces == [b"<SS" + r.payload[:1500], b">" + r.payload[1500:]]  # the header starts with its magic
    assert tier.read_slices(make_rec(KV, 10, 9).key, halves) is None  # not held: a miss
    with pytest.raises(ValueError, match="cover"):  # a layout must cover the payload, once, in order
        tier.read_slices(r.key, lambda h, n: [(b"", 0, n - 1)])
    with pytest.raises(ValueError, match="in order"):
        tier.read_slices(r.key, lambda h, n: [(b"", 0, 10), (b"", 5, n)])
    assert tier.usage().num_records == 1  # a refused layout changes nothing


@pytest.mark.parametrize("layout", [lambda h, n: [(b"x", 0, n)], halves])
async def test_host_tier_corrupted_page_is_a_miss_for_slices_too(layout) -> None:  # type: ignore[no-untyped-def]
    tier = HostTier(1 << 20, {KV: 1024}, slab_bytes=4096)
    r = make_rec(KV, 1000, 1)
    await tier.put(r)
    alloc = tier._index[r.key].alloc
    tier.pools.pool_for(KV).write(alloc.page_ids, r.payload[:999] + b"\xfe")  # one byte flipped
    assert tier.read_slices(r.key, layout) is None
    assert tier.usage().num_records == 0 and tier.pools.held_bytes == 0  # dropped, never served


def _pool_state(pool: PagePool) -> list[object]:
    slabs = [None if s is None else (s.num_pages, s.next_fresh, list(s.freed), s.num_used) for s in pool._slabs]
    return [slabs, pool.num_used_pages, pool.num_held_pages, sorted(set(pool._open))]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 10)), min_size=1, max_size=30))
def test_freeing_a_run_at_once_leaves_the_pool_as_freeing_it_page_by_page(ops: list[tuple[int, int]]) -> None:
    """`PagePool.free` of an allocation that is one run frees it in a few list operations
    (`_free_run`); the pool must end as if each page had been freed alone, last page first:
    the same free lists, counts, open slabs and the same pages handed out next."""
    pools = [PagePool(64, ByteBudget(1 << 20), slab_bytes=64 * 16) for _ in range(2)]
    held: list[list[int]] = []
    for want, pick in ops:
        if held and pick % 3 == 0:
            ids = held.pop(pick % len(held))
            pools[0].free(ids)  # a run takes the fast path
            for pid in reversed(ids):
                pools[1].free([pid])  # one page at a time: the step-by-step path
        else:
            got = [p.allocate(want) for p in pools]
            assert got[0] == got[1]
            held.append(got[0])
        assert _pool_state(pools[0]) == _pool_state(pools[1])
    for ids in held:
        pools[0].free(tuple(ids))
        for pid in reversed(ids):
            pools[1].free([pid])
        assert _pool_state(pools[0]) == _pool_state(pools[1])
    assert pools[0].allocate(20) == pools[1].allocate(20)


def test_freeing_pages_not_allocated_is_an_error() -> None:
    pool = PagePool(64, ByteBudget(1 << 20), slab_bytes=64 * 16)
    ids = pool.allocate(4)
    pool.free(ids)
    with pytest.raises(AssertionError, match="not allocated"):
        pool.free(ids)
