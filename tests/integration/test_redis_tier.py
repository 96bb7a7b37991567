"""Redis tier against real servers: the shared one, private ones that die and come back, a Cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
import socket
from typing import Any

import pytest
from redis.asyncio import Redis

from redis.crc import key_slot
from tiers.record import Record, encode_record, make_record
from tiers.redis import PER_KEY_OVERHEAD_BYTES, RedisTier

pytestmark = pytest.mark.redis
RedisProcess = Any  # tests/conftest.py's RedisProcess (conftest modules are not imported by name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rec(i: int, size: int = 64, *, kind: int = 1) -> Record:
    block_key = hashlib.sha256(f"redis-{i}".encode()).digest()
    return make_record(kind, 1, hashlib.shake_256(block_key + bytes([kind])).digest(size),
                       model_fingerprint=b"F" * 16, tenant_id=b"T" * 16, block_key=block_key,
                       token_start=256 * i, token_end=256 * (i + 1))


def assert_same(got: Record | None, want: Record) -> None:
    assert got is not None
    assert got.payload == want.payload
    assert dataclasses.replace(got.header, stored_length=0, flags=0) == want.header


async def eventually(check: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Await `check()` until it is truthy (the tier's cooldown delays the first retry)."""
    deadline = time.monotonic() + timeout_s
    while not await check():  # type: ignore[misc]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def raw(redis_url: str, prefix: str) -> AsyncIterator[Redis]:
    """A plain client on the shared server; removes every key of the test's prefix at teardown."""
    async with Redis.from_url(redis_url) as client:
        yield client
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await client.delete(*keys)


@pytest.fixture
async def tier(redis_url: str, prefix: str, raw: Redis) -> AsyncIterator[RedisTier]:
    t = RedisTier(redis_url, prefix=prefix)
    yield t
    await t.aclose()


async def test_one_key_per_record_holding_the_encoded_record(tier: RedisTier, raw: Redis, prefix: str) -> None:
    record = rec(1, 1000, kind=3)
    assert await tier.put(record)
    name = f"{prefix}:{{{record.header.block_key.hex()}}}:3"
    assert tier.redis_key(record.key) == name and tier.record_key(name) == record.key
    assert [k async for k in raw.scan_iter(match=f"{prefix}:*")] == [name.encode()]
    assert await raw.get(name) == encode_record(record)
    assert await raw.ttl(name) == -1
    assert tier.footprint(record) == len(encode_record(record)) + len(name) + PER_KEY_OVERHEAD_BYTES


async def test_kinds_of_one_block_share_a_cluster_slot(tier: RedisTier) -> None:
    """The hash tag is the block key: every kind of a block maps to one slot (one shard),
    while different blocks spread."""
    assert len({key_slot(tier.redis_key(rec(7, kind=k).key).encode()) for k in (1, 2, 3, 4, 5)}) == 1
    assert len({key_slot(tier.redis_key(rec(i).key).encode()) for i in range(20)}) > 15


