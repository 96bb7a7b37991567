"""Opaque records from and into caller-owned buffers: the client's bulk data path.

An integration that holds its bytes in its own buffers (LMCache's MemoryObj, a pinned tensor)
stores them without first building a `Record` (`PayloadPut`: a header and the payload as a few
buffers) and fetches them straight into buffers it allocates once it has seen the record's
header and first bytes (`PayloadSink`). The bytes travel through the same-host shared-memory
window (statestore/shm.py) when the server can attach it, else as gRPC data frames sliced from
the caller's buffers. Either way: one copy out of the caller's buffer on a put, one copy into
the sink's buffer on a get, and the payload checksum verified over the bytes the sink received.

`PayloadTransport` runs the calls; it is built by `StateStoreClient` (which owns the channel and
the protobuf messages: this module imports no generated code) and exposed through
`StateStoreClient.put_payloads` / `get_payloads_into` / `read_heads`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union

import grpc
import xxhash

from statestore.shm import ATTACHED, METADATA_KEY, ShmRegion, ShmSlots, ShmUnavailable, ShmWindow, slot_bytes
from statestore.wire import data_frame
from tiers.record import HEADER_SIZE, RECORD_KEY_BYTES, RecordError, RecordHeader, decode_header, encode_header

logger = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview]
MAX_GET_KEYS = 4096  # the server's key limit per GetRecords
COPY_OFF_LOOP_BYTES = 1 << 20
# Copies that are also hashed go in blocks this large, each hashed while in cache (a 32 MiB
# chunk through shm: ~2.2 ms fused against 2.7-4.5 ms copy-then-hash on the development VM).
HASH_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class PayloadPut:
    """One record to store: its header (tenant left zero: the server stamps the caller's) and
    its payload as buffers in order (`header.raw_length` bytes together)."""

    header: RecordHeader
    parts: tuple[Buffer, ...]

    def __post_init__(self) -> None:
        size = sum(_nbytes(p) for p in self.parts)
        if size != self.header.raw_length:
            raise ValueError(f"payload parts hold {size} bytes, header.raw_length says {self.header.raw_length}")

    @property
    def total_bytes(self) -> int:
        return HEADER_SIZE + self.header.raw_length

    def encode_header(self) -> bytes:
        hasher = xxhash.xxh3_64()
        for part in self.parts:
            hasher.update(part)
        return encode_header(self.header, stored_length=self.header.raw_length, flags=0,
                             checksum=hasher.intdigest())


class PayloadSink(Protocol):
    """Where fetched payloads go. Called on the event loop."""

    def open(self, index: int, header: RecordHeader, head: memoryview) -> tuple[int, memoryview] | None:
        """Record `index` of the request was found: `head` holds its first payload bytes (at
        least `head_bytes`, or the whole payload). Return (skip, dest): the first `skip` payload
        bytes are consumed from `head`, the remaining `raw_length - skip` go into `dest` (exactly
        that long); or None to discard the record."""

    def close(self, index: int, ok: bool) -> None:
        """Record `index` is complete: ok when its checksum matched, else its buffer is garbage."""


@dataclass(frozen=True, slots=True)
class StartInfo:
    """A `RecordStart` as the get stream carries it."""

    key: bytes
    found: bool
    total_bytes: int


class FrameCodec(Protocol):
    """The protobuf side of the stream (implemented in client.py)."""

    def start_frame(self, key: bytes, total_bytes: int, durability: int, pin: bool) -> bytes: ...

    def read_frame(self, frame: bytes) -> memoryview | StartInfo: ...


def _nbytes(buf: Buffer) -> int:
    return memoryview(buf).nbytes


def _flat(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def put_frames(encoded_header: bytes, parts: Sequence[Buffer], step: int) -> Iterator[bytes]:
    """The encoded record as data frames of `step` bytes, sliced from the parts (one copy each)."""
    pending: list[Buffer] = [encoded_header]
    size = len(encoded_header)
    for part in parts:
        view = _flat(part)
        while len(view):
            take = min(step - size, len(view))
            pending.append(view[:take])
            size += take
            view = view[take:]
            if size == step:
                yield data_frame(*pending)
                pending, size = [], 0
    if size:
        yield data_frame(*pending)


def _copy_into_slot(buf: Any, offset: int, item: PayloadPut) -> None:
    """The encoded record into its shm slot: the parts copied in blocks, each hashed right
    after its copy (still in cache: one pass over memory instead of two), then the header with
    that checksum."""
    view = memoryview(buf)
    try:
        hasher = xxhash.xxh3_64()
        at = offset + HEADER_SIZE
        for part in item.parts:
            flat = _flat(part)
            for start in range(0, len(flat), HASH_BLOCK_BYTES):
                block = flat[start:start + HASH_BLOCK_BYTES]
                view[at:at + len(block)] = block
                hasher.update(block)
                at += len(block)
        view[offset:offset + HEADER_SIZE] = encode_header(item.header, stored_length=item.header.raw_length, flags=0,
                                                          checksum=hasher.intdigest())
    finally:
        view.release()


class _Incoming:
    """One found record: header and head gathered, the sink opened, the rest copied into it."""

    def __init__(self, index: int, key: bytes, total_bytes: int, sink: PayloadSink, head_bytes: int) -> None:
        self.index, self.key, self.total_bytes, self.sink = index, key, total_bytes, sink
        self.head_bytes = head_bytes
        self.pending = bytearray()  # header + head until the sink is opened
        self.hasher = xxhash.xxh3_64()
        self.checksum = 0
        self.dest: memoryview | None = None
        self.filled = 0
        self.received = 0
        self.failed: str | None = None

    def fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            logger.warning("statestore: record %s discarded: %s", self.key.hex(), why)

    def start(self, buf: memoryview) -> int | None:
        """Open the sink once `buf` (the record's first bytes) holds header and head; returns
        how many bytes of `buf` were consumed, None while more are needed."""
        if len(buf) < HEADER_SIZE:
            return None
        header, self.checksum = decode_header(buf[:HEADER_SIZE])
        raw = header.raw_length
        if header.flags or HEADER_SIZE + raw != self.total_bytes:
            raise RecordError(f"record of {HEADER_SIZE + raw} bytes (flags {header.flags}) "
                              f"announced as {self.total_bytes} bytes")
        if header.key != self.key:
            raise RecordError("the server answered another key")
        head_len = min(self.head_bytes, raw)
        if len(buf) < HEADER_SIZE + head_len:
            return None
        head = buf[HEADER_SIZE:HEADER_SIZE + head_len]
        opened = self.sink.open(self.index, header, head)
        if opened is None:
            raise RecordError("the sink declined it")
        skip, dest = opened
        self.dest = _flat(dest)  # from here on the sink is told how it ends (finish)
        if not 0 <= skip <= head_len or self.dest.nbytes != raw - skip:
            raise RecordError(f"sink gave skip {skip} and {self.dest.nbytes} bytes for a {raw}-byte payload")
        self.hasher.update(head[:skip])
        return HEADER_SIZE + skip

    def feed(self, data: memoryview) -> None:
        """gRPC data frames, in order."""
        self.received += len(data)
        if self.failed is not None:
            return
        try:
            if self.dest is None:
                self.pending += data
                used = self.start(memoryview(self.pending))
                if used is None:
                    return
                data, self.pending = memoryview(bytes(self.pending[used:])), bytearray()
            self._fill(data)
        except (RecordError, ValueError) as exc:
            self.fail(str(exc))

    def _fill(self, data: memoryview) -> None:
        assert self.dest is not None
        end = self.filled + len(data)
        if end > len(self.dest):
            raise RecordError(f"{end - len(self.dest)} bytes more than the payload holds")
        self.dest[self.filled:end] = data
        self.hasher.update(data)
        self.filled = end

    def fill_from_slot(self, slot: memoryview, skip_bytes: int) -> None:
        """The whole rest of the record from its shm slot (worker thread for large ones), in
        blocks: each is hashed right after its copy, while still in cache."""
        rest = slot[skip_bytes:]
        for start in range(0, len(rest), HASH_BLOCK_BYTES):
            self._fill(rest[start:start + HASH_BLOCK_BYTES])

    def finish(self) -> bool:
        if self.failed is None:
            if self.dest is None or self.filled != len(self.dest):
                self.fail(f"stream ended after {self.received} of {self.total_bytes} bytes")
            elif self.hasher.intdigest() != self.checksum:
                self.fail("payload checksum mismatch")
        ok = self.failed is None
        if self.dest is not None:
            self.dest = None
            self.sink.close(self.index, ok)
        return ok


class PayloadTransport:
    """Runs payload puts and gets over a client's channel, through shm when the server attaches it.

    Args:
        put_call / get_call: the channel's raw PutRecords (stream-unary, bytes in) and GetRecords
            (unary-stream, bytes out) multi-callables.
        codec: builds and reads the non-data messages.
        metadata: the call credentials.
        chunk_bytes: data bytes per gRPC frame.
        shm_bytes: size of the shared-memory region (0: gRPC frames only).
    """

    def __init__(self, put_call: Any, get_call: Any, make_get_request: Callable[[Sequence[bytes], int], Any],
                 codec: FrameCodec, metadata: tuple[tuple[str, str], ...], timeout_s: float | None,
                 chunk_bytes: int, shm_bytes: int = 0) -> None:
        self._put, self._get, self._request = put_call, get_call, make_get_request
        self._codec, self._metadata, self._timeout = codec, metadata, timeout_s
        self._step = chunk_bytes
        self._shm_bytes = shm_bytes
        self._region: ShmRegion | None = None
        self._shm_state: bool | None = None if shm_bytes else False  # None: not probed yet
        self._probe_lock = asyncio.Lock()

    @property
    def shm_active(self) -> bool:
        return bool(self._shm_state)

    # ----- shm -----------------------------------------------------------------------------

    async def _shm(self) -> ShmRegion | None:
        """The region when the server attached it (probed once), else None."""
        if self._shm_state is None:
            async with self._probe_lock:
                if self._shm_state is None:
                    self._shm_state = await self._probe()
        return self._region if self._shm_state else None

    async def _probe(self) -> bool:
        try:
            self._region = ShmRegion(self._shm_bytes)
        except (ShmUnavailable, OSError, ValueError) as exc:
            logger.info("statestore: no shared-memory path (%s)", exc)
            return False
        window = await self._region.lease(1)
        assert window is not None
        try:
            call = self._get(self._request([bytes(RECORD_KEY_BYTES)], 0),
                             metadata=(*self._metadata, window.to_metadata()), timeout=self._timeout)
            attached = _attached(await call.initial_metadata())
            async for _ in call:
                pass
        finally:
            await self._region.release(window)
        if not attached:
            logger.info("statestore: the server did not attach the shared-memory region: gRPC frames only")
            self.disable_shm()
        return attached

    def disable_shm(self) -> None:
        self._shm_state = False
        if self._region is not None:
            self._region.close()
            self._region = None

    # ----- put -----------------------------------------------------------------------------

    async def put(self, items: Sequence[PayloadPut], durability: int, pin: bool) -> Any:
        """One PutRecords call's reply for `items` (through shm when they fit the region)."""
        region = await self._shm()
        if region is not None:
            window = await region.lease(sum(slot_bytes(i.total_bytes) for i in items))
            if window is not None:
                try:
                    return await self._put_shm(region, window, items, durability, pin)
                except grpc.aio.AioRpcError as exc:
                    refused = exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                    if not refused or not (exc.details() or "").startswith("shm:"):
                        raise
                    logger.warning("statestore: shared-memory put refused (%s): gRPC frames from now on", exc.details())
                    self.disable_shm()
                finally:
                    if self._region is region:
                        await region.release(window)
        return await self._put(self._frames(items, durability, pin), metadata=self._metadata, timeout=self._timeout)

    async def _frames(self, items: Sequence[PayloadPut], durability: int, pin: bool) -> AsyncIterator[bytes]:
        for item in items:
            yield self._codec.start_frame(item.header.key, item.total_bytes, durability, pin)
            for frame in put_frames(item.encode_header(), item.parts, self._step):
                yield frame

    async def _put_shm(self, region: ShmRegion, window: ShmWindow, items: Sequence[PayloadPut], durability: int,
                       pin: bool) -> Any:
        slots = ShmSlots(window)
        for item in items:
            at = slots.take(item.total_bytes)
            assert at is not None, "the lease was sized for every item"
            if item.total_bytes >= COPY_OFF_LOOP_BYTES:  # checksum and copy off the loop
                await asyncio.to_thread(_copy_into_slot, region.buf, at, item)
            else:
                _copy_into_slot(region.buf, at, item)
        starts = [self._codec.start_frame(i.header.key, i.total_bytes, durability, pin) for i in items]
        return await self._put(iter(starts), metadata=(*self._metadata, window.to_metadata()), timeout=self._timeout)

    # ----- get -----------------------------------------------------------------------------

    async def get_into(self, keys: Sequence[bytes], sink: PayloadSink, head_bytes: int) -> list[bool]:
        """For each key: True when its payload landed in the sink verified, False for a miss or a
        discarded record. Errors of the call raise (grpc.aio.AioRpcError)."""
        out: list[bool] = []
        while len(out) < len(keys):
            batch = keys[len(out):len(out) + MAX_GET_KEYS]
            got = await self._get_batch(batch, len(out), sink, head_bytes)
            if not got:
                raise RecordError("the server answered none of the keys")
            out += got
        return out

    async def _get_batch(self, keys: Sequence[bytes], base: int, sink: PayloadSink, head_bytes: int) -> list[bool]:
        region = await self._shm()
        window = await region.lease(min(region.capacity, max(region.capacity // 2, 1))) if region else None
        metadata = self._metadata if window is None else (*self._metadata, window.to_metadata())
        try:
            call = self._get(self._request(keys, self._step), metadata=metadata, timeout=self._timeout)
            slots = ShmSlots(window) if window is not None and _attached(await call.initial_metadata()) else None
            return await self._read_stream(call, keys, base, sink, head_bytes, slots, region)
        finally:
            if window is not None and region is not None:
                await region.release(window)

    async def _read_stream(self, call: Any, keys: Sequence[bytes], base: int, sink: PayloadSink, head_bytes: int,
                           slots: ShmSlots | None, region: ShmRegion | None) -> list[bool]:
        out: list[bool] = []
        current: _Incoming | None = None
        try:
            async for frame in call:
                msg = self._codec.read_frame(frame)
                if isinstance(msg, memoryview):
                    if current is None:
                        raise RecordError("data before a record start")
                    current.feed(msg)
                    continue
                if current is not None:
                    out.append(current.finish())
                    current = None
                if len(out) >= len(keys) or msg.key != keys[len(out)]:
                    raise RecordError("the server answered another key or more records than asked for")
                if not msg.found:
                    out.append(False)
                    continue
                incoming = _Incoming(base + len(out), msg.key, msg.total_bytes, sink, head_bytes)
                at = slots.take(msg.total_bytes) if slots is not None else None
                if at is None:
                    current = incoming  # its bytes follow as data frames
                else:
                    assert region is not None
                    out.append(await _deliver_from_slot(region, at, incoming))
            if current is not None:
                out.append(current.finish())
                current = None
        except BaseException:
            if current is not None:
                current.fail("the call failed")
                current.finish()
            for i, ok in enumerate(out):
                if ok:
                    sink.close(base + i, False)  # not delivered: the caller sees the whole batch fail
            raise
        if len(out) < len(keys) and slots is None:
            raise RecordError(f"the server answered {len(out)} of {len(keys)} keys")
        return out

    # ----- heads ---------------------------------------------------------------------------

    async def read_head(self, key: bytes, num_bytes: int) -> tuple[RecordHeader, bytes] | None:
        """The header and first `num_bytes` payload bytes of one record (gRPC; the stream is
        cancelled after the first frame that completes them)."""
        step = max(4096, HEADER_SIZE + num_bytes)
        call = self._get(self._request([key], step), metadata=self._metadata, timeout=self._timeout)
        head = bytearray()
        try:
            async for frame in call:
                msg = self._codec.read_frame(frame)
                if isinstance(msg, StartInfo):
                    if not msg.found:
                        return None
                    continue
                head += msg
                if len(head) >= HEADER_SIZE:
                    header, _ = decode_header(memoryview(head)[:HEADER_SIZE])
                    want = HEADER_SIZE + min(num_bytes, header.raw_length)
                    if len(head) >= want:
                        return header, bytes(head[HEADER_SIZE:want])
            return None
        finally:
            call.cancel()

    def close(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None


def _attached(metadata: Any) -> bool:
    return any(k == METADATA_KEY and v in (ATTACHED, ATTACHED.encode()) for k, v in metadata or ())


async def _deliver_from_slot(region: ShmRegion, at: int, incoming: _Incoming) -> bool:
    """A record the server put in a shm slot, into the sink: header and head read in place, the
    rest copied (off the loop when large), the checksum over what the sink got."""
    slot = memoryview(region.buf)[at:at + incoming.total_bytes]
    try:
        try:
            used = incoming.start(slot)
            if used is None:
                raise RecordError("a truncated record in its slot")
            incoming.received = incoming.total_bytes
            if incoming.total_bytes - used >= COPY_OFF_LOOP_BYTES:
                await asyncio.to_thread(incoming.fill_from_slot, slot, used)
            else:
                incoming.fill_from_slot(slot, used)
        except (RecordError, ValueError) as exc:
            incoming.fail(str(exc))
        return incoming.finish()
    finally:
        slot.release()
