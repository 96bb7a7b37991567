"""The hbm tier's pool logic and accounting, on CPU tensors (allow_cpu=True)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tiers.hbm import HbmTier, HbmUnavailable, SlotPool, plan_slots
from tiers.pools import record_overhead_bytes
from tiers.record import FINGERPRINT_BYTES, KEY_BYTES, TENANT_BYTES, make_record

GLOBAL, INDEX = 1, 2


def _record(kind: int, n: int, fill: int, key: int = 0):
    payload = bytes([fill]) * n
    return make_record(kind, 0, payload, model_fingerprint=b"f" * FINGERPRINT_BYTES, tenant_id=b"t" * TENANT_BYTES,
                       block_key=key.to_bytes(KEY_BYTES, "big"), token_start=0, token_end=256)


def _tier(slots: int = 4) -> HbmTier:
    return HbmTier({GLOBAL: 100, INDEX: 40}, {GLOBAL: slots, INDEX: slots}, device="cpu", allow_cpu=True,
                   staging_bytes=250, fill_threads=2)


def test_slot_pool_lowest_first_and_double_free() -> None:
    pool = SlotPool(8, 5, torch.device("cpu"))
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1])
    assert pool.allocate(2) == [1, 3]
    assert pool.allocate(2) is None and pool.num_free_slots == 1  # refused: nothing taken
    with pytest.raises(AssertionError, match="slot 4 is not allocated"):
        pool.free([4])
    assert pool.tensor.shape == (5, 8) and pool.pool_bytes == 40


def test_without_cuda_the_tier_is_unavailable_with_a_clear_error() -> None:
    with pytest.raises(HbmUnavailable, match="CUDA memory; got device cpu"):
        HbmTier({GLOBAL: 8}, {GLOBAL: 1}, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(HbmUnavailable, match="needs a CUDA device"):
            HbmTier({GLOBAL: 8}, {GLOBAL: 1}, device="cuda")


def test_put_get_and_exact_accounting() -> None:
    tier = _tier(slots=6)
    recs = [_record(GLOBAL, 100, 7, 1), _record(GLOBAL, 60, 8, 2), _record(INDEX, 40, 9, 3), _record(GLOBAL, 250, 5, 4)]
    events = tier.load(recs)  # the 250 B record (3 pages) is larger than a staging buffer: copied directly
    assert all(e is not None for e in events)
    assert [tier.slot_ids(r.key) for r in recs] == [(0,), (1,), (0,), (2, 3, 4)]
    assert tier.pools[GLOBAL].num_free_slots == 1
    for r in recs:
        got = asyncio.run(tier.get(r.key))
        assert got is not None and got.payload == r.payload and got.header.kind == r.header.kind
    usage = tier.usage()
    g = usage.by_kind[GLOBAL]
    # 100 B in 1 page, 60 B in 1 page (40 B padding), 250 B in 3 pages (50 B padding)
    assert g.num_records == 3 and g.payload_bytes == 410
    assert g.resident_bytes == 500 + 2 * record_overhead_bytes(1) + record_overhead_bytes(3)
    assert usage.by_kind[INDEX].resident_bytes == 40 + record_overhead_bytes(1)
    assert tier.footprint(recs[3]) == 300 + record_overhead_bytes(3)
    assert usage.budget_bytes == tier.pool_bytes == 6 * 100 + 6 * 40


def test_full_pool_refuses_and_keeps_the_old_copy() -> None:
    tier = _tier(slots=2)
    a = _record(GLOBAL, 100, 1, 1)
    assert asyncio.run(tier.put(a))
    big = _record(GLOBAL, 200, 2, 1)  # same key, needs 2 pages, only 1 free
    assert not asyncio.run(tier.put(big))
    assert asyncio.run(tier.get(a.key)).payload == a.payload
    assert asyncio.run(tier.delete(a.key)) and not asyncio.run(tier.delete(a.key))
    assert tier.usage().by_kind == {} and tier.pools[GLOBAL].num_free_slots == 2


def test_load_coalesces_runs_and_chunks_through_staging() -> None:
    """Ten records in a fresh pool take slots 0..9 and land byte-exact through 250 B staging chunks."""
    tier = HbmTier({GLOBAL: 100}, {GLOBAL: 12}, device="cpu", allow_cpu=True, staging_bytes=250, fill_threads=3)
    recs = [_record(GLOBAL, 100 - i, i + 1, i) for i in range(10)]
    tier.load(recs)
    assert [tier.slot_ids(r.key) for r in recs] == [(i,) for i in range(10)]
    for i, r in enumerate(recs):
        assert bytes(tier.payload_tensor(r.key).numpy()) == r.payload
    assert asyncio.run(tier.contains([recs[0].key, _record(GLOBAL, 1, 0, 99).key])) == [True, False]
    headers = asyncio.run(tier.scan()).headers
    assert sorted(h.block_key for h in headers) == sorted(r.header.block_key for r in recs)


def test_corrupted_page_is_a_miss() -> None:
    tier = _tier()
    r = _record(INDEX, 40, 3, 1)
    asyncio.run(tier.put(r))
    tier.pools[INDEX].tensor[tier.slot_ids(r.key)[0], 5] ^= 1
    assert asyncio.run(tier.get(r.key)) is None and tier.usage().by_kind == {}


def test_plan_slots_splits_by_share() -> None:
    slots = plan_slots(100 * 10**9, {GLOBAL: 184_320, INDEX: 43_520}, {GLOBAL: 720.0, INDEX: 170.0})
    assert min(slots.values()) // 512 == 857  # 128K-token sessions: the byte bound is 857.2
    with pytest.raises(ValueError, match="positive budget"):
        plan_slots(0, {GLOBAL: 1}, {GLOBAL: 1.0})


def test_pinned_host_tier_and_load_from_without_staging() -> None:
    """Pinned kinds live in slot pools (others in the inner HostTier); load_from copies slot runs."""
    from tiers.hbm import PinnedHostTier
    from tiers.host import HostTier

    host = PinnedHostTier(HostTier(1 << 20), {GLOBAL: 100, INDEX: 40}, {GLOBAL: 8, INDEX: 8}, pin=False)
    recs = [_record(GLOBAL, 100, i + 1, i) for i in range(5)] + [_record(INDEX, 40, 9, 10), _record(7, 33, 4, 11)]
    for r in recs:
        assert asyncio.run(host.put(r))
    assert host.pinned_entry(recs[0].key).slot_ids == (0,) and host.pinned_entry(recs[6].key) is None
    for r in recs:
        assert asyncio.run(host.get(r.key)).payload == r.payload
    u = host.usage()
    assert u.by_kind[GLOBAL].resident_bytes == 5 * (100 + record_overhead_bytes(1))
    assert u.by_kind[7].num_records == 1  # kept by the inner HostTier
    assert host.footprint(recs[0]) == 100 + record_overhead_bytes(1)
    tier = _tier(slots=6)
    events = tier.load_from(host, [r.key for r in recs])
    assert events[6] is None and all(e is not None for e in events[:6])
    assert [tier.slot_ids(r.key) for r in recs[:5]] == [(i,) for i in range(5)]
    for r in recs[:6]:
        assert asyncio.run(tier.get(r.key)).payload == r.payload  # checksum carried over from the host
    assert tier.usage().by_kind[GLOBAL].resident_bytes == 5 * (100 + record_overhead_bytes(1))
    assert asyncio.run(host.delete(recs[0].key)) and asyncio.run(host.get(recs[0].key)) is None


def test_load_from_many_keys_duplicates_and_misses() -> None:
    """200 keys in one call: every record lands bit-exactly, a key given twice is held once with
    the later copy, a key the host lacks gets None, and the accounting equals that of the records
    held."""
    from tiers.hbm import PinnedHostTier
    from tiers.host import HostTier

    host = PinnedHostTier(HostTier(1 << 20), {GLOBAL: 100, INDEX: 40}, {GLOBAL: 160, INDEX: 60}, pin=False)
    recs = [_record(GLOBAL, 100, i % 251, i) for i in range(150)] + [_record(INDEX, 40, i % 7, 1000 + i) for i in range(48)]
    for r in recs:
        assert asyncio.run(host.put(r))
    missing = _record(GLOBAL, 100, 3, 5000)
    keys = [r.key for r in recs] + [missing.key, recs[3].key]  # recs[3] twice
    tier = _tier(slots=200)
    events = tier.load_from(host, keys)
    assert len(events) == len(keys) and events[-2] is None and all(e is not None for i, e in enumerate(events) if i != 198)
    for r in recs:
        assert asyncio.run(tier.get(r.key)).payload == r.payload
    u = tier.usage()
    assert u.by_kind[GLOBAL].num_records == 150 and u.by_kind[INDEX].num_records == 48
    assert u.by_kind[GLOBAL].resident_bytes == 150 * (100 + record_overhead_bytes(1))
    assert tier.pools[GLOBAL].num_free_slots == 50  # the first copy of recs[3] gave its page back


def test_load_from_short_of_slots_loads_whole_chunks_and_says_which() -> None:
    """load_from copies a kind in growing chunks (FIRST_CHUNK, then twice that ... records); a
    chunk that does not fit is refused whole (None for its keys, nothing taken), the chunks
    before it stay loaded and bit-exact, and the accounting counts only those."""
    from tiers.hbm import FIRST_CHUNK, PinnedHostTier
    from tiers.host import HostTier

    fit = FIRST_CHUNK + 2 * FIRST_CHUNK  # the first two chunks; the third (8 records) finds 2 slots
    n = fit + 8
    host = PinnedHostTier(HostTier(1 << 20), {GLOBAL: 100, INDEX: 40}, {GLOBAL: n, INDEX: 8}, pin=False)
    recs = [_record(GLOBAL, 100, i % 251, i) for i in range(n)]
    for r in recs:
        assert asyncio.run(host.put(r))
    tier = _tier(slots=fit + 2)
    events = tier.load_from(host, [r.key for r in recs])
    assert all(e is not None for e in events[:fit]) and all(e is None for e in events[fit:])
    for r in recs[:fit]:
        assert asyncio.run(tier.get(r.key)).payload == r.payload
    assert asyncio.run(tier.contains([r.key for r in recs[fit:]])) == [False] * (n - fit)
    assert tier.usage().by_kind[GLOBAL].num_records == fit and tier.pools[GLOBAL].num_free_slots == 2


def test_load_from_a_key_twice_in_one_chunk_is_held_once() -> None:
    """The same key twice in one chunk: one record held (bit-exact), the earlier copy's page
    given back, and the accounting that of the records held."""
    from tiers.hbm import PinnedHostTier
    from tiers.host import HostTier

    host = PinnedHostTier(HostTier(1 << 20), {GLOBAL: 100, INDEX: 40}, {GLOBAL: 8, INDEX: 8}, pin=False)
    a, b = _record(GLOBAL, 100, 1, 1), _record(GLOBAL, 100, 2, 2)
    for r in (a, b):
        assert asyncio.run(host.put(r))
    tier = _tier(slots=6)
    events = tier.load_from(host, [a.key, b.key, a.key])
    assert all(e is not None for e in events)
    assert asyncio.run(tier.get(a.key)).payload == a.payload and asyncio.run(tier.get(b.key)).payload == b.payload
    assert tier.usage().by_kind[GLOBAL].num_records == 2 and tier.pools[GLOBAL].num_free_slots == 4
    assert tier.usage().by_kind[GLOBAL].resident_bytes == 2 * (100 + record_overhead_bytes(1))
    assert asyncio.run(tier.delete(a.key)) and tier.pools[GLOBAL].num_free_slots == 5


def test_load_from_interleaved_kinds_and_split_runs() -> None:
    """Keys whose kinds alternate (or whose kind comes back after another) take the index-list
    path, keys of each kind in one run take ranges: both load every record bit-exactly, with
    the same accounting."""
    from tiers.hbm import PinnedHostTier
    from tiers.host import HostTier

    host = PinnedHostTier(HostTier(1 << 20), {GLOBAL: 100, INDEX: 40}, {GLOBAL: 40, INDEX: 40}, pin=False)
    glob = [_record(GLOBAL, 100, i + 1, i) for i in range(12)]
    index = [_record(INDEX, 40, i + 3, 100 + i) for i in range(12)]
    for r in glob + index:
        assert asyncio.run(host.put(r))
    orders = {
        "alternating": [r for pair in zip(glob, index) for r in pair],
        "kind comes back": glob[:6] + index + glob[6:],
        "one run each": index + glob,
    }
    for name, order in orders.items():
        tier = _tier(slots=16)
        events = tier.load_from(host, [r.key for r in order])
        assert all(e is not None for e in events), name
        for r in order:
            assert asyncio.run(tier.get(r.key)).payload == r.payload, name
        u = tier.usage()
        assert u.by_kind[GLOBAL].num_records == 12 and u.by_kind[INDEX].num_records == 12, name
        assert u.by_kind[INDEX].resident_bytes == 12 * (40 + record_overhead_bytes(1)), name