async def test_corrupt_or_misplaced_value_is_deleted_and_missed(tier: RedisTier, raw: Redis,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    a, b = rec(1, 500), rec(2, 500)
    assert await tier.put(a) and await tier.put(b)
    damaged = bytearray(encode_record(a))
    damaged[300] ^= 0x01
    await raw.set(tier.redis_key(a.key), bytes(damaged))
    await raw.set(tier.redis_key(b.key), encode_record(a))  # a valid record under the wrong key
    with caplog.at_level(logging.WARNING, logger="tiers.redis"):
        assert await tier.get_many([a.key, b.key]) == [None, None]
    assert "payload checksum mismatch" in caplog.text
    assert "record key does not match the key it was stored under" in caplog.text
    assert await raw.exists(tier.redis_key(a.key), tier.redis_key(b.key)) == 0
    assert tier.usage().num_records == 0


async def test_scan_learns_what_another_node_wrote_and_drops_garbage(redis_url: str, tier: RedisTier,
                                                                      raw: Redis, prefix: str) -> None:
    records = [rec(i, 100 * i, kind=1 + i % 2) for i in range(12)]
    assert await tier.put_many(records) == [True] * 12
    garbage = f"{prefix}:{{{'ab' * 32}}}:1"
    await raw.set(garbage, b"SSR\x01 not really")
    other_node = RedisTier(redis_url, prefix=prefix)
    try:
        result = await other_node.scan()
        assert sorted(h.key for h in result.headers) == sorted(r.key for r in records)
        assert result.discarded == [f"{garbage}: truncated header: 15 of 168 bytes (deleted)"]
        assert await raw.exists(garbage) == 0
        assert other_node.usage() == dataclasses.replace(tier.usage(), healthy=True)
        assert other_node.usage().resident_bytes == sum(other_node.footprint(r) for r in records)
    finally:
        await other_node.aclose()


async def test_ttl_expiry(redis_url: str, prefix: str, raw: Redis) -> None:
    tier = RedisTier(redis_url, prefix=prefix, ttl_s=1)
    try:
        record = rec(1)
        assert await tier.put(record)
        assert 0 < await raw.pttl(tier.redis_key(record.key)) <= 1000
        assert_same(await tier.get(record.key), record)
        await asyncio.sleep(1.1)
        assert await tier.get(record.key) is None
        assert await tier.contains([record.key]) == [False]
        assert tier.usage().num_records == 0  # learned on the miss
    finally:
        await tier.aclose()


async def test_budget_refuses_what_does_not_fit(redis_url: str, prefix: str, raw: Redis) -> None:
    probe = RedisTier(redis_url, prefix=prefix)
    a, b = rec(1, 1000), rec(2, 1000)
    tier = RedisTier(redis_url, prefix=prefix, budget_bytes=probe.footprint(a) + probe.footprint(b) - 1)
    try:
        assert await tier.put(a) is True
        assert await tier.put(b) is False
        assert await raw.exists(tier.redis_key(b.key)) == 0
        assert await tier.put_many([b, rec(1, 900)]) == [False, True]
    finally:
        await tier.aclose()
        await probe.aclose()


async def test_put_sends_header_and_payload_as_one_value(tier: RedisTier, raw: Redis, redis_url: str,
                                                         prefix: str) -> None:
    """Puts pack their SETs by hand (the value as two buffers): the stored value is byte for
    byte the encoded record, with and without a TTL, alone and in a batch."""
    records = [rec(i, size) for i, size in enumerate([0, 1, 5999, 6001, 300_000])]
    assert await tier.put(records[0]) is True
    assert await tier.put_many(records[1:]) == [True] * 4
    for r in records:
        assert await raw.get(tier.redis_key(r.key)) == encode_record(r)
    expiring = RedisTier(redis_url, prefix=prefix, ttl_s=100)
    try:
        batch = [rec(7, 70_000), rec(8, 10)]
        assert await expiring.put_many(batch) == [True, True]
        for r in batch:
            assert await raw.get(expiring.redis_key(r.key)) == encode_record(r)
            assert 0 < await raw.ttl(expiring.redis_key(r.key)) <= 100
    finally:
        await expiring.aclose()


@pytest.mark.parametrize("bulk_reads", [True, False], ids=["own-reader", "redis-py"])
async def test_large_values_go_out_in_groups_and_come_back_whole(raw: Redis, redis_url: str, prefix: str,
                                                                bulk_reads: bool) -> None:
    """Above 8 MiB a SET batch is written in groups; a value comes back byte for byte the
    encoded record, read in place by the tier's own reader or, without it, as GETRANGE pieces
    in one transaction. A value replaced by one of another length since the tier learned its
    size is read whole, and a key gone since is a miss."""
    tier = RedisTier(redis_url, prefix=prefix, bulk_reads=bulk_reads)
    try:
        assert tier.bulk_reads is bulk_reads
        big = [rec(1, (9 << 20) + 12_345), rec(2, 3 << 20), rec(3, 7 << 20)]  # the batch is ~19 MiB
        assert await tier.put_many(big) == [True] * 3
        for r in big:
            assert await raw.get(tier.redis_key(r.key)) == encode_record(r)
            assert_same(await tier.get(r.key), r)
        for got, r in zip(await tier.get_many([r.key for r in big]), big):
            assert_same(got, r)
        other = RedisTier(redis_url, prefix=prefix)  # another node rewrites record 1, 1 MiB longer
        try:
            longer = rec(1, (10 << 20) + 12_345)
            assert longer.key == big[0].key and await other.put(longer)
        finally:
            await other.aclose()
        assert_same(await tier.get(big[0].key), longer)  # the stale size: read whole, still exact
        await raw.delete(tier.redis_key(big[0].key))
        assert await tier.get(big[0].key) is None
    finally:
        await tier.aclose()


async def test_own_reader_values_of_every_size_are_exact_read_only_views(tier: RedisTier) -> None:
    """GET and MGET through the tier's own reader, values around the sizes where it changes how
    it reads (its 64 KiB scratch buffer, the 16 KiB direct-read threshold) mixed with misses in
    one MGET: each payload exact, kept as a read-only view of the buffer it was read into."""
    assert tier.bulk_reads
    sizes = [0, 1, 4095, (16 << 10) - 200, (16 << 10) + 1, (64 << 10) - 170, 64 << 10, (64 << 10) + 1, 3 << 20]
    records = [rec(i, n) for i, n in enumerate(sizes)]
    assert await tier.put_many(records) == [True] * len(records)
    missing = [rec(1000 + i).key for i in range(3)]
    keys = [missing[0], *[r.key for r in records[:4]], missing[1], *[r.key for r in records[4:]], missing[2]]
    got = await tier.get_many(keys)
    want: list[Record | None] = [None, *records[:4], None, *records[4:], None]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert_same(g, w)
            assert isinstance(g.payload, memoryview) and g.payload.readonly
    for r in records:
        assert_same(await tier.get(r.key), r)
    assert await tier.get(missing[0]) is None


async def test_own_reader_authenticates_selects_the_db_and_survives_a_killed_connection(
        redis_process_factory: Callable[..., RedisProcess]) -> None:
    """A password and a db in the URL hold for the tier's own reader as for redis-py; a wrong
    password is an outage (misses, health flag), never an exception; a connection Redis closes
    while it sits idle is replaced on the next read, which still hits."""
    server = redis_process_factory()
    async with Redis(port=server.port) as admin:  # (set after start: the factory's readiness probe has no password)
        await admin.config_set("requirepass", "s3cret")
    url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
    tier = RedisTier(url, prefix="auth")
    try:
        assert tier.bulk_reads
        records = [rec(i, 100_000) for i in range(3)]
        assert await tier.put_many(records) == [True] * 3
        async with Redis.from_url(url) as db3, Redis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/0") as db0:
            assert await db3.exists(tier.redis_key(records[0].key)) == 1
            assert await db0.exists(tier.redis_key(records[0].key)) == 0
            assert_same(await tier.get(records[0].key), records[0])  # the reader's connection is open now
            assert await db3.client_kill_filter(_type="normal", skipme=True) >= 1
        assert_same(await tier.get(records[1].key), records[1])
        for got, want in zip(await tier.get_many([r.key for r in records]), records):
            assert_same(got, want)
        assert tier.healthy
    finally:
        await tier.aclose()
    wrong = RedisTier(f"redis://:nope@127.0.0.1:{server.port}/3", prefix="auth", bulk_reads=True)
    try:
        assert await wrong.get(records[0].key) is None
        assert wrong.healthy is False
    finally:
        await wrong.aclose()


async def test_a_refused_set_is_false_and_the_connection_recovers(
        redis_process_factory: Callable[..., RedisProcess], caplog: pytest.LogCaptureFixture) -> None:
    """An error reply in the middle of a batch (OOM on a full Redis) fails the batch cleanly:
    the connection, whose later replies were never read, is dropped, not reused."""
    server = redis_process_factory("--maxmemory", str(4 << 20), "--maxmemory-policy", "noeviction")
    tier = RedisTier(server.url, prefix="oom", max_connections=1)
    try:
        big = [rec(i, 1 << 20) for i in range(8)]
        with caplog.at_level(logging.WARNING, logger="tiers.redis"):
            assert await tier.put_many(big) == [False] * 8
        assert "redis put refused: command not allowed when used memory > 'maxmemory'" in caplog.text
        assert tier.healthy is True  # an answer, not an outage
        async with Redis.from_url(server.url) as client:
            await client.flushdb()
        small = rec(100, 1000)
        assert await tier.put(small) is True  # the single pooled connection works again
        assert_same(await tier.get(small.key), small)
    finally:
        await tier.aclose()


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_outage_degrades_to_misses_and_recovers(redis_process_factory: Callable[..., RedisProcess],
                                                      how: str) -> None:
    server = redis_process_factory(persistent=True)
    tier = RedisTier(server.url, prefix="outage", cooldown_s=0.2, max_cooldown_s=0.4)
    try:
        records = [rec(i, 2000) for i in range(5)]
        assert await tier.put_many(records[:4]) == [True] * 4
        assert await tier.put(records[4]) is True
        keys = [r.key for r in records]
        getattr(server, how)()

        assert await tier.get(keys[0]) is None
        assert tier.healthy is False and tier.usage().healthy is False
        started = time.monotonic()
        assert await tier.put(rec(9)) is False
        assert await tier.put_many([rec(10)]) == [False]
        assert await tier.get_many(keys) == [None] * 5
        assert await tier.contains(keys) == [False] * 5
        assert await tier.prefix_hits(keys) == 0
        assert await tier.delete(keys[0]) is False
        assert (await tier.scan()).headers == []
        assert await tier.probe() is False  # within the cooldown: no call at all
        assert time.monotonic() - started < 0.5, "calls during the cooldown must not wait on the network"
        assert await tier.check_health() is False

        server.start()  # same port, same directory: the AOF brings the data back
        await eventually(tier.probe)  # health comes back without any get or put reaching for it
        assert tier.healthy is True and tier.usage().healthy is True
        assert await tier.get(keys[0]) is not None
        for got, want in zip(await tier.get_many(keys), records):
            assert_same(got, want)
        assert await tier.put(rec(9)) is True
    finally:
        await tier.aclose()


async def test_a_hung_server_times_out_instead_of_blocking(redis_process_factory: Callable[..., RedisProcess]) -> None:
    server = redis_process_factory()
    tier = RedisTier(server.url, prefix="hung", socket_timeout_s=0.2, cooldown_s=0.2)
    try:
        record = rec(1)
        assert await tier.put(record)
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert await tier.get(record.key) is None
            assert time.monotonic() - started < 1.0
            assert tier.healthy is False
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        await eventually(lambda: tier.check_health())
        assert_same(await tier.get(record.key), record)
    finally:
        await tier.aclose()


def _start_cluster(factory: Callable[..., RedisProcess], num_masters: int = 3) -> list[RedisProcess]:
    # Explicit bus ports: the default (port + 10000) overflows for high ephemeral ports.
    nodes = [factory("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-port", str(free_port()), "--cluster-node-timeout", "2000")
             for _ in range(num_masters)]
    subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                    "--cluster-replicas", "0", "--cluster-yes"],
                   check=True, timeout=10, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return nodes


