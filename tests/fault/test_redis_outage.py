"""Redis dies (SIGKILL) and comes back while two nodes serve load.

Node A and node B are in-process servers (own data directories, one service secret) on one
private redis-server with an append-only file fsynced on every write. While Redis is down:

- clients of either node see no error except on SHARED writes: MEMORY and LOCAL puts succeed,
  reads of SHARED records are hits where a node holds a copy and misses elsewhere, lookups,
  stats and health answer;
- a SHARED put and a SHARED checkpoint fail with UNAVAILABLE and a message naming Redis;
- Stats reports the redis tier unhealthy.

After Redis restarts on its data, node B (which never held a copy) reads every SHARED record
acknowledged before the outage and resumes the session checkpointed at SHARED exactly.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest

from statestore.client import ServiceError, StateStoreClient
from statestore.config import ServiceConfig
from statestore.server import StateStoreServer
from statestore.types import Durability
from tests.fault.nodes import SECRET
from tiers.record import Record, make_record

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

RedisProcess = Any  # tests/conftest.py's RedisProcess
MESSAGES = [[random.Random(s).randrange(256) for _ in range(n)] for s, n in ((11, 90), (12, 57))]


def make_server(data_dir: Path, redis_url: str) -> StateStoreServer:
    data_dir.mkdir(parents=True)
    (data_dir / "secret").write_bytes(SECRET)
    return StateStoreServer(ServiceConfig(listen="127.0.0.1:0", data_dir=data_dir, engine_preset="mini",
                                          redis_url=redis_url, redis_prefix="outage", block_size=64, grace_s=0))


def block_record(server: StateStoreServer, i: int) -> Record:
    rng = random.Random(i)
    return make_record(1, 1, rng.randbytes(4096), model_fingerprint=server.adapter.model_fingerprint,
                       tenant_id=bytes(16), block_key=rng.randbytes(32), token_start=64 * i, token_end=64 * (i + 1))


async def eventually(check: Callable[[], Coroutine[Any, Any, bool]], timeout_s: float = 15.0) -> float:
    """Await `check()` until it is true; the seconds it took."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.1)
    return time.monotonic() - start


class Load:
    """Background traffic on one node that must never see an error: MEMORY/LOCAL puts, reads
    of the SHARED records (a hit must be the exact record), lookups and stats."""

    def __init__(self, client: StateStoreClient, shared: list[Record], writes: bool) -> None:
        self.client, self.shared, self.writes = client, shared, writes
        self.rounds = self.hits = self.misses = 0
        self.errors: list[BaseException] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        c = self.client
        while not self.stop.is_set():
            try:
                if self.writes:
                    model = self.shared[0].header.model_fingerprint
                    mine = [make_record(1, 1, os.urandom(1024), model_fingerprint=model, tenant_id=bytes(16),
                                        block_key=os.urandom(32)) for _ in range(2)]
                    await c.put_records(mine[:1], Durability.MEMORY)
                    await c.put_records(mine[1:], Durability.LOCAL)
                got = await c.get_records([r.key for r in self.shared])
                for g, want in zip(got, self.shared):
                    if g is None:
                        self.misses += 1
                    else:
                        assert g.payload == want.payload and g.key == want.key
                        self.hits += 1
                await c.lookup([r.key[2:] for r in self.shared], kinds=[1])
                await c.stats()
                self.rounds += 1
            except Exception as exc:  # noqa: BLE001 - collected, asserted empty by the test
                self.errors.append(exc)
            await asyncio.sleep(0.01)


async def redis_healthy(c: StateStoreClient) -> bool:
    return next(t.healthy for t in (await c.stats()).tiers if t.tier == "redis")


async def test_redis_outage_degrades_to_misses_and_refuses_shared_writes(
        tmp_path: Path, redis_process_factory: Callable[..., RedisProcess]) -> None:
    redis = redis_process_factory(persistent=True)
    a, b = make_server(tmp_path / "a", redis.url), make_server(tmp_path / "b", redis.url)
    t0 = time.monotonic()
    await asyncio.gather(a.start(), b.start())
    print(f"\nstarted in {time.monotonic() - t0:.1f} s")
    try:
        async with StateStoreClient(f"127.0.0.1:{a.port}") as ca, StateStoreClient(f"127.0.0.1:{b.port}") as cb:
            await run_outage(redis, a, ca, cb)
    finally:
        await asyncio.gather(a.stop(0), b.stop(0))


