"""statestore as LMCache 0.5.6's remote backend, end to end on the CPU.

A real statestore server (child process, loopback, port 0) and LMCache's own StorageManager and
ChunkedTokenDatabase, configured with `statestore.integrations.lmcache.StateStoreConnector`
through LMCache's plugin config (`remote_storage_plugins` + `extra_config`). Chunks come back
bit-exactly from statestore alone, a second LMCache process finds them, they survive a
statestore restart (where LMCache's LocalDiskBackend loses its index), and a statestore that
is down gives misses, never an exception inside LMCache.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import ROOT, LMCacheHarness, ServerProcess, make_lmcache_config, make_lmcache_metadata, require_lmcache

require_lmcache()

from statestore.integrations.lmcache import (  # noqa: E402
    ConnectorSettings,
    make_key_secret,
    make_lmcache_block_key,
    pack_prefix,
    unpack_prefix,
)

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(180)]

HERE = Path(__file__).resolve().parent
NUM_TOKENS = 1000  # chunks of 256, 256, 256 and a partial 232


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("statestore")).start()
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def lm(server: ServerProcess) -> Iterator[LMCacheHarness]:
    harness = LMCacheHarness(make_lmcache_config(server.target, token=None, namespace="tests"),
                             make_lmcache_metadata())
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def stored(lm: LMCacheHarness) -> dict[Any, bytes]:
    expect = lm.store(list(range(NUM_TOKENS)), seed=1)
    lm.wait_stored(list(expect))
    return expect


def on_loop(lm: LMCacheHarness, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, lm.manager.loop).result(30)


# ----- pure pieces -------------------------------------------------------------------------------


def test_block_keys_are_keyed_by_token_and_namespace() -> None:
    key = "m@1@0@2b763dd00afa89c8@bfloat16"
    base = make_lmcache_block_key(key, "ns", make_key_secret("token-aaaa"))
    assert len(base) == 32
    assert base == make_lmcache_block_key(key, "ns", make_key_secret("token-aaaa"))
    assert base != make_lmcache_block_key(key, "ns", make_key_secret("token-bbbb"))
    assert base != make_lmcache_block_key(key, "ns2", make_key_secret("token-aaaa"))
    assert base != make_lmcache_block_key(key, "ns", make_key_secret(None))
    assert unpack_prefix(pack_prefix(key, b"meta")) == (8 + len(key) + 4, key, b"meta")
    assert unpack_prefix(pack_prefix(key, b"meta")[:10]) is None


def test_settings_come_from_extra_config() -> None:
    extra = {"remote_storage_plugin.ss.target": "10.0.0.1:7450", "remote_storage_plugin.ss.durability": "shared",
             "remote_storage_plugin.ss.timeout_s": "2", "remote_storage_plugin.other.target": "x:1"}
    s = ConnectorSettings.from_extra_config(extra, "ss")
    assert (s.target, s.durability.name, s.timeout_s, s.namespace) == ("10.0.0.1:7450", "SHARED", 2.0, "lmcache")
    with pytest.raises(ValueError, match="durability 'sometimes' is not memory, local or shared"):
        ConnectorSettings.from_extra_config({"remote_storage_plugin.ss.durability": "sometimes"}, "ss")


# ----- through LMCache ---------------------------------------------------------------------------


def test_plugin_loads_through_lmcache_config(lm: LMCacheHarness) -> None:
    assert list(lm.manager.storage_backends) == ["LocalCPUBackend", "RemoteBackend-statestore"]
    assert type(lm.connector).__name__ == "StateStoreConnector"
    assert lm.connector.settings.namespace == "tests"
    assert lm.connector.lent is None  # no `shm_name`: LMCache's buffer is private memory, nothing to lend


def test_chunks_come_back_bit_exactly_from_statestore(lm: LMCacheHarness, stored: dict[Any, bytes]) -> None:
    assert [len(v) for v in stored.values()] == [262144, 262144, 262144, 237568]
    for key, expect in stored.items():
        obj = lm.manager.get(key, location=lm.remote_name)  # statestore only, not LMCache's RAM tier
        assert obj is not None, key.to_string()
        try:
            assert bytes(obj.byte_array) == expect
        finally:
            obj.ref_count_down()
    objs = on_loop(lm, lm.connector.batched_get(list(stored)))
    assert [bytes(o.byte_array) for o in objs] == list(stored.values())
    assert lm.connector._client.shm_active  # same host: the bytes moved through shared memory
    assert [list(o.get_shapes()[0]) for o in objs][-1] == [2, 4, 232, 64]  # the partial chunk keeps its shape
    for o in objs:
        o.ref_count_down()


def test_contains_and_prefix_contains(lm: LMCacheHarness, stored: dict[Any, bytes]) -> None:
    keys = list(stored)
    unknown = lm.keys(list(range(10_000, 10_512)))
    remote = lm.manager.storage_backends[lm.remote_name]
    assert remote.contains(keys[0]) and not remote.contains(unknown[0])
    assert lm.connector.exists_sync(keys[2]) and not lm.connector.exists_sync(unknown[1])
    assert remote.batched_contains(keys) == 4
    assert remote.batched_contains(keys[:2] + unknown + keys[2:]) == 2
    assert remote.batched_contains(unknown + keys) == 0
    assert on_loop(lm, remote.batched_async_contains("lookup-1", keys + unknown)) == 4
    got = on_loop(lm, lm.connector.batched_get_non_blocking("lookup-1", keys[:2] + unknown[:1] + keys[2:]))
    assert [bytes(o.byte_array) for o in got] == [stored[k] for k in keys[:2]]
    for o in got:
        o.ref_count_down()


def test_list_returns_lmcache_keys(lm: LMCacheHarness, stored: dict[Any, bytes]) -> None:
    listed = on_loop(lm, lm.connector.list())
    assert sorted(listed) == sorted(k.to_string() for k in stored)


def test_another_token_sees_nothing(server: ServerProcess, lm: LMCacheHarness, stored: dict[Any, bytes]) -> None:
    """Same namespace and LMCache keys, another key secret: other block keys, so no hits."""
    from statestore.integrations.lmcache import make_key_secret as secret_of

    connector = lm.connector
    original = connector._key_secret
    connector._key_secret = secret_of("another-tenant-token")
    try:
        assert lm.manager.storage_backends[lm.remote_name].batched_contains(list(stored)) == 0
    finally:
        connector._key_secret = original


def test_second_lmcache_process_finds_the_chunks(server: ServerProcess, stored: dict[Any, bytes]) -> None:
    seed = os.environ.get("PYTHONHASHSEED")
    if seed in (None, "random"):
        pytest.fail("run with a fixed PYTHONHASHSEED (make test-lmcache sets 0): LMCache hashes chunks with hash()")
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, str(HERE / "lmcache_child.py"), server.target, str(NUM_TOKENS), "tests"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    child = json.loads(lines[-1])
    assert child["keys"] == [k.to_string() for k in stored]
    assert child["hits"] == 4
    assert child["sha256"] == [hashlib.sha256(v).hexdigest() for v in stored.values()]


def test_statestore_down_gives_misses_then_restart_keeps_the_chunks(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "statestore").start()
    lm = LMCacheHarness(make_lmcache_config(srv.target, backoff_s=0.2, max_backoff_s=0.5), make_lmcache_metadata())
    remote = lm.manager.storage_backends[lm.remote_name]
    try:
        expect = lm.store(list(range(600)), seed=7)
        keys = list(expect)
        lm.wait_stored(keys)  # acknowledged at durability "local": fsynced on the server's SSD tier

        srv.stop(signal.SIGKILL)
        started = time.monotonic()
        assert remote.batched_contains(keys) == 0
        assert not remote.contains(keys[0])
        assert lm.manager.get(keys[0], location=lm.remote_name) is None
        assert on_loop(lm, remote.batched_async_contains("down", keys)) == 0
        lm.manager.batched_put(lm.keys(list(range(5_000, 5_256))), [lm.make_chunk(256, 3)])  # dropped, no raise
        assert on_loop(lm, lm.connector.list()) == []
        assert time.monotonic() - started < 10
        assert lm.connector.num_failures >= 1

        srv.start()  # same data dir, same port: a restart
        deadline = time.monotonic() + 20
        while remote.batched_contains(keys) < len(keys):
            assert time.monotonic() < deadline, "chunks not found after the statestore restart"
            time.sleep(0.2)
        for key in keys:
            obj = lm.manager.get(key, location=lm.remote_name)
            assert obj is not None and bytes(obj.byte_array) == expect[key]
            obj.ref_count_down()
        # Puts work again after the restart (the connector registers its namespace anew).
        more = lm.store(list(range(20_000, 20_256)), seed=9)
        lm.wait_stored(list(more))
    finally:
        lm.close()
        srv.stop(signal.SIGKILL)


def test_lmcache_local_disk_backend_loses_its_chunks_on_restart(tmp_path: Path) -> None:
    """The baseline: LMCache's own LocalDiskBackend writes files but indexes them in memory only."""
    disk = tmp_path / "lmcache-disk"
    first = LMCacheHarness(make_lmcache_config("unused:0", local_disk=f"file://{disk}/", remote=False),
                           make_lmcache_metadata())
    try:
        expect = first.store(list(range(600)), seed=5)
        keys = list(expect)
        local = first.manager.storage_backends["LocalDiskBackend"]
        deadline = time.monotonic() + 30
        while local.batched_contains(keys) < len(keys):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        first.close()
    assert len(list(disk.rglob("*"))) >= len(keys)  # the files are there ...
    second = LMCacheHarness(make_lmcache_config("unused:0", local_disk=f"file://{disk}/", remote=False),
                            make_lmcache_metadata())
    try:
        assert second.manager.storage_backends["LocalDiskBackend"].batched_contains(keys) == 0  # ... not found
    finally:
        second.close()