async def _wait_cluster_ok(nodes: list[RedisProcess], timeout_s: float = 8.0) -> None:
    deadline = time.monotonic() + timeout_s
    for node in nodes:
        async with Redis(port=node.port) as client:
            while (await client.execute_command("CLUSTER INFO")).get("cluster_state") != "ok":
                assert time.monotonic() < deadline, f"cluster not ok on port {node.port}"
                await asyncio.sleep(0.05)


@pytest.mark.timeout(15)
async def test_cluster_put_get_contains_get_many_scan(redis_process_factory: Callable[..., RedisProcess]) -> None:
    nodes = _start_cluster(redis_process_factory)
    await _wait_cluster_ok(nodes)
    tier = RedisTier(f"redis+cluster://127.0.0.1:{nodes[0].port}", prefix="cl")
    try:
        assert tier.cluster
        records = [rec(i, 3000, kind=k) for i in range(10) for k in (1, 2, 3)]
        assert await tier.put_many(records[:15]) == [True] * 15
        for r in records[15:]:
            assert await tier.put(r)
        keys = [r.key for r in records]
        assert await tier.contains(keys + [rec(99).key]) == [True] * 30 + [False]
        assert await tier.prefix_hits(keys) == 30
        for got, want in zip(await tier.get_many(keys), records):
            assert_same(got, want)
        assert_same(await tier.get(keys[4]), records[4])
        # Each node holds some of the keys, and all kinds of a block sit on one node.
        owners: dict[bytes, set[int]] = {}
        for node in nodes:
            async with Redis(port=node.port) as client:
                names = [k async for k in client.scan_iter(match="cl:*")]
                assert names, f"node {node.port} holds none of the keys"
                for name in names:
                    owners.setdefault(name.split(b":")[1], set()).add(node.port)
        assert len(owners) == 10 and all(len(ports) == 1 for ports in owners.values())
        result = await tier.scan()
        assert result.discarded == [] and sorted(h.key for h in result.headers) == sorted(keys)
        assert await tier.delete(keys[0]) is True and await tier.get(keys[0]) is None
    finally:
        await tier.aclose()


