"""Several statestore nodes share one Redis: a session checkpointed at SHARED durability on
node A resumes on node B.

Nodes are separate `statestore serve` processes (tests/fault/nodes.py) with their own data
directories (own SSD tier) and the same service secret, configured with the Redis URL through
STATESTORE_STORAGE_REDIS_URL: a private standalone redis-server, or a three-master Redis
Cluster on loopback (`redis+cluster://`). Node A answers an uninterrupted run of the same
conversation, which B's `exact` resume must continue token for token.

The kill test stops node A repeatedly (SIGSTOP) during a big checkpoint until Redis shows some
of the new checkpoint's records but still the previous manifest, then SIGKILLs it there: B must
see exactly the previous checkpoint and continue from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from redis.crc import key_slot

from statestore.client import ServiceError, StateStoreClient, SyncStateStoreClient
from statestore.sessions import MANIFEST_KIND, Manifest
from statestore.types import Durability
from tests.fault.nodes import BLOCK_SIZE, Node, NodeSet, RedisServer, node_set, start_all
from tests.proc import freeze, thaw
from tiers.record import decode_record, make_record_key

pytestmark = [pytest.mark.redis, pytest.mark.subprocess, pytest.mark.timeout(90)]

PREFIX = "mn"
GLOBAL_KV, INDEX_K, TOKENS = 1, 2, 5
RedisProcess = Any  # tests/conftest.py's RedisProcess


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeSet]:
    yield from node_set(tmp_path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Node, Node]]:
    """Nodes A and B on one private standalone Redis, shared by this module's tests (each
    start costs seconds on 2 cores); the kill test, which kills A, runs last."""
    if shutil.which("redis-server") is None:
        if os.environ.get("STATESTORE_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed but STATESTORE_REQUIRE_REDIS=1")
        pytest.skip("redis-server is not installed")
    base = tmp_path_factory.mktemp("pair")
    redis = RedisServer(base / "redis").start()
    nodes = NodeSet(base)
    try:
        a = nodes.make("node-a", redis_url=redis.url, redis_prefix=PREFIX)
        b = nodes.make("node-b", redis_url=redis.url, redis_prefix=PREFIX)
        start_all([a, b])
        yield redis, a, b
    finally:
        nodes.close()
        redis.kill()


def message(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


MESSAGES = [message(1, 150), message(2, 37), message(3, 101)]  # 288 tokens: 4 blocks of 64 + a tail of 32


async def reference(target: str, sid: str, messages: list[list[int]], n: int) -> list[int]:
    """An uninterrupted run: the same messages, then n greedy tokens."""
    async with StateStoreClient(target) as c:
        await c.create_session(sid)
        for m in messages:
            await c.append(sid, m)
        return await c.generate(sid, n)


# ----- Redis inspection ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_cluster(factory: Callable[..., RedisProcess]) -> list[RedisProcess]:
    """Three masters (test_redis_tier.py's recipe: explicit bus ports), slots assigned, state ok."""
    masters = [factory("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                       "--cluster-port", str(free_port()), "--cluster-node-timeout", "2000") for _ in range(3)]
    subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{m.port}" for m in masters),
                    "--cluster-replicas", "0", "--cluster-yes"],
                   check=True, timeout=20, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    for m in masters:
        with Redis(port=m.port) as client:
            while client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                assert time.monotonic() < deadline, f"cluster not ok on port {m.port}"
                time.sleep(0.05)
    return masters


def stored_keys(ports: list[int]) -> dict[str, tuple[int, bytes]]:
    """Every key of PREFIX on these servers: name -> (the port holding it, value)."""
    out: dict[str, tuple[int, bytes]] = {}
    for port in ports:
        with Redis(port=port) as client:
            for name in client.scan_iter(match=f"{PREFIX}:*", count=1000):
                value = client.get(name)
                assert value is not None
                out[name.decode()] = (port, value)
    return out


def split_name(name: str) -> tuple[str, int]:
    """'mn:{<hex>}:<kind>' -> (hex block key, kind)."""
    prefix, rest = name.split(":", 1)
    tag, kind = rest.rsplit(":", 1)
    assert prefix == PREFIX and tag.startswith("{") and tag.endswith("}"), name
    return tag[1:-1], int(kind)


def manifest_in_redis(ports: list[int], session_id: str) -> Manifest:
    """The session's manifest as Redis holds it (record checksums verified, JSON validated)."""
    manifests = [Manifest.from_bytes(decode_record(v).payload)
                 for name, (_, v) in stored_keys(ports).items() if split_name(name)[1] == MANIFEST_KIND]
    (manifest,) = [m for m in manifests if m.session_id == session_id]
    return manifest


# ----- A checkpoints, B resumes ------------------------------------------------------------------


@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_shared_checkpoint_on_node_a_resumes_exactly_on_node_b(
        topology: str, request: pytest.FixtureRequest, nodes: NodeSet,
        redis_process_factory: Callable[..., RedisProcess]) -> None:
    if topology == "cluster":
        masters = _start_cluster(redis_process_factory)
        ports = [m.port for m in masters]
        a = nodes.make("node-a", redis_url=f"redis+cluster://127.0.0.1:{ports[0]}", redis_prefix=PREFIX)
        b = nodes.make("node-b", redis_url=f"redis+cluster://127.0.0.1:{ports[0]}", redis_prefix=PREFIX)
        start_all([a, b])
    else:
        redis, a, b = request.getfixturevalue("pair")
        ports = [redis.port]

    async def on_a() -> tuple[list[int], list[Any]]:
        expected = await reference(a.target, "uninterrupted", MESSAGES, 12)
        reports = []
        async with StateStoreClient(a.target) as c:
            await c.create_session("agent")
            await c.append("agent", MESSAGES[0])
            reports.append(await c.checkpoint("agent", Durability.SHARED))
            for m in MESSAGES[1:]:
                await c.append("agent", m)
            reports.append(await c.checkpoint("agent", Durability.SHARED))
            assert (await c.stats()).tiers[-1].tier == "redis"
        return expected, reports

    expected, reports = asyncio.run(on_a())
    assert [(r.version, r.num_tokens, r.new_blocks) for r in reports] == [(1, 150, 2), (2, 288, 2)]

    # What Redis holds: 4 blocks x 2 kinds, the manifest, and v2's tail and tokens (v1's are deleted).
    keys = stored_keys(ports)
    manifest = manifest_in_redis(ports, "agent")
    assert (manifest.version, manifest.num_tokens, manifest.tail_start, manifest.tail_end) == (2, 288, 256, 288)
    by_tag: dict[str, dict[int, str]] = {}
    for name in keys:
        tag, kind = split_name(name)
        by_tag.setdefault(tag, {})[kind] = name
    for block in manifest.block_keys:  # both kinds of every block, under one hash tag
        assert sorted(by_tag[block]) == [GLOBAL_KV, INDEX_K]
    others = sorted(sorted(kinds) for tag, kinds in by_tag.items() if tag not in manifest.block_keys)
    assert others == [[GLOBAL_KV, INDEX_K, TOKENS], [MANIFEST_KIND]]  # v2's tail and token ids under one tag
    assert len(keys) == 8 + 3 + 1
    # Keys of one record group sit in one slot: the hash tag decides, as CLUSTER KEYSLOT says.
    with Redis(port=ports[0]) as client:
        for tag, kinds in by_tag.items():
            slots = {key_slot(name.encode()) for name in kinds.values()}
            assert len(slots) == 1, kinds
            if topology == "cluster":
                assert {client.execute_command("CLUSTER", "KEYSLOT", n) for n in kinds.values()} == slots
                assert len({keys[n][0] for n in kinds.values()}) == 1  # one shard holds the group
    if topology == "cluster":
        assert len({port for port, _ in keys.values()}) >= 2  # the session spreads over shards

    async def on_b() -> tuple[Any, Any, Any, list[int], Any]:
        async with StateStoreClient(b.target) as c:
            info = await c.get_session("agent")
            plan = await c.plan_resume("agent", "exact")
            report = await c.resume("agent", "exact")
            tokens = await c.generate("agent", 12)
            return info, plan, report, tokens, await c.stats()

    info, plan, report, tokens, stats = asyncio.run(on_b())
    assert (info.live, info.checkpoint_version, info.checkpointed_tokens) == (False, 2, 288)
    assert info.message_boundaries == (150, 187, 288)
    assert plan.missing_blocks == 0 and set(plan.bytes_by_tier) == {"redis"}  # B's own tiers are empty
    assert (report.mode, report.num_tokens, report.persisted_tokens) == ("exact", 288, 288)
    assert tokens == expected
    redis_hits = sum(k.hits for k in stats.kinds if k.tier == "redis")
    assert redis_hits >= 8 + 1  # the blocks, tail, tokens and manifest came from Redis


# ----- A dies mid-checkpoint ------------------------------------------------------------------


def test_node_a_killed_mid_checkpoint_node_b_resumes_the_previous_one(
        pair: tuple[RedisServer, Node, Node]) -> None:
    redis, a, b = pair
    sid = "agent-killed"
    first = MESSAGES[:2]  # 187 tokens: checkpoint v1

    async def checkpoint_v1() -> Any:
        async with StateStoreClient(a.target) as c:
            await c.create_session(sid)
            for m in first:
                await c.append(sid, m)
            return await c.checkpoint(sid, Durability.SHARED)

    v1 = asyncio.run(checkpoint_v1())
    assert (v1.version, v1.num_tokens) == (1, 187)
    before = set(stored_keys([redis.port]))

    # A big next message (40 more blocks) makes the v2 checkpoint long enough to land in.
    client = SyncStateStoreClient(a.target)
    client.append(sid, message(4, 40 * BLOCK_SIZE))
    outcome: dict[str, Any] = {}

    def checkpoint_v2() -> None:
        try:
            outcome["report"] = client.checkpoint(sid, Durability.SHARED)
        except ServiceError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=checkpoint_v2)
    worker.start()
    try:
        new_keys = _kill_between_records_and_manifest(a, redis.port, before, worker, sid)
    finally:
        worker.join(timeout=30)
        client.close()
    assert "report" not in outcome, "the checkpoint was acknowledged: the kill came too late"
    print(f"\nnode A killed with {len(new_keys)} of v2's 83 records in Redis and v1's manifest")
    assert len(new_keys) >= 1  # part of v2 (its first blocks) reached Redis ...
    manifest = manifest_in_redis([redis.port], sid)  # ... but the manifest is v1's, whole and valid
    assert (manifest.version, manifest.num_tokens, manifest.message_boundaries) == (1, 187, (150, 187))

    async def on_b() -> tuple[Any, Any, list[int], list[int]]:
        async with StateStoreClient(b.target) as c:
            info = await c.get_session(sid)
            report = await c.resume(sid, "exact")
            tokens = await c.generate(sid, 12)
        return info, report, tokens, await reference(b.target, "uninterrupted-2", first, 12)

    info, report, tokens, expected = asyncio.run(on_b())
    assert (info.checkpoint_version, info.checkpointed_tokens, info.message_boundaries) == (1, 187, (150, 187))
    assert (report.mode, report.num_tokens, report.persisted_tokens) == ("exact", 187, 187)
    assert tokens == expected


def _kill_between_records_and_manifest(node: Node, port: int, before: set[str], worker: threading.Thread,
                                       sid: str, attempts: int = 5000) -> set[str]:
    """Freeze the node until Redis holds new records of the checkpoint in flight and still the
    old manifest, then SIGKILL it (frozen: it cannot finish the manifest in between)."""
    with Redis(port=port) as client:
        for _ in range(attempts):
            freeze(node.pid)
            names = {n.decode() for n in client.scan_iter(match=f"{PREFIX}:*", count=1000)}
            new = names - before
            if new and len(new) <= 60:  # of 83: the manifest (the last put) cannot be in flight
                version = manifest_in_redis([port], sid).version
                assert version == 1, f"the v2 manifest is already in Redis ({len(new)} new keys)"
                assert node.kill() == -signal.SIGKILL
                return new
            thaw(node.pid)
            assert worker.is_alive(), "the checkpoint finished before it was caught in flight"
            time.sleep(0.002)
    raise AssertionError("never caught the checkpoint in flight")


# ----- key layout of checkpoints written before the shared hash tag ------------------------------


async def test_checkpoint_of_object_layout_1_resumes_and_its_objects_are_deleted_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints written before OBJECT_LAYOUT 2 (one key per object and kind, manifests
    without the field) still resume exactly; the next checkpoint deletes their objects."""
    import torch

    from statestore import sessions as ss
    from statestore.server import build_adapter
    from statestore.store import TieredStore
    from tiers.host import HostTier
    from tiers.ssd import SSDTier

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    store = TieredStore(host=HostTier(64 << 20), ssd=await SSDTier.create(tmp_path / "ssd"))
    await store.open()
    manager = ss.SessionManager(store, build_adapter("mini", 0), ss.SessionConfig(secret=SECRET_FOR_LAYOUT,
                                                                                 block_size=BLOCK_SIZE))
    try:
        with monkeypatch.context() as m:
            m.setattr(ss, "OBJECT_LAYOUT", 1)
            await manager.create("t", "old")
            for msg in MESSAGES[:2]:
                await manager.append("t", "old", msg)
            await manager.checkpoint("t", "old")
        old = await manager._load_manifest("t", "old")
        assert old is not None and old.object_layout == 1 and old.version == 1
        raw = json_doc(await store.get(manager._manifest_key("t", "old")))
        raw.pop("object_layout")  # as written before the field existed
        legacy = ss.Manifest.from_bytes(json.dumps(raw).encode())
        assert legacy == old
        old_keys = manager._object_keys("t", "old", old)
        assert old_keys[0] == make_record_key(5, manager._object_key("t", "old", "tokens", 1))
        assert all(store.meta(k) is not None for k in old_keys[:3])

        expected = await manager.generate("t", "old", 6)
        await manager.drop("t", "old")
        report = await manager.resume("t", "old", "exact")
        assert (report.mode, report.num_tokens, report.persisted_tokens) == ("exact", 187, 187)
        assert await manager.generate("t", "old", 6) == expected
        new = await manager.checkpoint("t", "old")  # layout 2; deletes v1's objects
        assert new.version == 2
        current = await manager._load_manifest("t", "old")
        assert current is not None and current.object_layout == ss.OBJECT_LAYOUT == 2
        assert all(store.meta(k) is None for k in old_keys)
    finally:
        await manager.aclose()
        await store.aclose()
        torch.set_num_threads(threads)


SECRET_FOR_LAYOUT = b"layout-test-secret-0123456789abc"


def json_doc(record: Any) -> dict[str, Any]:
    assert record is not None
    return json.loads(record.payload)
