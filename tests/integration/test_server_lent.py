"""Lent memory through the real server on loopback (statestore/shm.py, "Lent memory"): a client
whose buffers lie in a file under /dev/shm lends it beside its window; puts name the bulk of a
record where it lies there and gets have it delivered where the caller wants it, so the bulk
never passes through the window; a destination that does not fit a record falls back to the
slot; the server refuses lent memory it cannot trust and malformed lent fields, storing nothing;
a client whose lent memory is refused goes on copying through the window."""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from proto.statestore.v1 import common_pb2, statestore_pb2
from statestore.client import ClientOptions, ServiceError, StateStoreClient
from statestore.config import ServiceConfig
from statestore.payloads import PayloadPut
from statestore import store_service as server_module
from statestore.record_stream import with_server_checksum
from statestore.server import StateStoreServer
from statestore.shm import DATA_OFFSET, LENT_DIR, LentSpan, ShmRegion, ShmWindow, shm_supported
from statestore.types import Durability, TierName
from tiers.record import HEADER_SIZE, RecordHeader, encode_header

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not shm_supported() or not os.path.isdir(LENT_DIR), reason="Linux /dev/shm only")]

TOKEN = "alice-token-0001"
LENT_BYTES = 48 << 20


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[StateStoreServer]:
    srv = StateStoreServer(ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path, engine_preset="mini",
                                         tokens={"alice": TOKEN}, max_message_bytes=1 << 20,
                                         max_record_bytes=16 << 20, max_stream_bytes=64 << 20,
                                         host_budget_bytes=128 << 20))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(0)


class LentFile:
    """A file under /dev/shm, mapped: what LMCache's `shm_name` CPU buffer is."""

    def __init__(self, size: int) -> None:
        self.path = f"{LENT_DIR}statestore-test-{uuid.uuid4().hex}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self.buf)

    def span(self, offset: int, data: bytes | None = None, size: int = 0) -> LentSpan:
        view = self.view[offset:offset + (len(data) if data is not None else size)]
        if data is not None:
            view[:] = data
        return LentSpan(offset, view)

    def close(self) -> None:
        os.unlink(self.path)
        try:
            self.view.release()
            self.buf.close()
        except BufferError:  # a test still holds spans of it: the mapping goes with them
            pass


@pytest.fixture
def lent() -> Iterator[LentFile]:
    f = LentFile(LENT_BYTES)
    try:
        yield f
    finally:
        f.close()


def make_client(server: StateStoreServer, shm_bytes: int = 16 << 20) -> StateStoreClient:
    return StateStoreClient(f"127.0.0.1:{server.port}", token=TOKEN,
                            options=ClientOptions(chunk_bytes=256 << 10, shm_bytes=shm_bytes))


async def register(c: StateStoreClient) -> bytes:
    fingerprint, _ = await c.register_model(model_name="opaque", weights_id="opaque", config_json="{}",
                                            layout_version=1, specs=[{"kind": 6, "retention": 1, "codec": 0}])
    return fingerprint


def body_of(name: str, nbytes: int) -> bytes:
    return hashlib.shake_256(name.encode()).digest(nbytes)


def lent_item(fingerprint: bytes, name: str, body: LentSpan) -> PayloadPut:
    prefix = name.encode()
    header = RecordHeader(kind=6, codec=0, model_fingerprint=fingerprint, tenant_id=bytes(16),
                          block_key=hashlib.blake2b(name.encode(), digest_size=32).digest(),
                          raw_length=len(prefix) + len(body.view))
    return PayloadPut(header, (prefix, body))


class LentSink:
    """Asks for each body at `dests[i]` of the lent file (as LMCache's connector does); takes
    it there when the record is the size expected, else into a buffer of its own."""

    def __init__(self, lent: LentFile, items: list[PayloadPut], dests: list[int], wrong_size: set[int] = frozenset()):
        self.prefix_lens = [len(i.parts[0]) for i in items]
        self.spans = [lent.span(at, size=len(i.parts[1].view)) for i, at in zip(items, dests)]
        self.totals = [i.total_bytes + (1 if n in wrong_size else 0) for n, i in enumerate(items)]
        self.own: dict[int, bytearray] = {}
        self.closed: dict[int, bool] = {}

    def lent_destination(self, index: int) -> tuple[int, LentSpan]:
        return self.totals[index], self.spans[index]

    def open(self, index: int, header: RecordHeader, head: memoryview) -> tuple[int, memoryview]:
        skip = self.prefix_lens[index]
        if header.raw_length - skip == len(self.spans[index].view):
            return skip, self.spans[index].view
        self.own[index] = bytearray(header.raw_length - skip)
        return skip, memoryview(self.own[index])

    def close(self, index: int, ok: bool) -> None:
        self.closed[index] = ok