async def _move_slot(nodes: list[RedisProcess], slot: int) -> tuple[int, int]:
    """Move `slot` and its keys to another master, as `redis-cli --cluster reshard` does for
    each slot (IMPORTING / MIGRATING, MIGRATE, SETSLOT NODE everywhere); returns (from, to) ports."""
    owners = []
    for node in nodes:
        async with Redis(port=node.port) as client:
            if await client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot):
                owners.append(node.port)
    assert len(owners) == 1, owners
    src = owners[0]
    dst = next(n.port for n in nodes if n.port != src)
    async with Redis(port=src) as s, Redis(port=dst) as d:
        src_id = (await s.execute_command("CLUSTER", "MYID")).decode()
        dst_id = (await d.execute_command("CLUSTER", "MYID")).decode()
        await d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        await s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while names := await s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            await s.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *names)
    for node in nodes:
        async with Redis(port=node.port) as client:
            await client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    return src, dst


@pytest.mark.timeout(20)
async def test_cluster_reads_large_values_per_node_and_follows_a_moved_slot(
        redis_process_factory: Callable[..., RedisProcess], caplog: pytest.LogCaptureFixture) -> None:
    """On a Cluster the tier's own reader reads each key from the node redis-py's slot map
    names: large values exact through get and get_many, beside small ones. After a slot moves
    to another node, the first get is redirected (MOVED), served through redis-py, which
    refreshes its map, and later reads go to the new owner's reader: exact, no miss, healthy."""
    nodes = _start_cluster(redis_process_factory)
    await _wait_cluster_ok(nodes)
    tier = RedisTier(f"redis+cluster://127.0.0.1:{nodes[0].port}", prefix="clr")
    try:
        assert tier.cluster and tier.bulk_reads
        large = [rec(i, 200_000 + i) for i in range(6)]
        small = [rec(100 + i, 3000) for i in range(6)]
        assert await tier.put_many(large + small) == [True] * 12
        for r in large + small:
            assert_same(await tier.get(r.key), r)
        mixed = [x for pair in zip(large, small) for x in pair]
        for got, want in zip(await tier.get_many([r.key for r in mixed] + [rec(999).key]), mixed + [None]):
            if want is None:
                assert got is None
            else:
                assert_same(got, want)

        moved = large[0]
        src, dst = await _move_slot(nodes, key_slot(tier.redis_key(moved.key).encode()))
        with caplog.at_level(logging.DEBUG, logger="tiers.redis"):
            assert_same(await tier.get(moved.key), moved)  # redirected: through redis-py
        assert f"127.0.0.1:{src} answered MOVED" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="tiers.redis"):
            assert_same(await tier.get(moved.key), moved)  # the refreshed map: the new owner's reader
        assert "reading through redis-py" not in caplog.text
        assert ("127.0.0.1", dst) in (tier._node_readers or {})
        for got, want in zip(await tier.get_many([r.key for r in large]), large):
            assert_same(got, want)
        assert tier.healthy
    finally:
        await tier.aclose()


