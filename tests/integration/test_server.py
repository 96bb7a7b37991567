"""The gRPC service end to end on loopback (port 0): every StateStore RPC, record streaming
through a 1 MiB message limit, and every kind of bad input getting the right status code and
message while the server keeps serving and stored state stays unchanged.

Real server, real client, real tiers (host RAM + SSD under tmp_path), the `mini` engine.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from proto.statestore.v1 import common_pb2, statestore_pb2, statestore_pb2_grpc
from statestore.client import ClientOptions, ServiceError, StateStoreClient
from statestore.config import ServiceConfig
from statestore.server import StateStoreServer
from statestore.types import Durability, TierName
from tests.service import assert_rejected
from tiers.record import HEADER_SIZE, Record, encode_record, make_record

pytestmark = pytest.mark.timeout(60)

LIMIT = 1 << 20  # the server's message size limit in these tests
TOKENS = {"alice": "alice-token-0001", "bob": "bob-token-000002"}


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[StateStoreServer]:
    config = ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path, engine_preset="mini", max_message_bytes=LIMIT,
                           max_record_bytes=8 << 20, max_stream_bytes=16 << 20, tokens=TOKENS,
                           host_budget_bytes=64 << 20)
    srv = StateStoreServer(config)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(0)


@pytest_asyncio.fixture
async def alice(server: StateStoreServer) -> AsyncIterator[StateStoreClient]:
    async with StateStoreClient(f"127.0.0.1:{server.port}", token=TOKENS["alice"],
                                options=ClientOptions(max_message_bytes=8 << 20)) as c:
        yield c


@pytest_asyncio.fixture
async def bob(server: StateStoreServer) -> AsyncIterator[StateStoreClient]:
    async with StateStoreClient(f"127.0.0.1:{server.port}", token=TOKENS["bob"]) as c:
        yield c


def block_key(i: int) -> bytes:
    return bytes([i]) * 32


def record(server: StateStoreServer, i: int = 1, nbytes: int = 4096, kind: int = 1, parent: int = 0) -> Record:
    payload = os.urandom(nbytes)
    return make_record(kind, 1, payload, model_fingerprint=server.adapter.model_fingerprint,
                       tenant_id=bytes(16), block_key=block_key(i), parent_key=block_key(parent) if parent else bytes(32),
                       token_start=(i - 1) * 256, token_end=i * 256)


async def snapshot(c: StateStoreClient) -> list[tuple[bytes, int, tuple[str, ...], bool]]:
    """What the caller can see of stored state."""
    records, _ = await c.list_records()
    return [(r.key, r.size_bytes, tuple(r.tiers), r.pinned) for r in records]


# ----- happy paths --------------------------------------------------------------------------


async def test_health_serving_and_stats(alice: StateStoreClient, server: StateStoreServer) -> None:
    assert await alice.health() == "SERVING"
    assert await alice.health("statestore.v1.Sessions") == "SERVING"
    stats = await alice.stats()
    assert stats.model_name == "ced-mini"
    assert stats.model_fingerprint == server.adapter.model_fingerprint
    assert [t.tier for t in stats.tiers] == ["host", "ssd"]
    assert stats.tiers[0].budget_bytes == 64 << 20


async def test_record_larger_than_message_limit_streams_both_ways(alice: StateStoreClient,
                                                                 server: StateStoreServer) -> None:
    big = record(server, 1, 3 << 20)  # 3 MiB through a 1 MiB limit
    small = record(server, 2, 1000, parent=1)
    results = await alice.put_records([big, small], Durability.LOCAL)
    assert [r.key for r in results] == [big.key, small.key]
    assert all(r.durability is Durability.LOCAL and "ssd" in r.tiers for r in results)
    got = await alice.get_records([small.key, big.key, record(server, 9).key], chunk_bytes=256 << 10)
    assert got[0] is not None and got[0].payload == small.payload
    assert got[1] is not None and got[1].payload == big.payload and got[1].header.token_end == 256
    assert got[2] is None
    info = await alice.inspect(big.key)
    assert info.kind_name == "GLOBAL_KV" and info.size_bytes == HEADER_SIZE + (3 << 20)
    assert info.durability is Durability.LOCAL and set(info.tiers) == {"host", "ssd"}
    assert (info.token_start, info.token_end, info.retention) == (0, 256, "MUST_KEEP")
    assert info.explain is not None and info.explain["key"] == big.key.hex()
    assert info.explain["durability"] == "LOCAL" and set(info.explain["tiers"]) == {"host", "ssd"}
    assert "policy_name" in info.explain


async def test_lookup_prefix_per_tier_with_resume_plan(alice: StateStoreClient, server: StateStoreServer) -> None:
    records = []
    for i in (1, 2, 3):
        records += [record(server, i, 2048, kind=1), record(server, i, 512, kind=2)]
    await alice.put_records(records[:4], Durability.LOCAL)  # blocks 1, 2 durable
    await alice.put_records(records[4:], Durability.MEMORY)  # block 3 in RAM only
    chain = [block_key(i) for i in (1, 2, 3, 4)]
    result = await alice.lookup(chain, num_tokens=4 * 256 + 10, mode="exact")
    assert result.combined_blocks == 3
    assert result.per_tier == {"host": 3, "ssd": 2}
    assert result.persisted_tokens == 3 * 256
    assert sum(result.bytes_to_load.values()) == 3 * (2048 + 512 + 2 * HEADER_SIZE)
    assert result.replay is not None and result.replay.mode == "exact"
    assert result.replay.num_tokens == 4 * 256 + 10 and result.replay.persisted_tokens == 3 * 256
    assert result.est_seconds >= result.est_load_seconds
    assert (await alice.lookup([block_key(7)])).combined_blocks == 0


async def test_pin_unpin_evict_list_inspect(alice: StateStoreClient, server: StateStoreServer) -> None:
    a, b = record(server, 1), record(server, 2)
    await alice.put_records([a, b], Durability.LOCAL)
    assert await alice.pin([a.key]) == 1
    assert (await alice.inspect(a.key)).pinned
    assert (await alice.evict([a.key, b.key])) == {a.key: (), b.key: ("host", "ssd")}
    assert await alice.get_records([b.key]) == [None]
    assert (await alice.evict([a.key], ["host"], force=True)) == {a.key: ("host",)}
    assert list((await alice.inspect(a.key)).tiers) == ["ssd"]
    assert await alice.unpin([a.key]) == 1
    records, truncated = await alice.list_records()
    assert [r.key for r in records] == [a.key] and not truncated
    assert (await alice.list_records(kind=2))[0] == []


async def test_list_is_oldest_first_per_tenant_and_kind_across_chunks(
        alice: StateStoreClient, bob: StateStoreClient, server: StateStoreServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """List reads the index in chunks, yielding between them; whatever the chunking, it answers
    the caller's records of the kind asked, oldest first, the first `limit` of them."""
    import statestore.store_service as server_module

    monkeypatch.setattr(server_module, "LIST_CHUNK", 3)
    mine = [record(server, i, 256, kind=1 + i % 2) for i in range(1, 12)]
    for i, r in enumerate(mine):
        await alice.put_records([r])
        await bob.put_records([record(server, 100 + i, 256)])  # another tenant's, interleaved
    everything, truncated = await alice.list_records(limit=1000)
    assert [r.key for r in everything] == [r.key for r in mine] and not truncated  # oldest first
    assert [r.created_at for r in everything] == sorted(r.created_at for r in everything)
    first, truncated = await alice.list_records(limit=4)
    assert [r.key for r in first] == [r.key for r in mine[:4]] and truncated
    of_kind, truncated = await alice.list_records(kind=2, limit=3)
    assert [r.key for r in of_kind] == [r.key for r in mine if r.header.kind == 2][:3] and truncated
    kind_2 = sum(r.header.kind == 2 for r in mine)
    exact, truncated = await alice.list_records(kind=2, limit=kind_2)
    assert len(exact) == kind_2 and not truncated