@pytest.mark.parametrize("piece_bytes", [7, 200, 1 << 20])
def test_chunk_sink_takes_a_chunk_from_any_split(piece_bytes: int) -> None:
    """The get path: a record split anywhere (header, prefix, data) lands bit-exactly in the
    buffer the connector's sink allocates from LMCache once the prefix is read; a flipped bit
    is a miss and the buffer is released."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import RemoteMetadata, init_remote_metadata_info

    from engine_adapter.base import StateKind
    from statestore.integrations.lmcache import _ChunkSink, make_namespace_fingerprint
    from statestore.payloads import PayloadPut, _Incoming
    from tiers.record import RecordHeader

    init_remote_metadata_info(1)
    data = torch.randint(0, 255, (2 * 3 * 5 * 64,), dtype=torch.uint8).numpy().tobytes()
    shape = torch.Size([2, 3, 5, 32])
    key = "m@1@0@abc@bfloat16"
    prefix = pack_prefix(key, RemoteMetadata(len(data), [shape], [torch.bfloat16], MemoryFormat.KV_2LTD).serialize())
    fingerprint = make_namespace_fingerprint("t")
    header = RecordHeader(kind=int(StateKind.OPAQUE), codec=0, model_fingerprint=fingerprint, tenant_id=bytes(16),
                          block_key=bytes(32), raw_length=len(prefix) + len(data))
    put = PayloadPut(header, (prefix, data))
    encoded = put.encode_header() + prefix + data

    class Obj:
        def __init__(self, n: int) -> None:
            self.byte_array, self.released = memoryview(bytearray(n)), False

        def ref_count_down(self) -> None:
            self.released = True

    allocated: list[Obj] = []

    class Backend:
        def allocate(self, shapes: Any, dtypes: Any, fmt: Any, busy_loop: bool = True) -> Obj:
            assert (shapes, dtypes, busy_loop) == ([shape], [torch.bfloat16], False)
            allocated.append(Obj(len(data)))
            return allocated[-1]

    class Connector:
        local_cpu_backend = Backend()

    class Key:
        def to_string(self) -> str:
            return key

    Connector.fingerprint = fingerprint  # type: ignore[attr-defined]
    for corrupt in (False, True):
        wire = bytearray(encoded)
        if corrupt:
            wire[-3] ^= 1
        sink = _ChunkSink(Connector(), [Key()])  # type: ignore[arg-type, list-item]
        incoming = _Incoming(0, header.key, len(wire), sink, 4096)
        for offset in range(0, len(wire), piece_bytes):
            incoming.feed(memoryview(bytes(wire[offset:offset + piece_bytes])))
        ok = incoming.finish()
        if corrupt:
            assert not ok and sink.objs == [None] and allocated[-1].released
            assert incoming.failed == "payload checksum mismatch"
        else:
            obj = sink.objs[0]
            assert ok and obj is allocated[-1] and bytes(obj.byte_array) == data and not obj.released


@pytest.mark.parametrize("shm_name", [None, "lent-but-no-shm"])
def test_grpc_frame_path_when_shared_memory_is_off(server: ServerProcess, shm_name: str | None) -> None:
    """shm_bytes 0: the same chunks through gRPC frames only (the path a remote server takes),
    also when LMCache's buffer is in /dev/shm (its chunks, named as lent spans, then go as frames)."""
    name = f"statestore-test-{os.getpid()}-{shm_name}" if shm_name else None
    lm = LMCacheHarness(make_lmcache_config(server.target, namespace="no-shm", shm_bytes=0, shm_name=name),
                        make_lmcache_metadata())
    try:
        expect = lm.store(list(range(600)), seed=11)
        lm.wait_stored(list(expect))
        objs = on_loop(lm, lm.connector.batched_get(list(expect)))
        assert [bytes(o.byte_array) for o in objs] == list(expect.values())
        for o in objs:
            o.ref_count_down()
        assert lm.connector._client is not None and not lm.connector._client.shm_active
        assert not lm.connector._client.lent_active and (lm.connector.lent is not None) is bool(shm_name)
    finally:
        lm.close()


