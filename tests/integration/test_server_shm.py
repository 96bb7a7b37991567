"""Opaque payloads through the real server on loopback (statestore/payloads.py, statestore/shm.py):
the same-host shared-memory path and the gRPC frame path store and return the same bytes, a
record larger than the window and a batch larger than one window still arrive, a `local` put is
durable across a restart, tenants stay apart, and the server refuses every shm window it
cannot trust (wrong secret, not a memfd, outside the region) with FAILED_PRECONDITION."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from proto.statestore.v1 import common_pb2, statestore_pb2
from statestore.client import ClientOptions, ServiceError, StateStoreClient
from statestore.config import ServiceConfig
from statestore.payloads import PayloadPut
from statestore.server import StateStoreServer
from statestore.shm import DATA_OFFSET, ShmRegion, ShmSlots, ShmWindow, shm_supported
from statestore.types import Durability, TierName
from tiers.record import HEADER_SIZE, RecordHeader

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not shm_supported(), reason="memfd is Linux-only")]

TOKENS = {"alice": "alice-token-0001", "bob": "bob-token-000002"}
SHM_BYTES = 8 << 20  # gets lease half: 4 MiB windows


def config(data_dir: Path) -> ServiceConfig:
    return ServiceConfig(listen="127.0.0.1:0", data_dir=data_dir, engine_preset="mini", tokens=TOKENS,
                         max_message_bytes=1 << 20, max_record_bytes=16 << 20, max_stream_bytes=64 << 20,
                         host_budget_bytes=128 << 20)


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[StateStoreServer]:
    srv = StateStoreServer(config(tmp_path))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(0)


def client(server: StateStoreServer, shm_bytes: int, who: str = "alice") -> StateStoreClient:
    return StateStoreClient(f"127.0.0.1:{server.port}", token=TOKENS[who],
                            options=ClientOptions(chunk_bytes=256 << 10, shm_bytes=shm_bytes))


async def register(c: StateStoreClient) -> bytes:
    fingerprint, _ = await c.register_model(model_name="opaque", weights_id="opaque", config_json="{}",
                                            layout_version=1, specs=[{"kind": 6, "retention": 1, "codec": 0}])
    return fingerprint


def item(fingerprint: bytes, name: str, nbytes: int) -> PayloadPut:
    """A record whose payload is a small prefix plus a body, given as two buffers."""
    body = hashlib.shake_256(name.encode()).digest(nbytes)
    prefix = name.encode()
    header = RecordHeader(kind=6, codec=0, model_fingerprint=fingerprint, tenant_id=bytes(16),
                          block_key=hashlib.blake2b(name.encode(), digest_size=32).digest(),
                          raw_length=len(prefix) + len(body))
    return PayloadPut(header, (prefix, memoryview(body)))


class Sink:
    """Skips the name prefix (its length comes from the record's header), keeps the body."""

    def __init__(self, items: list[PayloadPut]) -> None:
        self.prefix_lens = [len(i.parts[0]) for i in items]
        self.bodies: dict[int, bytearray] = {}
        self.closed: dict[int, bool] = {}

    def open(self, index: int, header: RecordHeader, head: memoryview) -> tuple[int, memoryview]:
        skip = self.prefix_lens[index]
        self.bodies[index] = bytearray(header.raw_length - skip)
        return skip, memoryview(self.bodies[index])

    def close(self, index: int, ok: bool) -> None:
        self.closed[index] = ok


@pytest.mark.parametrize("shm_bytes", [SHM_BYTES, 0])
async def test_payloads_round_trip_through_either_path(server: StateStoreServer, shm_bytes: int) -> None:
    async with client(server, shm_bytes) as c:
        fingerprint = await register(c)
        # 10 MiB > the 4 MiB get window: it travels as frames; 3 x 1.5 MiB overflow one window.
        sizes = [0, 1, 5000, 1 << 20, 3 << 19, 3 << 19, 3 << 19, 10 << 20]
        items = [item(fingerprint, f"rt-{shm_bytes}-{i}", n) for i, n in enumerate(sizes)]
        infos = await c.put_payloads(items[:4], Durability.MEMORY)
        infos += await c.put_payloads(items[4:], Durability.LOCAL)
        assert [i.key for i in infos] == [i.header.key for i in items]
        assert c.shm_active is bool(shm_bytes)
        missing = b"\x00\x06" + b"\x07" * 32
        keys = [i.header.key for i in items]
        sink = Sink(items + items[:1])
        got = await c.get_payloads_into(keys[:3] + [missing] + keys[3:], Sink(items[:3] + items[:1] + items[3:]))
        assert got == [True, True, True, False, True, True, True, True, True]
        got = await c.get_payloads_into(keys, sink)
        assert got == [True] * len(items) and all(sink.closed.values())
        assert [bytes(sink.bodies[i]) for i in range(len(items))] == [bytes(i.parts[1]) for i in items]
        records = await c.get_records(keys)  # the plain record API reads what the payload API stored
        assert [r.payload if r else None for r in records] == [b"".join(bytes(p) for p in i.parts) for i in items]
        head = await c.read_head(keys[4], 16)
        payload4 = b"".join(bytes(p) for p in items[4].parts)
        assert head is not None and head[0].key == keys[4] and head[1] == payload4[:16]
        assert await c.read_head(missing, 16) is None
        assert await c.count_prefix([i.header.block_key for i in items] + [missing[2:]], 6,
                                    model_fingerprint=fingerprint) == len(items)


async def test_a_one_record_window_put_is_one_unary_call_and_a_batch_streams(server: StateStoreServer) -> None:
    """Through the window a put of one record is one message: it goes as a unary call on the
    PutRecords method (the same bytes on the wire), a put of several as a stream; the server
    stores both alike, and a refused one-message put still names what was wrong."""
    async with client(server, SHM_BYTES) as c:
        fingerprint = await register(c)
        transport = c._payloads()
        calls: list[str] = []
        unary, stream = transport._put_one, transport._put

        def spy(name: str, call):  # delegates: records which multi-callable carried the put
            def wrapped(*args, **kwargs):
                calls.append(name)
                return call(*args, **kwargs)
            return wrapped

        transport._put_one, transport._put = spy("unary", unary), spy("stream", stream)
        one = item(fingerprint, "one", 5000)
        several = [item(fingerprint, f"several-{i}", 3000) for i in range(3)]
        assert [i.key for i in await c.put_payloads([one], Durability.MEMORY)] == [one.header.key]
        assert [i.key for i in await c.put_payloads(several, Durability.LOCAL)] == [i.header.key for i in several]
        assert c.shm_active and calls == ["unary", "stream"]
        records = await c.get_records([one.header.key] + [i.header.key for i in several])
        assert [r.payload if r else None for r in records] == [b"".join(bytes(p) for p in i.parts)
                                                               for i in [one] + several]
        stranger = item(b"\x09" * 16, "unregistered", 100)
        with pytest.raises(ServiceError) as refused:
            await c.put_payloads([stranger], Durability.MEMORY)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and "RegisterModel" in refused.value.message
        assert calls == ["unary", "stream", "unary"]


async def test_local_payload_put_survives_a_restart(tmp_path: Path) -> None:
    srv = StateStoreServer(config(tmp_path))
    await srv.start()
    try:
        async with client(srv, SHM_BYTES) as c:
            fingerprint = await register(c)
            items = [item(fingerprint, f"durable-{i}", 2 << 20) for i in range(3)]
            infos = await c.put_payloads(items, Durability.LOCAL)
            assert c.shm_active and all("ssd" in i.tiers for i in infos)
    finally:
        await srv.stop(0)
    srv = StateStoreServer(config(tmp_path))  # same data dir: the SSD tier re-indexes its records
    await srv.start()
    try:
        async with client(srv, SHM_BYTES) as c:
            await register(c)
            sink = Sink(items)
            assert await c.get_payloads_into([i.header.key for i in items], sink) == [True] * 3
            assert [bytes(sink.bodies[i]) for i in range(3)] == [bytes(i.parts[1]) for i in items]
    finally:
        await srv.stop(0)


async def test_tenants_do_not_see_each_others_payloads(server: StateStoreServer) -> None:
    async with client(server, SHM_BYTES) as alice, client(server, SHM_BYTES, "bob") as bob:
        fingerprint = await register(alice)
        await register(bob)
        items = [item(fingerprint, "alice-only", 100_000)]
        await alice.put_payloads(items, Durability.MEMORY)
        sink = Sink(items)
        assert await bob.get_payloads_into([items[0].header.key], sink) == [False]
        assert sink.bodies == {} and bob.shm_active
        with pytest.raises(ServiceError) as err:
            await bob.put_payloads(items, Durability.MEMORY)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED


async def raw_put(server: StateStoreServer, window_value: str, total_bytes: int) -> grpc.aio.AioRpcError | None:
    """A PutRecords that names a window by hand: the start of one record, its bytes 'in shm'."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_unary("/statestore.v1.StateStore/PutRecords",
                                    request_serializer=common_pb2.RecordChunk.SerializeToString,
                                    response_deserializer=statestore_pb2.PutRecordsResponse.FromString)
        start = common_pb2.RecordChunk(start=common_pb2.RecordStart(key=b"\x00\x06" + b"\x01" * 32,
                                                                    total_bytes=total_bytes, durability=1))
        metadata = (("authorization", f"Bearer {TOKENS['alice']}"), ("x-statestore-shm", window_value))
        try:
            await call(iter([start]), metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            return exc
        return None


async def test_server_refuses_windows_it_cannot_trust(server: StateStoreServer, tmp_path: Path) -> None:
    region = ShmRegion(1 << 20)
    plain = tmp_path / "plain-file"
    plain.write_bytes(region.buf[:DATA_OFFSET])  # same magic and secret, but a file, not a memfd
    fd = os.open(plain, os.O_RDONLY)
    try:
        cases = {
            "wrong secret": ShmWindow(region.name, os.urandom(32), DATA_OFFSET, 4096).to_metadata()[1],
            "not a memfd": ShmWindow(f"/proc/{os.getpid()}/fd/{fd}", region.secret, DATA_OFFSET, 4096).to_metadata()[1],
            "outside the region": ShmWindow(region.name, region.secret, DATA_OFFSET, 2 << 20).to_metadata()[1],
            "gone": ShmWindow(f"/proc/{os.getpid()}/fd/99999", region.secret, DATA_OFFSET, 4096).to_metadata()[1],
            "garbage": "not a window",
            "records overflow it": ShmWindow(region.name, region.secret, DATA_OFFSET, 4096).to_metadata()[1],
        }
        for why, value in cases.items():
            total = 5000 if why == "records overflow it" else HEADER_SIZE + 10
            exc = await raw_put(server, value, total)
            assert exc is not None and exc.code() == grpc.StatusCode.FAILED_PRECONDITION, why
            assert (exc.details() or "").startswith("shm:"), (why, exc.details())
        # A window it can trust, with garbage in it: the record's checksums fail (INVALID_ARGUMENT).
        exc = await raw_put(server, ShmWindow(region.name, region.secret, DATA_OFFSET, 4096).to_metadata()[1],
                            HEADER_SIZE + 10)
        assert exc is not None and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert server.store.meta(b"\x00\x06" + b"\x01" * 32) is None  # nothing was stored
    finally:
        os.close(fd)
        region.close()


async def test_get_with_an_unusable_window_falls_back_to_frames(server: StateStoreServer) -> None:
    async with client(server, 0) as c:
        fingerprint = await register(c)
        items = [item(fingerprint, "fallback", 300_000)]
        await c.put_payloads(items, Durability.MEMORY)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = channel.unary_stream("/statestore.v1.StateStore/GetRecords",
                                        request_serializer=statestore_pb2.GetRecordsRequest.SerializeToString,
                                        response_deserializer=common_pb2.RecordChunk.FromString)
            window = ShmWindow(f"/proc/{os.getpid()}/fd/99999", bytes(32), DATA_OFFSET, 1 << 20)
            stream = call(statestore_pb2.GetRecordsRequest(keys=[items[0].header.key]),
                          metadata=(("authorization", f"Bearer {TOKENS['alice']}"), window.to_metadata()))
            assert not any(k == "x-statestore-shm" for k, _ in await stream.initial_metadata())
            chunks = [m async for m in stream]
        assert chunks[0].start.found and sum(len(m.data) for m in chunks[1:]) == items[0].total_bytes


async def test_large_records_in_a_window_are_verified_before_any_is_stored(server: StateStoreServer) -> None:
    """Records of >= 1 MiB are copied out of the window into the SSD tier's staging buffers and
    hashed as they are copied: a corrupt second record refuses the whole stream (nothing
    stored, no staging buffer kept); the same records intact are stored, LOCAL bit-exactly."""
    async with client(server, 0) as c:
        fingerprint = await register(c)
    items = [item(fingerprint, f"staged-{i}", (2 << 20) + 1000 * i) for i in range(2)]
    region = ShmRegion(16 << 20)
    try:
        window = ShmWindow(region.name, region.secret, DATA_OFFSET, 12 << 20)
        slots = ShmSlots(window)
        offsets = [slots.take(i.total_bytes) for i in items]
        for at, i in zip(offsets, items):
            region.buf[at:at + i.total_bytes] = i.encode_header() + b"".join(bytes(p) for p in i.parts)
        region.buf[offsets[1] + HEADER_SIZE + 12345] ^= 0x01  # a flipped bit in the second payload
        exc = await raw_put_records(server, window.to_metadata()[1], items)
        assert exc is not None and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "record 1 (" in (exc.details() or "") and "payload checksum mismatch" in (exc.details() or "")
        assert [server.store.meta(i.header.key) for i in items] == [None, None] and not server.ssd._staged
        region.buf[offsets[1] + HEADER_SIZE + 12345] ^= 0x01
        assert await raw_put_records(server, window.to_metadata()[1], items) is None
        assert not server.ssd._staged
    finally:
        region.close()
    async with client(server, 0) as c:
        records = await c.get_records([i.header.key for i in items])
    assert [bytes(r.payload) if r else None for r in records] == [b"".join(bytes(p) for p in i.parts) for i in items]
    for i in items:
        assert "ssd" in [t.value for t in server.store.meta(i.header.key).tiers]


async def raw_put_records(server: StateStoreServer, window_value: str,
                          items: list[PayloadPut]) -> grpc.aio.AioRpcError | None:
    """A LOCAL PutRecords of `items`, whose bytes the caller laid out in the window by hand."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_unary("/statestore.v1.StateStore/PutRecords",
                                    request_serializer=common_pb2.RecordChunk.SerializeToString,
                                    response_deserializer=statestore_pb2.PutRecordsResponse.FromString)
        starts = [common_pb2.RecordChunk(start=common_pb2.RecordStart(key=i.header.key, total_bytes=i.total_bytes,
                                                                      durability=int(Durability.LOCAL)))
                  for i in items]
        metadata = (("authorization", f"Bearer {TOKENS['alice']}"), ("x-statestore-shm", window_value))
        try:
            await call(iter(starts), metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            return exc
        return None


async def test_large_ssd_records_come_through_the_window_and_stay_the_tenants_own(server: StateStoreServer) -> None:
    """Gets of records on the SSD tier that fit the window: the tier copies each payload into
    its slot as it reads it (`SSDTier.reading_into`); the bytes arrive verified and bit-exact,
    also several in one call; another tenant asking for the same keys gets misses and nothing
    of them lands in its window."""
    async with client(server, 64 << 20) as alice, client(server, 64 << 20, "bob") as bob:
        fingerprint = await register(alice)
        await register(bob)
        items = [item(fingerprint, f"delivered-{i}", (5 << 20) + 4099 * i) for i in range(3)]
        await alice.put_payloads(items, Durability.LOCAL)
        keys = [i.header.key for i in items]
        await alice.evict(keys, ["host"], force=True)  # read back from the SSD tier
        assert all(server.store.meta(k).tiers == {TierName.SSD} for k in keys)
        sink = Sink(items)
        assert await alice.get_payloads_into(keys, sink) == [True] * 3 and alice.shm_active
        assert [bytes(sink.bodies[i]) for i in range(3)] == [bytes(i.parts[1]) for i in items]
        assert not server.ssd._targets
        assert await bob.get_payloads_into(keys, Sink(items)) == [False] * 3 and bob.shm_active
        region = bob._transport._region  # bob's own shared memory: none of alice's bytes went there
        assert bytes(items[0].parts[1][:4096]) not in bytes(region.buf)


async def test_one_large_local_record_is_verified_by_the_write_that_stores_it(server: StateStoreServer) -> None:
    """A shared-memory PutRecords of one LOCAL record of >= 4 MiB leaves the copy out of the
    window to the SSD tier's write (verified before the record becomes visible): a bit flipped
    in the window is INVALID_ARGUMENT naming the record, with nothing stored and no file left;
    the intact record is stored, bit-exact on disk and through a get."""
    async with client(server, 0) as c:
        fingerprint = await register(c)
    big = item(fingerprint, "deferred", 9 << 20)
    region = ShmRegion(16 << 20)
    try:
        window = ShmWindow(region.name, region.secret, DATA_OFFSET, 12 << 20)
        encoded = big.encode_header() + b"".join(bytes(p) for p in big.parts)
        region.buf[DATA_OFFSET:DATA_OFFSET + len(encoded)] = encoded
        region.buf[DATA_OFFSET + HEADER_SIZE + (5 << 20)] ^= 0x80
        exc = await raw_put_records(server, window.to_metadata()[1], [big])
        assert exc is not None and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "record 0 (" in (exc.details() or "") and "payload checksum mismatch" in (exc.details() or "")
        assert server.store.meta(big.header.key) is None and not server.ssd._staged
        assert not [p for p in server.ssd._layout.root.rglob("*.rec")]
        region.buf[DATA_OFFSET + HEADER_SIZE + (5 << 20)] ^= 0x80
        assert await raw_put_records(server, window.to_metadata()[1], [big]) is None
    finally:
        region.close()
    (path,) = server.ssd._layout.root.rglob("*.rec")
    stored = path.read_bytes()
    assert stored[HEADER_SIZE:] == encoded[HEADER_SIZE:]
    async with client(server, 0) as c:
        (got,) = await c.get_records([big.header.key])
    assert got is not None and bytes(got.payload) == encoded[HEADER_SIZE:]