async def test_lent_memory_moves_the_bulk_without_the_window(server: StateStoreServer, lent: LentFile) -> None:
    async with make_client(server) as c:
        c.lend_shared_memory(lent.path)
        fingerprint = await register(c)
        sizes = [100_000, 6 << 20, 2 << 20, 3 << 20]  # host hit; one LOCAL record alone (deferred fill); two
        bodies = [body_of(f"lent-{i}", n) for i, n in enumerate(sizes)]
        offsets = [0, 1 << 20, 8 << 20, 11 << 20]
        items = [lent_item(fingerprint, f"lent-{i}", lent.span(at, b)) for i, (at, b) in enumerate(zip(offsets, bodies))]
        await c.put_payloads(items[:1], Durability.MEMORY)
        await c.put_payloads(items[1:2], Durability.LOCAL)
        await c.put_payloads(items[2:], Durability.LOCAL)
        assert c.shm_active and c.lent_active
        keys = [i.header.key for i in items]
        await c.evict(keys[1:], ["host"], force=True)  # read back from the SSD tier: delivered as it is read
        assert all(server.store.meta(k).tiers == {TierName.SSD} for k in keys[1:])
        lent.view[offsets[1]:offsets[1] + sizes[1]] = bytes(sizes[1])  # the source is gone: a get must bring it

        dests = [24 << 20, 25 << 20, 32 << 20, 40 << 20]
        missing = b"\x00\x06" + b"\x07" * 32
        sink = LentSink(lent, items + items[:1], dests + [44 << 20], wrong_size={2})
        got = await c.get_payloads_into(keys + [missing], sink)
        assert got == [True, True, True, True, False] and all(sink.closed.values())
        for i in range(4):
            assert bytes(lent.view[dests[i]:dests[i] + sizes[i]]) == bodies[i], i
        window = bytes(c._transport._region.buf)
        for i in (0, 1, 3):  # the bulk never passed through the window
            assert bodies[i][-4096:] not in window, i
        assert bodies[2][-4096:] in window  # its destination named another size: it came in its slot
        # The starts say where the bulk went and whether the server hashed it there (an SSD read
        # delivering it: the client then skips its own pass); a host hit is copied, not verified.
        await c.evict(keys[1:2], ["host"], force=True)  # the get promoted it: read it from the SSD tier again
        transport = c._transport
        window = transport._region.window(DATA_OFFSET, 12 << 20)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            get = channel.unary_stream("/statestore.v1.StateStore/GetRecords",
                                       request_serializer=statestore_pb2.GetRecordsRequest.SerializeToString,
                                       response_deserializer=common_pb2.RecordChunk.FromString)
            request = statestore_pb2.GetRecordsRequest(keys=keys[:2], lent=[
                common_pb2.LentDestination(total_bytes=items[i].total_bytes, offset=dests[i], bytes=sizes[i])
                for i in range(2)])
            starts = [m.start async for m in get(request, metadata=(("authorization", f"Bearer {TOKEN}"),
                                                                    window.to_metadata(),
                                                                    transport._lent.to_metadata()))]
        assert [(s.lent_offset, s.lent_bytes) for s in starts] == [(dests[0], sizes[0]), (dests[1], sizes[1])]
        assert [s.verified for s in starts] == [False, True]
        records = await c.get_records(keys)  # and what is stored is the record as put
        assert [bytes(r.payload) for r in records] == [f"lent-{n}".encode() + b for n, b in enumerate(bodies)]
        assert not server.ssd._targets and not server.ssd._staged