async def run_outage(redis: RedisProcess, a: StateStoreServer, ca: StateStoreClient, cb: StateStoreClient) -> None:
    # Before: SHARED records and a SHARED checkpoint, acknowledged.
    shared = [block_record(a, i) for i in range(8)]
    assert all("redis" in p.tiers for p in await ca.put_records(shared, Durability.SHARED))
    await ca.create_session("agent")
    for m in MESSAGES:
        await ca.append("agent", m)
    assert (await ca.checkpoint("agent", Durability.SHARED)).num_tokens == 147
    await ca.create_session("uninterrupted")
    for m in MESSAGES:
        await ca.append("uninterrupted", m)
    expected = await ca.generate("uninterrupted", 8)
    assert await redis_healthy(ca)

    # B's load reads half of the records (and so caches them); the other half it never touches
    # before the outage is over, so it can only find them in Redis.
    load_a, load_b = Load(ca, shared, writes=True), Load(cb, shared[:4], writes=False)
    tasks = [asyncio.create_task(load.run()) for load in (load_a, load_b)]
    try:
        await asyncio.sleep(0.3)
        redis.kill()
        await during_outage(a, ca, cb, shared)
        redis.start()  # same port, same directory: the append-only file is replayed
        took = await eventually(lambda: _shared_put_works(a, ca))
        assert await redis_healthy(ca)
        await asyncio.sleep(0.2)
    finally:
        for load in (load_a, load_b):
            load.stop.set()
        await asyncio.gather(*tasks)
    print(f"\nload A: {load_a.rounds} rounds, {load_a.hits} hits, {load_a.misses} misses; load B: {load_b.rounds} "
          f"rounds, {load_b.hits} hits, {load_b.misses} misses; SHARED puts back {took:.2f} s after the restart")
    assert load_a.errors == [] and load_b.errors == []
    assert load_a.rounds >= 5 and load_b.rounds >= 5
    assert load_b.hits > 0 and load_a.misses == 0  # A holds copies of what it wrote: no miss at all

    # After: B reads from Redis what was acknowledged before the outage ...
    await eventually(lambda: redis_healthy(cb))
    assert (await cb.lookup([r.key[2:] for r in shared], kinds=[1])).per_tier["redis"] == 8
    got = await cb.get_records([r.key for r in shared])
    assert [g.payload if g else None for g in got] == [r.payload for r in shared]
    for r in shared[4:]:  # indexed by B from its Redis hit
        assert "redis" in (await cb.inspect(r.key)).tiers
    # ... and resumes the SHARED checkpoint exactly.
    report = await cb.resume("agent", "exact")
    assert (report.mode, report.num_tokens, report.persisted_tokens) == ("exact", 147, 147)
    assert await cb.generate("agent", 8) == expected


async def during_outage(a: StateStoreServer, ca: StateStoreClient, cb: StateStoreClient, shared: list[Record]) -> None:
    extra = block_record(a, 100)
    for attempt in range(3):  # the first reaches for Redis, the next ones hit the tier's cooldown
        with pytest.raises(ServiceError) as info:
            await ca.put_records([extra], Durability.SHARED)
        assert info.value.code is grpc.StatusCode.UNAVAILABLE, info.value
        assert "SHARED put" in info.value.message and "redis tier is unavailable" in info.value.message
    assert not await redis_healthy(ca)
    await ca.create_session("during")
    await ca.append("during", MESSAGES[0])
    with pytest.raises(ServiceError) as info:
        await ca.checkpoint("during", Durability.SHARED)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and "redis" in info.value.message
    assert (await ca.checkpoint("during", Durability.LOCAL)).num_tokens == 90  # the local tiers still work
    assert await cb.get_records([r.key for r in shared[4:]]) == [None] * 4  # misses, not errors
    assert (await cb.lookup([r.key[2:] for r in shared[4:]], kinds=[1])).combined_blocks == 0
    assert await ca.health() == "SERVING" and await cb.health() == "SERVING"
    await asyncio.sleep(0.5)


async def _shared_put_works(a: StateStoreServer, ca: StateStoreClient) -> bool:
    try:
        await ca.put_records([block_record(a, 200)], Durability.SHARED)
        return True
    except ServiceError as exc:
        assert exc.code is grpc.StatusCode.UNAVAILABLE, exc
        return False