def test_lmcache_buffer_in_shared_memory_is_lent_to_statestore(server: ServerProcess) -> None:
    """LMCache's CPU buffer in /dev/shm (`shm_name`): the connector lends it to the server, so a
    chunk's bytes go from LMCache's buffer to statestore and back without passing through the
    connector's window; a partial chunk (another shape than the buffer allocated ahead) still
    comes back bit-exactly, through its slot."""
    name = f"statestore-test-{os.getpid()}-lent"
    lm = LMCacheHarness(make_lmcache_config(server.target, namespace="lent", shm_name=name), make_lmcache_metadata())
    try:
        assert lm.connector.lent is not None and lm.connector.lent.path == f"/dev/shm/{name}"
        expect = lm.store(list(range(600)), seed=13)  # two full chunks and a partial one
        lm.wait_stored(list(expect))
        objs = on_loop(lm, lm.connector.batched_get(list(expect)))
        assert [bytes(o.byte_array) for o in objs] == list(expect.values())
        assert [list(o.get_shapes()[0]) for o in objs][-1] == [2, 4, 88, 64]
        for o in objs:
            o.ref_count_down()
        client = lm.connector._client
        assert client is not None and client.shm_active and client.lent_active
        window = bytes(client._transport._region.buf)
        full, partial = list(expect.values())[:2], list(expect.values())[2]
        assert all(chunk[-4096:] not in window for chunk in full)  # lent: never through the window
        assert partial[-4096:] in window  # not the size allocated ahead: through its slot
    finally:
        lm.close()