@pytest.mark.parametrize("bulk_reads", [True, False], ids=["own-reader", "redis-py"])
async def test_zstd_kinds_are_stored_compressed_and_read_back_exact(redis_url: str, prefix: str, raw: Redis,
                                                                   bulk_reads: bool) -> None:
    tier = RedisTier(redis_url, prefix=prefix, zstd_kinds={1: 3}, bulk_reads=bulk_reads)
    try:
        compressible = make_record(1, 1, b"statestore " * 20_000, model_fingerprint=b"F" * 16, tenant_id=b"T" * 16,
                                   block_key=hashlib.sha256(b"zstd").digest())
        plain = rec(2, 50_000, kind=2)  # a kind without zstd
        assert await tier.put_many([compressible, plain]) == [True, True]
        stored = await raw.strlen(tier.redis_key(compressible.key))
        assert stored < len(compressible.payload) // 10
        assert await raw.strlen(tier.redis_key(plain.key)) == len(encode_record(plain))
        for got, want in zip(await tier.get_many([compressible.key, plain.key]), [compressible, plain]):
            assert_same(got, want)
        assert_same(await tier.get(compressible.key), compressible)
    finally:
        await tier.aclose()


class _MisbehavingRedis:
    """A TCP peer that answers the tier's own reader the way a broken server or a proxy might:
    `reply(request) -> (bytes to send, then close?)`."""

    def __init__(self, reply: Callable[[bytes], tuple[bytes, bool]]) -> None:
        self._reply = reply
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while request := await reader.read(65536):
                    data, close = self._reply(request)
                    writer.write(data)
                    await writer.drain()
                    if close:
                        break
            except (ConnectionError, asyncio.CancelledError):
                pass  # the tier dropped the connection, or the test is over
            finally:
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.mark.parametrize("case", ["cut mid-value", "not RESP", "too long a value", "wrong type"])
async def test_own_reader_turns_a_broken_reply_into_a_miss(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """A peer that cuts a value short, speaks something else, announces an absurd length or
    answers a GET with an integer: each get is a miss (an outage for a cut connection, a refusal
    otherwise), never an exception or a hang. A connection whose reply broke the protocol is
    never reused; one whose reply was whole (the integer) is."""
    replies = {
        "cut mid-value": (b"$100\r\nonly part of it", True),
        "not RESP": (b"HTTP/1.1 400 Bad Request\r\n\r\n", False),
        "too long a value": (b"$99999999999\r\n", False),
        "wrong type": (b":42\r\n", False),
    }
    peer = _MisbehavingRedis(lambda request: replies[case])
    async with peer as url:
        tier = RedisTier(url, prefix="broken", socket_timeout_s=1.0, cooldown_s=0.01, max_cooldown_s=0.01)
        try:
            assert tier.bulk_reads
            with caplog.at_level(logging.WARNING, logger="tiers.redis"):
                started = time.monotonic()
                assert await tier.get(rec(1).key) is None
                await asyncio.sleep(0.02)  # past the cooldown
                assert await tier.get_many([rec(1).key, rec(2).key]) == [None, None]
                assert time.monotonic() - started < 1.0
            assert peer.connections == (1 if case == "wrong type" else 2)
            if case == "cut mid-value":
                assert tier.healthy is False and "redis closed the connection" in caplog.text
            else:
                assert "redis get refused" in caplog.text
        finally:
            await tier.aclose()


async def test_own_reader_over_a_unix_socket(redis_process_factory: Callable[..., RedisProcess],
                                             tmp_path: Path) -> None:
    """A `unix://` URL (a Redis on the same host without TCP): the reader connects to the socket
    and selects the URL's db, as redis-py does for the writes."""
    path = tmp_path / "redis.sock"
    redis_process_factory("--unixsocket", str(path), "--unixsocketperm", "700")
    tier = RedisTier(f"unix://{path}?db=2", prefix="unix")
    try:
        assert tier.bulk_reads
        records = [rec(i, 300_000) for i in range(3)]
        assert await tier.put_many(records) == [True] * 3
        for got, want in zip(await tier.get_many([r.key for r in records]), records):
            assert_same(got, want)
        assert_same(await tier.get(records[0].key), records[0])
        async with Redis(unix_socket_path=str(path), db=2) as db2:
            assert await db2.exists(tier.redis_key(records[0].key)) == 1
    finally:
        await tier.aclose()