async def test_a_stream_of_lent_local_records_is_written_as_copied_and_stays_all_or_nothing(
        server: StateStoreServer, lent: LentFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several LOCAL records whose checksums the server takes (lent memory) are each copied out
    by the SSD tier's write (deferred fills), and still nothing of a stream is stored when one of
    its records is refused: the refusal comes before the first put."""
    passes: list[int] = []  # records hashed in a pass of their own before being copied (not deferred)

    def counted(parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
        passes.append(len(parts))
        return with_server_checksum(parts)

    monkeypatch.setattr(server_module, "with_server_checksum", counted)
    sizes = [5 << 20, 6 << 20, 4 << 20]
    offsets = [0, 6 << 20, 13 << 20]
    async with make_client(server) as c:
        c.lend_shared_memory(lent.path)
        fingerprint = await register(c)
        bodies = [body_of(f"stream-{i}", n) for i, n in enumerate(sizes)]
        items = [lent_item(fingerprint, f"stream-{i}", lent.span(at, b)) for i, (at, b) in enumerate(zip(offsets, bodies))]
        bad = lent_item(b"\x01" * 16, "stream-bad", lent.span(18 << 20, body_of("bad", 4 << 20)))
        with pytest.raises(ServiceError) as refused:  # the last record names a model nobody registered
            await c.put_payloads([*items, bad], Durability.LOCAL)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and "record 3" in refused.value.message
        assert all(server.store.meta(i.header.key) is None for i in [*items, bad])
        assert server.ssd.usage().num_records == 0 and not server.ssd._staged

        infos = await c.put_payloads(items, Durability.LOCAL)
        assert c.lent_active and [i.key for i in infos] == [i.header.key for i in items]
        assert passes == []  # each was copied and hashed by its write
        await c.evict([i.header.key for i in items], ["host"], force=True)  # read back from the files
        for i in range(3):
            lent.view[offsets[i]:offsets[i] + sizes[i]] = bytes(sizes[i])  # the sources are gone
        records = await c.get_records([i.header.key for i in items])
    assert [bytes(r.payload) for r in records] == [f"stream-{n}".encode() + b for n, b in enumerate(bodies)]
    assert not server.ssd._staged


async def test_a_closed_client_keeps_no_descriptor_of_lent_memory(server: StateStoreServer, lent: LentFile) -> None:
    """Closing the client closes its descriptor of the lent file, and the server soon unmaps it: the
    owner of that memory (LMCache unlinks its buffer when it closes) gets its pages back, instead of
    a deleted file held open or mapped."""
    def holders() -> list[str]:
        return [fd for fd in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{fd}") == lent.path]

    async with make_client(server) as c:
        c.lend_shared_memory(lent.path)
        fingerprint = await register(c)
        body = body_of("closing", 1 << 20)
        await c.put_payloads([lent_item(fingerprint, "closing", lent.span(0, body))], Durability.MEMORY)
        assert c.lent_active
        held = holders()  # the client's, and the mappings' of the test and of the server (mmap keeps a dup)
        assert len(server.shm) == 2  # the client's window and its lent memory, mapped by the server
    assert len(holders()) == len(held) - 1 and set(holders()) < set(held)
    # The server lets go of both within a second or so (it checks once per TIER_PROBE_S), though
    # no other client attaches anything: the lent pages would otherwise outlive the client.
    for _ in range(50):
        if not len(server.shm):
            break
        await asyncio.sleep(0.1)
    assert len(server.shm) == 0 and len(holders()) == len(held) - 2


async def test_a_client_whose_lent_memory_is_refused_copies_through_the_window(server: StateStoreServer,
                                                                              lent: LentFile) -> None:
    async with make_client(server) as c:
        c.lend_shared_memory(lent.path)
        fingerprint = await register(c)
        os.truncate(lent.path, LENT_BYTES + 4096)  # no longer the size lent: the server refuses it
        body = body_of("refused", 2 << 20)
        item = lent_item(fingerprint, "refused", lent.span(4096, body))
        (info,) = await c.put_payloads([item], Durability.LOCAL)
        assert info.key == item.header.key and c.shm_active and not c.lent_active
        (record,) = await c.get_records([item.header.key])
        assert record is not None and bytes(record.payload) == b"refused" + body


async def raw_put(server: StateStoreServer, metadata: tuple[tuple[str, str], ...],
                  starts: list[common_pb2.RecordStart]) -> grpc.aio.AioRpcError | None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_unary("/statestore.v1.StateStore/PutRecords",
                                    request_serializer=common_pb2.RecordChunk.SerializeToString,
                                    response_deserializer=statestore_pb2.PutRecordsResponse.FromString)
        try:
            await call(iter([common_pb2.RecordChunk(start=s) for s in starts]),
                       metadata=(("authorization", f"Bearer {TOKEN}"), *metadata))
        except grpc.aio.AioRpcError as exc:
            return exc
        return None


async def test_server_refuses_lent_memory_and_lent_fields_it_cannot_trust(server: StateStoreServer, lent: LentFile,
                                                                          tmp_path: Path) -> None:
    async with make_client(server, 0) as c:
        fingerprint = await register(c)
    body = body_of("untrusted", 1 << 20)
    item = lent_item(fingerprint, "untrusted", lent.span(0, body))
    region = ShmRegion(4 << 20)
    window = ShmWindow(region.name, region.secret, DATA_OFFSET, 1 << 20)
    in_slot = item.total_bytes - len(body)
    region.buf[DATA_OFFSET:DATA_OFFSET + in_slot] = item.encode_header() + b"untrusted"
    plain = tmp_path / "plain"
    plain.write_bytes(bytes(LENT_BYTES))
    fds = [os.open(lent.path, os.O_RDWR), os.open(plain, os.O_RDWR)]
    me = f"/proc/{os.getpid()}/fd"
    good = ("x-statestore-lent", f"{me}/{fds[0]} {LENT_BYTES}")

    def start(**kw: int | bool) -> common_pb2.RecordStart:
        fields = {"lent_offset": 0, "lent_bytes": len(body), **kw}
        return common_pb2.RecordStart(key=item.header.key, total_bytes=item.total_bytes,
                                      durability=int(Durability.LOCAL), **fields)

    try:
        refused = {
            "not under /dev/shm": (("x-statestore-lent", f"{me}/{fds[1]} {LENT_BYTES}"),),
            "wrong size": (("x-statestore-lent", f"{me}/{fds[0]} {LENT_BYTES // 2}"),),
            "another process": (("x-statestore-lent", f"/proc/1/fd/0 {LENT_BYTES}"),),
            "garbage": (("x-statestore-lent", "lend me everything"),),
            "gone": (("x-statestore-lent", f"{me}/99999 {LENT_BYTES}"),),
        }
        for why, extra in refused.items():
            exc = await raw_put(server, (window.to_metadata(), *extra), [start()])
            assert exc is not None and exc.code() == grpc.StatusCode.FAILED_PRECONDITION, why
            assert (exc.details() or "").startswith("shm: lent"), (why, exc.details())
        exc = await raw_put(server, (good,), [start()])  # lent memory without a window: a plain stream
        assert exc is not None and exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
        malformed = {
            "no lent memory named": ((window.to_metadata(),), start()),
            "past its end": ((window.to_metadata(), good), start(lent_offset=LENT_BYTES - 10)),
            "the header in lent memory": ((window.to_metadata(), good), start(lent_bytes=item.total_bytes)),
        }
        for why, (metadata, bad) in malformed.items():
            exc = await raw_put(server, metadata, [bad])
            assert exc is not None and exc.code() == grpc.StatusCode.INVALID_ARGUMENT, why
            assert "lent" in (exc.details() or ""), (why, exc.details())
        wide = ShmWindow(region.name, region.secret, DATA_OFFSET, 3 << 20)
        exc = await raw_put(server, (wide.to_metadata(), good), [start(lent_bytes=0, checksum_by_server=True)])
        assert exc is not None and exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "checksum_by_server without lent bytes" in (exc.details() or "")
        assert server.store.meta(item.header.key) is None  # nothing of it was stored
        # The same, trusted, with the checksum left to the server (a zero in the header): stored,
        # under the checksum of the bytes, which every read verifies.
        region.buf[DATA_OFFSET:DATA_OFFSET + HEADER_SIZE] = encode_header(
            item.header, stored_length=item.header.raw_length, flags=0, checksum=0)
        assert await raw_put(server, (window.to_metadata(), good), [start(checksum_by_server=True)]) is None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            get = channel.unary_stream("/statestore.v1.StateStore/GetRecords",
                                       request_serializer=statestore_pb2.GetRecordsRequest.SerializeToString,
                                       response_deserializer=common_pb2.RecordChunk.FromString)
            stream = get(statestore_pb2.GetRecordsRequest(keys=[item.header.key] * 2,
                                                          lent=[common_pb2.LentDestination(total_bytes=1)]),
                         metadata=(("authorization", f"Bearer {TOKEN}"),))
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                _ = [m async for m in stream]
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lent" in raised.value.details()
    finally:
        for fd in fds:
            os.close(fd)
        region.close()
    async with make_client(server, 0) as c:
        (record,) = await c.get_records([item.header.key])
    assert record is not None and bytes(record.payload) == b"untrusted" + body