@pytest.mark.parametrize("cache_kinds", ["opaque", ""])
def test_a_full_ssd_keeps_the_newest_chunks_when_opaque_is_a_cache_kind(tmp_path: Path, cache_kinds: str) -> None:
    """`durability: local` into an SSD budget of four chunks, ten chunks put: with
    `storage.cache_kinds = opaque` every put lands and the oldest chunks make room (LRU); without
    it the chunks are the only durable copies, never evicted, and the puts past the budget fail
    (LMCache sees dropped puts, no exception)."""
    chunk_file = 262144 + 4096  # the record's file, block-rounded, plus an index entry's margin
    env = {"STATESTORE_STORAGE_SSD_BUDGET_BYTES": str(4 * chunk_file + chunk_file // 2),
           "STATESTORE_STORAGE_HOST_BUDGET_BYTES": str(chunk_file + chunk_file // 2),  # the host holds one
           "STATESTORE_STORAGE_CACHE_KINDS": cache_kinds}
    server = ServerProcess(tmp_path / "statestore", env=env).start()
    lm = LMCacheHarness(make_lmcache_config(server.target, namespace="full"), make_lmcache_metadata())
    try:
        expect = lm.store(list(range(10 * 256)), seed=21)
        keys = list(expect)
        backend = lm.manager.storage_backends[lm.remote_name]
        deadline = time.monotonic() + 60
        while lm.connector.num_failures == 0 and not backend.contains(keys[-1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the puts are one batch: let it finish
        held = [backend.contains(k) for k in keys]
        if cache_kinds:
            assert held == [False] * 6 + [True] * 4 and lm.connector.num_failures == 0
            objs = on_loop(lm, lm.connector.batched_get(keys[-4:]))
            assert [bytes(o.byte_array) for o in objs] == [expect[k] for k in keys[-4:]]
            for o in objs:
                o.ref_count_down()
        else:
            assert held == [True] * 4 + [False] * 6 and lm.connector.num_failures > 0
    finally:
        lm.close()
        server.stop(signal.SIGKILL)
