"""One behaviour for every tier: the same scenarios run against each registered medium.

Tiers are built through the registry (`tiers.registry.open_tier`), so a tier whose module
exists joins automatically; `host` is skipped while `tiers.host` is not importable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from tiers.base import Tier
from tiers.record import Record, RecordHeader, make_record
from tiers import registry
from tiers.registry import TierConfig, build_tier, open_tier, register_tier, registered_tiers

SIZES = [0, 1, 4096, 1 << 20]
# "redis" reads through the tier's own reader (`tiers.redis_bulk`), "redis-py" with it off, as
# on a TLS URL: both read paths must behave alike.
TIERS = ["ssd", pytest.param("redis", marks=pytest.mark.redis), pytest.param("redis-py", marks=pytest.mark.redis),
         "host"]


def rec(i: int, size: int = 64, *, kind: int = 1, fill: int | None = None) -> Record:
    """Deterministic record number `i` (same i and kind: same key)."""
    block_key = hashlib.sha256(f"block-{i}".encode()).digest()
    payload = bytes([fill]) * size if fill is not None else hashlib.shake_256(block_key + bytes([kind])).digest(size)
    return make_record(kind, 1, payload, model_fingerprint=b"F" * 16, tenant_id=b"T" * 16, block_key=block_key,
                       token_start=256 * i, token_end=256 * (i + 1), entry_count=size)


def as_built(header: RecordHeader) -> RecordHeader:
    return dataclasses.replace(header, stored_length=0, flags=0)


def assert_same(got: Record | None, want: Record) -> None:
    assert got is not None
    assert got.payload == want.payload
    assert as_built(got.header) == want.header


async def _drop_prefix(url: str, prefix: str) -> None:
    async with Redis.from_url(url) as client:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await client.delete(*keys)


@pytest.fixture(params=TIERS)
async def tier(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tier]:
    name = request.param
    if name == "ssd":
        config = TierConfig("ssd", path=tmp_path / "ssd")
    elif name in ("redis", "redis-py"):
        url = request.getfixturevalue("redis_url")
        config = TierConfig("redis", url=url, prefix=f"test-{uuid.uuid4().hex[:12]}",
                            options={"bulk_reads": name == "redis"})
    else:
        if importlib.util.find_spec(f"tiers.{name}") is None:
            pytest.skip(f"tier {name!r}: module tiers.{name} does not exist yet")
        config = TierConfig(name, budget_bytes=256 << 20)
    t = await open_tier(config)
    try:
        yield t
    finally:
        await t.aclose()
        if config.name == "redis":
            await _drop_prefix(config.url, config.prefix)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", SIZES, ids=["0B", "1B", "4KiB", "1MiB"])
async def test_put_get_round_trip_is_bit_exact(tier: Tier, size: int) -> None:
    record = rec(7, size)
    assert await tier.put(record) is True
    assert_same(await tier.get(record.key), record)
    assert await tier.get(rec(8).key) is None


async def test_overwrite_replaces_record_and_usage(tier: Tier) -> None:
    first, second = rec(1, 100, fill=1), rec(1, 5000, fill=2)
    assert first.key == second.key
    assert await tier.put(first) and await tier.put(second)
    assert_same(await tier.get(first.key), second)
    usage = tier.usage()
    assert usage.num_records == 1
    assert usage.resident_bytes == tier.footprint(second)


async def test_delete(tier: Tier) -> None:
    record = rec(3, 300)
    await tier.put(record)
    assert await tier.delete(record.key) is True
    assert await tier.get(record.key) is None
    assert await tier.contains([record.key]) == [False]
    assert await tier.delete(record.key) is False
    assert tier.usage().resident_bytes == 0 and tier.usage().num_records == 0


async def test_contains_batch_and_prefix_hits(tier: Tier) -> None:
    chain = [rec(i, 128) for i in range(6)]
    for i in (0, 1, 2, 4):
        assert await tier.put(chain[i])
    keys = [r.key for r in chain]
    assert await tier.contains(keys) == [True, True, True, False, True, False]
    assert await tier.contains([]) == []
    assert await tier.prefix_hits(keys) == 3
    assert await tier.prefix_hits(keys[3:]) == 0


async def test_usage_grows_by_exactly_footprint_per_kind(tier: Tier) -> None:
    assert tier.usage().resident_bytes == 0
    records = [rec(0, 0), rec(1, 1, kind=2), rec(2, 4096), rec(3, 70_000, kind=2)]
    for record in records:
        before = tier.usage().resident_bytes
        assert await tier.put(record)
        assert tier.usage().resident_bytes - before == tier.footprint(record)
        # the store's fast read of the totals agrees with the snapshot
        assert tier.occupancy() == (tier.usage().budget_bytes, tier.usage().resident_bytes)
    assert await tier.delete(records[2].key)
    assert tier.occupancy() == (tier.usage().budget_bytes, tier.usage().resident_bytes)
    assert await tier.put(records[2])
    usage = tier.usage()
    assert sorted(usage.by_kind) == [1, 2]
    assert usage.by_kind[1].num_records == 2 and usage.by_kind[2].num_records == 2
    assert usage.by_kind[2].resident_bytes == tier.footprint(records[1]) + tier.footprint(records[3])
    assert usage.by_kind[2].payload_bytes >= 70_001  # the payload is counted, not just overhead
    assert usage.resident_bytes == sum(tier.footprint(r) for r in records)


async def test_scan_finds_what_was_put(tier: Tier) -> None:
    records = [rec(i, 32 * i, kind=1 + i % 3) for i in range(10)]
    for record in records:
        assert await tier.put(record)
    result = await tier.scan()
    assert result.discarded == []
    assert sorted(h.key for h in result.headers) == sorted(r.key for r in records)
    by_key = {h.key: h for h in result.headers}
    for record in records:
        assert as_built(by_key[record.key]) == record.header


async def test_put_many_get_many(tier: Tier) -> None:
    records = [rec(i, 1000 + i) for i in range(8)]
    assert await tier.put_many(records) == [True] * 8
    got = await tier.get_many([r.key for r in records] + [rec(99).key])
    for g, want in zip(got, records):
        assert_same(g, want)
    assert got[-1] is None


async def test_same_block_different_kinds_are_different_records(tier: Tier) -> None:
    a, b = rec(5, 10, kind=1), rec(5, 20, kind=3)
    assert a.header.block_key == b.header.block_key and a.key != b.key
    assert await tier.put(a) and await tier.put(b)
    assert_same(await tier.get(a.key), a)
    assert_same(await tier.get(b.key), b)


def test_registry_names_every_tier_and_explains_unknown_names() -> None:
    assert {"host", "ssd", "redis"} <= set(registered_tiers())
    with pytest.raises(ValueError, match=r"unknown tier 'tape'; registered tiers: .*host.*redis.*ssd"):
        build_tier(TierConfig("tape"))
    with pytest.raises(ValueError, match="the ssd tier needs a path"):
        build_tier(TierConfig("ssd"))


def test_registry_refuses_a_class_that_is_not_a_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # restored after the test
    register_tier("not-a-tier", "tiers.record", "RecordHeader")
    with pytest.raises(TypeError, match="is not a subclass of tiers.base.Tier"):
        build_tier(TierConfig("not-a-tier"))
    with pytest.raises(ValueError, match="already registered"):
        register_tier("ssd", "tiers.host", "HostTier")