async def test_register_model_then_its_records_are_accepted(alice: StateStoreClient, server: StateStoreServer) -> None:
    specs = [{"kind": 1, "retention": 1, "codec": 1, "bytes_per_token": 100.0}]
    fp, hosted = await alice.register_model(model_name="other", weights_id="w1", config_json='{"layers": 4}',
                                            layout_version=1, specs=specs)
    assert len(fp) == 16 and not hosted
    r = make_record(1, 1, b"x" * 100, model_fingerprint=fp, tenant_id=bytes(16), block_key=block_key(5))
    assert [p.key for p in await alice.put_records([r])] == [r.key]
    fp2, _ = await alice.register_model(model_name="other", weights_id="w1", config_json='{"layers": 4}',
                                        layout_version=1, specs=specs)
    assert fp2 == fp  # a fingerprint is a pure function of the description


async def test_register_model_is_bounded(alice: StateStoreClient, server: StateStoreServer,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each new description adds a fingerprint the server remembers: the set has a cap."""
    import statestore.store_service as server_module

    monkeypatch.setattr(server_module, "MAX_REGISTERED_MODELS", len(server.models) + 1)
    specs = [{"kind": 1, "retention": 1, "codec": 1, "bytes_per_token": 100.0}]
    first, _ = await alice.register_model(model_name="m", weights_id="w-0", config_json="{}", layout_version=1,
                                          specs=specs)
    with pytest.raises(ServiceError) as err:
        await alice.register_model(model_name="m", weights_id="w-1", config_json="{}", layout_version=1, specs=specs)
    assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "MAX_REGISTERED_MODELS" in err.value.message
    again, _ = await alice.register_model(model_name="m", weights_id="w-0", config_json="{}", layout_version=1,
                                          specs=specs)
    assert again == first  # a known description still registers


async def test_ssd_loop_reads_can_be_turned_off(tmp_path: Path) -> None:
    """`storage.ssd_loop_reads = false` reaches the SSD tier: every read stays on its threads
    (on, the default, it reads on the event loop where native AIO exists: tiers/_aio.py)."""
    config = ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path, engine_preset="mini", ssd_loop_reads=False)
    async with StateStoreServer(config) as srv, StateStoreClient(f"127.0.0.1:{srv.port}") as c:
        assert srv.ssd._aio is None
        await assert_read_back_from_ssd(srv, c)  # on a thread


async def assert_read_back_from_ssd(srv: StateStoreServer, c: StateStoreClient) -> None:
    """A LOCAL record of O_DIRECT size below 2 MiB (a loop read when those are on), dropped
    from the host tier, comes back from the SSD tier through the service."""
    r = record(srv, 1, nbytes=300_000)
    await c.put_records([r], Durability.LOCAL)
    assert await srv.store.evict(r.key, [TierName.HOST], force=True) == {TierName.HOST}
    assert (await c.get_records([r.key]))[0].payload == r.payload


async def test_ssd_read_polling_is_configured(tmp_path: Path) -> None:
    """`storage.ssd_read_poll_us` reaches the SSD tier's loop reads: 0 never polls, and a read
    still lands (through the eventfd)."""
    config = ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path, engine_preset="mini", ssd_read_poll_us=0)
    async with StateStoreServer(config) as srv, StateStoreClient(f"127.0.0.1:{srv.port}") as c:
        assert srv.ssd._aio is not None, "native AIO is unavailable on this Linux machine"
        assert srv.ssd._aio._poll_s == 0
        await assert_read_back_from_ssd(srv, c)  # on the loop, through the eventfd
    async with StateStoreServer(replace(config, ssd_read_poll_us=1500)) as srv:
        assert srv.ssd._aio is not None and srv.ssd._aio._poll_s == 0.0015


async def test_metrics_endpoint_reports_tiers_and_calls(tmp_path: Path) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path, engine_preset="mini", metrics_port=port)
    async with StateStoreServer(config) as srv:
        async with StateStoreClient(f"127.0.0.1:{srv.port}") as c:
            await c.put_records([record(srv, 1), record(srv, 2)])
            await c.get_records([record(srv, 1).key, record(srv, 2).key, record(srv, 3).key])  # two hits, a miss
            await c.create_session("m")
            await c.append("m", list(range(70)))
            await c.checkpoint("m")
            await c.drop_session("m")
            resumed = await c.resume("m", "exact")
        await asyncio.sleep(0.25)  # the loop-lag sampler wakes every 0.1 s
        time.sleep(0.35)  # the server's loop (this one) blocked: its next wake-up is >= 0.25 s late
        await asyncio.sleep(0.15)
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    assert 'statestore_resume_seconds_count{mode="exact"} 1.0' in text
    assert f'statestore_replay_tokens_total{{mode="exact"}} {float(resumed.replay_tokens)}' in text
    assert 'statestore_tier_resident_bytes{kind="MANIFEST",tier="ssd"}' in text
    assert 'statestore_tier_resident_bytes{kind="GLOBAL_KV",tier="host"}' in text
    assert re.search(r'statestore_hits_total{kind="GLOBAL_KV",tier="host"} [1-9]', text)
    assert 'statestore_rpc_calls_total{code="OK",method="PutRecords"} 1.0' in text
    moved = float(2 * (HEADER_SIZE + 4096))  # counted once per call: the two records each way
    assert f'statestore_bytes_moved_total{{direction="in"}} {moved}' in text
    assert f'statestore_bytes_moved_total{{direction="out"}} {moved}' in text
    for method in ("PutRecords", "GetRecords", "Checkpoint", "Resume"):  # handling time, every call
        assert f'statestore_rpc_seconds_count{{method="{method}"}} 1.0' in text
    lag = {le: float(n) for le, n in re.findall(r'statestore_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)', text)}
    assert lag["+Inf"] >= 3 and lag["0.25"] <= lag["+Inf"] - 1  # samples taken; the blocked one is late


# ----- bad input: right code, useful message, server serving, state unchanged -----------------


def chunks_of(r: Record, *, total: int | None = None, data: bytes | None = None, key: bytes | None = None,
              step: int = 256 << 10) -> list[common_pb2.RecordChunk]:
    data = encode_record(r) if data is None else data
    out = [common_pb2.RecordChunk(start=common_pb2.RecordStart(key=r.key if key is None else key,
                                                               total_bytes=len(data) if total is None else total))]
    out += [common_pb2.RecordChunk(data=data[i:i + step]) for i in range(0, len(data), step)]
    return out


def corrupt_payload(r: Record) -> bytes:
    data = bytearray(encode_record(r))
    data[-1] ^= 0xFF
    return bytes(data)


BAD_STREAMS = {
    "empty stream": (lambda s: [], grpc.StatusCode.INVALID_ARGUMENT, "carried no records"),
    "empty chunk": (lambda s: [common_pb2.RecordChunk()], grpc.StatusCode.INVALID_ARGUMENT, "empty RecordChunk"),
    "data before start": (lambda s: [common_pb2.RecordChunk(data=b"xx")], grpc.StatusCode.INVALID_ARGUMENT,
                          "before its start"),
    "short key": (lambda s: chunks_of(record(s), key=b"abc"), grpc.StatusCode.INVALID_ARGUMENT,
                  "start.key: a record key is 34 bytes", "got 3"),
    "oversized record": (lambda s: chunks_of(record(s), total=9 << 20), grpc.StatusCode.INVALID_ARGUMENT,
                         "start.total_bytes 9437184 outside", "max_record_bytes"),
    "huge length": (lambda s: chunks_of(record(s), total=(1 << 64) - 1), grpc.StatusCode.INVALID_ARGUMENT,
                    "start.total_bytes 18446744073709551615"),
    "empty payload": (lambda s: chunks_of(record(s), total=0, data=b""), grpc.StatusCode.INVALID_ARGUMENT,
                      "start.total_bytes 0 outside"),
    "more data than declared": (lambda s: chunks_of(record(s), total=HEADER_SIZE + 100),
                                grpc.StatusCode.INVALID_ARGUMENT, "data exceeds start.total_bytes"),
    "truncated": (lambda s: chunks_of(record(s))[:-1] + [common_pb2.RecordChunk(data=b"x")],
                  grpc.StatusCode.INVALID_ARGUMENT, "stream ended after"),
    "bad checksum": (lambda s: chunks_of(record(s), data=corrupt_payload(record(s))),
                     grpc.StatusCode.INVALID_ARGUMENT, "payload checksum mismatch"),
    "bad checksum, in parts": (lambda s: chunks_of(record(s), data=corrupt_payload(record(s)), step=1000),
                               grpc.StatusCode.INVALID_ARGUMENT, "payload checksum mismatch"),
    # Records of >= 1 MiB in several messages are assembled in the SSD tier's staging buffers.
    "bad checksum, large record": (lambda s: chunks_of(record(s, 1, 2 << 20), data=corrupt_payload(record(s, 1, 2 << 20))),
                                   grpc.StatusCode.INVALID_ARGUMENT, "payload checksum mismatch"),
    "large second record bad": (lambda s: chunks_of(record(s, 3, 2 << 20))
                                + chunks_of(record(s, 5, 2 << 20), data=corrupt_payload(record(s, 5, 2 << 20))),
                                grpc.StatusCode.INVALID_ARGUMENT, "record 1 (", "payload checksum mismatch"),
    "large record, trailing bytes": (lambda s: (lambda r: chunks_of(r, data=encode_record(r) + bytes(4096)))(
        record(s, 1, 2 << 20)), grpc.StatusCode.INVALID_ARGUMENT, "4096 trailing bytes after the payload"),
    "large record, truncated": (lambda s: (lambda r: chunks_of(r, data=encode_record(r)[:-4096]))(
        record(s, 1, 2 << 20)), grpc.StatusCode.INVALID_ARGUMENT, "truncated payload"),
    "large record, key not the header's": (lambda s: chunks_of(record(s, 1, 2 << 20), key=record(s, 2).key),
                                           grpc.StatusCode.INVALID_ARGUMENT, "does not match the key"),
    "key not the header's": (lambda s: chunks_of(record(s, 1), key=record(s, 2).key),
                             grpc.StatusCode.INVALID_ARGUMENT, "does not match the key"),
    "unknown kind": (lambda s: chunks_of(record(s, kind=99)), grpc.StatusCode.INVALID_ARGUMENT, "unknown kind 99"),
    "manifest kind": (lambda s: chunks_of(record(s, kind=0x100)), grpc.StatusCode.INVALID_ARGUMENT,
                      "unknown kind 256"),
    "wrong model fingerprint": (
        lambda s: chunks_of(make_record(1, 1, b"p" * 64, model_fingerprint=b"\x07" * 16, tenant_id=bytes(16),
                                        block_key=block_key(1))),
        grpc.StatusCode.FAILED_PRECONDITION, "model fingerprint 07070707", "RegisterModel"),
    "another tenant in the header": (
        lambda s: chunks_of(make_record(1, 1, b"p" * 64, model_fingerprint=s.adapter.model_fingerprint,
                                        tenant_id=b"\x01" * 16, block_key=block_key(1))),
        grpc.StatusCode.PERMISSION_DENIED, "names another tenant"),
    "second record bad": (lambda s: chunks_of(record(s, 3)) + chunks_of(record(s, kind=77)),
                          grpc.StatusCode.INVALID_ARGUMENT, "record 1: unknown kind 77"),
}


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
async def test_bad_record_stream_is_rejected_and_changes_nothing(case: str, alice: StateStoreClient,
                                                                 server: StateStoreServer) -> None:
    await alice.put_records([record(server, 4)], Durability.LOCAL)
    before, host_bytes = await snapshot(alice), server.host.usage().resident_bytes
    make, code, *fragments = BAD_STREAMS[case]
    await assert_rejected(alice.put_raw(make(server)), code, *fragments)
    assert await snapshot(alice) == before
    assert await alice.health() == "SERVING"
    assert not server.ssd._staged  # every staging buffer was released
    # Records verified before the bad one were copied into host pages as the stream came in
    # (`HostTier.stage`): those pages went back with the call.
    assert not server.host._staged and server.host.usage().resident_bytes == host_bytes


async def test_message_over_the_limit_is_resource_exhausted(server: StateStoreServer) -> None:
    options = ClientOptions(chunk_bytes=2 << 20, max_message_bytes=8 << 20)
    async with StateStoreClient(f"127.0.0.1:{server.port}", TOKENS["alice"], options) as c:
        await assert_rejected(c.put_records([record(server, 1, 3 << 20)]), grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "larger than max")
        assert await snapshot(c) == []
        assert await c.health() == "SERVING"


async def test_budget_exceeded_names_the_budget(tmp_path: Path) -> None:
    config = ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path, engine_preset="mini", ssd_budget_bytes=100_000)
    async with StateStoreServer(config) as srv, StateStoreClient(f"127.0.0.1:{srv.port}") as c:
        err = await assert_rejected(c.put_records([record(srv, 1, 200_000)], Durability.LOCAL),
                                    grpc.StatusCode.RESOURCE_EXHAUSTED, "ssd tier budget of 100000 B")
        assert "raise the ssd budget" in err.message
        await assert_rejected(c.put_records([record(srv, 1)], Durability.SHARED), grpc.StatusCode.FAILED_PRECONDITION,
                              "no redis tier is configured")
        assert await snapshot(c) == []


BAD_CALLS = {
    "get short key": (lambda c, s: c.get_records([b"k"]), "keys[0]: a record key is 34 bytes"),
    "get no keys": (lambda c, s: c.get_records([]), "keys: give at least one record key"),
    "get too many keys": (lambda c, s: c.get_records([record(s).key] * 4097), "4097 keys, at most 4096"),
    "pin short key": (lambda c, s: c.pin([b"\x00" * 33]), "keys[0]: a record key is 34 bytes", "got 33"),
    "evict unknown tier": (lambda c, s: c.evict([record(s).key], ["tape"]), "tiers[0]: unknown tier 'tape'"),
    "lookup short block key": (lambda c, s: c.lookup([b"abc"]), "block_keys[0]: a block key is 32 bytes"),
    "lookup unknown kind": (lambda c, s: c.lookup([block_key(1)], kinds=[42]), "kinds[0]: unknown kind 42"),
    "lookup short context": (lambda c, s: c.lookup([block_key(1)] * 2, num_tokens=3), "num_tokens: 3 must lie"),
    "lookup bad mode": (lambda c, s: c.lookup([block_key(1)], mode="fast"), "mode: 'fast' is not one of"),
    "list huge limit": (lambda c, s: c.list_records(limit=1 << 30), "limit: 1073741824 > 100000"),
    "request done short block key": (lambda c, s: c.request_done([block_key(1), b"abc"], 5),
                                     "block_keys[1]: a block key is 32 bytes"),
    "request done unknown kind": (lambda c, s: c.request_done([block_key(1)], 5, kinds=[9]), "kinds[0]: unknown kind 9"),
    "request done huge count": (lambda c, s: c.request_done([block_key(1)], 1 << 41), "generated_tokens: 2199023255552 > 2^40"),
    "inspect short key": (lambda c, s: c.inspect(b""), "key: a record key is 34 bytes", "got 0"),
    "register no specs": (lambda c, s: c.register_model(model_name="m", weights_id="w", config_json="{}",
                                                        layout_version=1, specs=[]), "specs: describe at least one"),
    "register unknown kind": (lambda c, s: c.register_model(model_name="m", weights_id="w", config_json="{}",
                                                            layout_version=1, specs=[{"kind": 12, "retention": 1}]),
                              "specs[0].kind: unknown kind 12"),
    "register bad json": (lambda c, s: c.register_model(model_name="m", weights_id="w", config_json="{",
                                                        layout_version=1, specs=[{"kind": 1, "retention": 1}]),
                          "config_json: not JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
async def test_bad_call_is_invalid_argument_naming_the_field(case: str, alice: StateStoreClient,
                                                             server: StateStoreServer) -> None:
    await alice.put_records([record(server, 4)])
    before = await snapshot(alice)
    make, *fragments = BAD_CALLS[case]
    await assert_rejected(make(alice, server), grpc.StatusCode.INVALID_ARGUMENT, *fragments)
    assert await snapshot(alice) == before
    assert await alice.health() == "SERVING"


async def test_unknown_keys_are_not_found_and_nothing_changes(alice: StateStoreClient, server: StateStoreServer) -> None:
    a = record(server, 1)
    await alice.put_records([a])
    await assert_rejected(alice.pin([a.key, record(server, 2).key]), grpc.StatusCode.NOT_FOUND,
                          "1 of 2 keys are not stored", "nothing was changed")
    assert not (await alice.inspect(a.key)).pinned
    await assert_rejected(alice.inspect(record(server, 2).key), grpc.StatusCode.NOT_FOUND, "is not stored")


async def test_tokens_missing_wrong_or_malformed_are_denied(server: StateStoreServer) -> None:
    target = f"127.0.0.1:{server.port}"
    for token, fragment in ((None, "missing credentials"), ("nope-nope-nope", "unknown bearer token")):
        async with StateStoreClient(target, token=token) as c:
            await assert_rejected(c.stats(), grpc.StatusCode.PERMISSION_DENIED, fragment)
            await assert_rejected(c.list_sessions(), grpc.StatusCode.PERMISSION_DENIED, fragment)
            await assert_rejected(c.put_records([record(server, 1)]), grpc.StatusCode.PERMISSION_DENIED, fragment)
            await assert_rejected(c.get_records([record(server, 1).key]), grpc.StatusCode.PERMISSION_DENIED, fragment)
            assert await c.health() == "SERVING"  # health stays public
    channel = grpc.aio.insecure_channel(target)
    stub = statestore_pb2_grpc.StateStoreStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Stats(statestore_pb2.StatsRequest(), metadata=(("authorization", "Basic abc"),))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "expected 'Bearer <token>'" in info.value.details()
    await channel.close()


async def test_tenants_cannot_see_each_others_records(alice: StateStoreClient, bob: StateStoreClient,
                                                      server: StateStoreServer) -> None:
    a = record(server, 1)
    await alice.put_records([a], Durability.LOCAL)
    assert await bob.get_records([a.key]) == [None]
    assert (await bob.lookup([block_key(1)], kinds=[1])).combined_blocks == 0
    assert (await alice.lookup([block_key(1)], kinds=[1])).combined_blocks == 1
    assert await bob.request_done([block_key(1)], 5, kinds=[1]) == 0  # neither counted nor learned from
    assert await alice.request_done([block_key(1), block_key(2)], 5, kinds=[1]) == 1
    assert await snapshot(bob) == []
    await assert_rejected(bob.inspect(a.key), grpc.StatusCode.NOT_FOUND)
    await assert_rejected(bob.pin([a.key]), grpc.StatusCode.NOT_FOUND)
    assert await bob.evict([a.key], force=True) == {a.key: ()}
    await assert_rejected(bob.put_records([a]), grpc.StatusCode.PERMISSION_DENIED, "belongs to another tenant")
    got = await alice.get_records([a.key])
    assert got[0] is not None and got[0].payload == a.payload


async def test_client_disconnecting_mid_stream_stores_nothing(alice: StateStoreClient, server: StateStoreServer) -> None:
    await alice.put_records([record(server, 4)])
    before = await snapshot(alice)
    big = record(server, 1, 3 << 20)
    sent = asyncio.Event()

    async def stream() -> AsyncIterator[common_pb2.RecordChunk]:
        chunks = chunks_of(big)
        yield chunks[0]
        yield chunks[1]
        sent.set()
        await asyncio.sleep(30)  # never finishes: the client goes away

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    call = statestore_pb2_grpc.StateStoreStub(channel).PutRecords(
        stream(), metadata=(("authorization", f"Bearer {TOKENS['alice']}"),))
    await asyncio.wait_for(sent.wait(), 10)
    await asyncio.sleep(0.2)
    call.cancel()
    await channel.close()
    await asyncio.sleep(0.2)
    assert await snapshot(alice) == before
    assert await alice.get_records([big.key]) == [None]
    assert await alice.health() == "SERVING"
    assert not server.host._staged
