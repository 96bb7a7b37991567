"""Opaque records from and into caller-owned buffers: the client's bulk data path.

An integration that holds its bytes in its own buffers (LMCache's MemoryObj, a pinned tensor)
stores them without first building a `Record` (`PayloadPut`: a header and the payload as a few
buffers) and fetches them straight into buffers it allocates once it has seen the record's
header and first bytes (`PayloadSink`). The bytes travel through the same-host shared-memory
window (statestore/shm.py) when the server can attach it, else as gRPC data frames sliced from
the caller's buffers. Either way: one copy out of the caller's buffer on a put, one copy into
the sink's buffer on a get, and the payload checksum verified over the bytes the sink received.

A caller whose buffers lie in a shared-memory file of its own (`lend`: LMCache's CPU buffer with
`shm_name`) skips those copies: a put names the bulk of a record as a `LentSpan` (where it lies
in that file), which the server copies out itself, and a get may name where in that file it
wants each record's bulk (`LentDestination`), which the server delivers there. The client then
neither copies nor hashes those bytes: the server takes a put's checksum as it copies them out
(`checksum_by_server`) and verifies a get's as it delivers them (`verified`).

`PayloadTransport` runs the calls; it is built by `StateStoreClient` (which owns the channel and
the protobuf messages: this module imports no generated code) and exposed through
`StateStoreClient.put_payloads` / `get_payloads_into` / `read_heads`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union

import grpc
import xxhash

from statestore.shm import (ATTACHED, METADATA_KEY, LentRegion, LentSpan, ShmRegion, ShmSlots, ShmUnavailable,
                            ShmWindow, slot_bytes)
from statestore.wire import data_frame
from tiers.offload import to_thread_to_completion
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
    its payload as buffers in order (`header.raw_length` bytes together). The last part may be
    a `LentSpan`: bytes that lie in the caller's lent shared memory (`PayloadTransport.lend`)."""

    header: RecordHeader
    parts: tuple[Buffer | LentSpan, ...]

    def __post_init__(self) -> None:
        size = sum(_nbytes(p) for p in self.parts)
        if size != self.header.raw_length:
            raise ValueError(f"payload parts hold {size} bytes, header.raw_length says {self.header.raw_length}")

    @property
    def total_bytes(self) -> int:
        return HEADER_SIZE + self.header.raw_length

    @property
    def lent(self) -> LentSpan | None:
        last = self.parts[-1] if self.parts else None
        return last if isinstance(last, LentSpan) else None

    def encode_header(self) -> bytes:
        hasher = xxhash.xxh3_64()
        for part in self.parts:
            hasher.update(_bytes_of(part))
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

    # Optional, for a sink whose buffers lie in lent memory (`PayloadTransport.lend`):
    #
    # def lent_destination(self, index: int) -> tuple[int, LentSpan] | None:
    #     """Before the call: (encoded length, span) to have the last `len(span.view)` bytes of
    #     record `index` delivered straight into the span if its encoded length is exactly that
    #     (`open` then takes them in place by returning `span.view` itself as its dest)."""


@dataclass(frozen=True, slots=True)
class StartInfo:
    """A `RecordStart` as the get stream carries it."""

    key: bytes
    found: bool
    total_bytes: int
    lent_offset: int = 0
    lent_bytes: int = 0
    verified: bool = False  # the server hashed the payload as it delivered it into lent memory


class FrameCodec(Protocol):
    """The protobuf side of the stream (implemented in client.py)."""

    def start_frame(self, key: bytes, total_bytes: int, durability: int, pin: bool, lent_offset: int = 0,
                    lent_bytes: int = 0, checksum_by_server: bool = False) -> bytes: ...

    def read_frame(self, frame: bytes) -> memoryview | StartInfo: ...


def _bytes_of(part: Buffer | LentSpan) -> Buffer:
    return part.view if isinstance(part, LentSpan) else part


def _nbytes(buf: Buffer | LentSpan) -> int:
    return memoryview(_bytes_of(buf)).nbytes


def _flat(buf: Buffer | LentSpan) -> memoryview:
    view = memoryview(_bytes_of(buf))
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def put_frames(encoded_header: bytes, parts: Sequence[Buffer | LentSpan], step: int) -> Iterator[bytes]:
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


def _copy_into_slot(buf: Any, offset: int, item: PayloadPut, lent: bool = False, hashed: bool = True) -> None:
    """The encoded record into its shm slot: the parts copied in blocks, each hashed right
    after its copy (still in cache: one pass over memory instead of two), then the header with
    that checksum. `lent`: the item's `LentSpan` stays where it lies and is only hashed;
    `hashed` False: nothing is hashed and the header's checksum is left zero, for the server
    to take (`RecordStart.checksum_by_server`)."""
    view = memoryview(buf)
    try:
        hasher = xxhash.xxh3_64() if hashed else None
        at = offset + HEADER_SIZE
        for part in item.parts:
            if lent and isinstance(part, LentSpan):
                if hasher is not None:
                    hasher.update(part.view)
                continue
            flat = _flat(part)
            for start in range(0, len(flat), HASH_BLOCK_BYTES):
                block = flat[start:start + HASH_BLOCK_BYTES]
                view[at:at + len(block)] = block
                if hasher is not None:
                    hasher.update(block)
                at += len(block)
        view[offset:offset + HEADER_SIZE] = encode_header(item.header, stored_length=item.header.raw_length, flags=0,
                                                          checksum=hasher.intdigest() if hasher is not None else 0)
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
        self.given: Any = None
        self.verified = False
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
        self.given = dest  # the sink's own object: is it the lent span's view? (`_deliver_from_slot`)
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

    def fill_from_parts(self, parts: Sequence[memoryview], skip_bytes: int) -> None:
        """The whole rest of the record from its shm slot (and lent span), laid end to end
        (worker thread for large ones), in blocks: each is hashed right after its copy, while
        still in cache."""
        for part in parts:
            rest = part[skip_bytes:]
            skip_bytes = max(0, skip_bytes - len(part))
            for start in range(0, len(rest), HASH_BLOCK_BYTES):
                self._fill(rest[start:start + HASH_BLOCK_BYTES])

    def take_in_place(self, view: memoryview, verified: bool = False) -> None:
        """The rest of the record already lies in the sink's dest (delivered into lent memory):
        hash it there, unless the server says it hashed exactly those bytes as it delivered them
        (`verified`: the checksum is then the server's, over the bytes in the caller's memory)."""
        assert self.dest is not None and len(view) == len(self.dest) - self.filled
        if verified:
            self.verified = True
        else:
            self.hasher.update(view)
        self.filled = len(self.dest)

    def finish(self) -> bool:
        if self.failed is None:
            if self.dest is None or self.filled != len(self.dest):
                self.fail(f"stream ended after {self.received} of {self.total_bytes} bytes")
            elif not self.verified and self.hasher.intdigest() != self.checksum:
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
        put_one: PutRecords as a unary multi-callable (bytes in), for a stream of one message.
        codec: builds and reads the non-data messages.
        metadata: the call credentials.
        chunk_bytes: data bytes per gRPC frame.
        shm_bytes: size of the shared-memory region (0: gRPC frames only).
    """

    def __init__(self, put_call: Any, get_call: Any, make_get_request: Callable[[Sequence[bytes], int], Any],
                 codec: FrameCodec, metadata: tuple[tuple[str, str], ...], timeout_s: float | None,
                 chunk_bytes: int, shm_bytes: int = 0, put_one: Any = None) -> None:
        self._put, self._get, self._request = put_call, get_call, make_get_request
        self._put_one = put_one
        self._codec, self._metadata, self._timeout = codec, metadata, timeout_s
        self._step = chunk_bytes
        self._shm_bytes = shm_bytes
        self._region: ShmRegion | None = None
        self._lent: LentRegion | None = None
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
        self.unlend()

    def lend(self, path: str) -> None:
        """Lend the server the caller's shared-memory file `path` (under /dev/shm) beside the
        window: `LentSpan` parts and `LentDestination`s then name places in it. OSError or
        ShmUnavailable if it cannot be opened; without shm it is never used."""
        self.unlend()
        if self._shm_bytes:
            self._lent = LentRegion(path)

    def unlend(self) -> None:
        if self._lent is not None:
            self._lent.close()
            self._lent = None

    @property
    def lent_active(self) -> bool:
        return self._lent is not None and bool(self._shm_state)

    def _lent_for(self, items: Sequence[PayloadPut]) -> LentRegion | None:
        """The lent region when some item has a `LentSpan` and every such span lies inside it."""
        lent = self._lent
        spans = [i.lent for i in items if i.lent is not None]
        return lent if lent is not None and spans and all(lent.holds(s) for s in spans) else None

    # ----- put -----------------------------------------------------------------------------

    async def put(self, items: Sequence[PayloadPut], durability: int, pin: bool) -> Any:
        """One PutRecords call's reply for `items` (through shm when they fit the region)."""
        while (region := await self._shm()) is not None:
            lent = self._lent_for(items)
            window = await region.lease(sum(slot_bytes(i.total_bytes - (len(i.lent.view) if lent and i.lent else 0))
                                            for i in items))
            if window is None:
                break
            try:
                return await self._put_shm(region, window, items, durability, pin, lent)
            except grpc.aio.AioRpcError as exc:
                refused = exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                if not refused or not (exc.details() or "").startswith("shm:"):
                    raise
                if lent is not None and (exc.details() or "").startswith("shm: lent"):
                    logger.warning("statestore: lent memory refused (%s): copied through the window from now on",
                                   exc.details())
                    self.unlend()
                    continue
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
                       pin: bool, lent: LentRegion | None) -> Any:
        slots = ShmSlots(window)
        starts = []
        for item in items:
            span = item.lent if lent is not None else None
            in_slot = item.total_bytes - (len(span.view) if span else 0)
            at = slots.take(in_slot)
            assert at is not None, "the lease was sized for every item"
            # A large lent span is left to the server to hash as it copies it out (one pass over
            # that memory instead of two); the rest of the record is small then: copied here.
            by_server = span is not None and len(span.view) >= COPY_OFF_LOOP_BYTES
            if not by_server and item.total_bytes >= COPY_OFF_LOOP_BYTES:  # checksum and copy off the loop
                await to_thread_to_completion(_copy_into_slot, region.buf, at, item, span is not None)
            else:
                _copy_into_slot(region.buf, at, item, span is not None, hashed=not by_server)
            starts.append(self._codec.start_frame(item.header.key, item.total_bytes, durability, pin,
                                                  *((span.offset, len(span.view), by_server) if span else ())))
        metadata = (*self._metadata, window.to_metadata(), *((lent.to_metadata(),) if lent is not None else ()))
        if len(starts) == 1 and self._put_one is not None:
            return await self._put_one(starts[0], metadata=metadata, timeout=self._timeout)
        return await self._put(iter(starts), metadata=metadata, timeout=self._timeout)

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
        spans = self._lent_destinations(sink, base, len(keys)) if window is not None else None
        if spans is not None:
            assert self._lent is not None
            metadata = (*metadata, self._lent.to_metadata())
        try:
            request = self._request(keys, self._step, [(t, s.offset, len(s.view)) if s else (0, 0, 0)
                                                       for t, s in spans] if spans else ())
            call = self._get(request, metadata=metadata, timeout=self._timeout)
            slots = ShmSlots(window) if window is not None and _attached(await call.initial_metadata()) else None
            return await self._read_stream(call, keys, base, sink, head_bytes, slots, region, spans)
        finally:
            if window is not None and region is not None:
                await region.release(window)

    def _lent_destinations(self, sink: PayloadSink, base: int, count: int
                           ) -> list[tuple[int, LentSpan | None]] | None:
        """Per key, the sink's lent destination (`PayloadSink.lent_destination`), or None when
        there is no lent memory, the sink offers none, or none lies inside the lent file."""
        ask = getattr(sink, "lent_destination", None)
        lent = self._lent
        if ask is None or lent is None:
            return None
        spans: list[tuple[int, LentSpan | None]] = []
        for i in range(count):
            got = ask(base + i)
            spans.append(got if got is not None and lent.holds(got[1]) and len(got[1].view) else (0, None))
        return spans if any(s for _, s in spans) else None

    async def _read_stream(self, call: Any, keys: Sequence[bytes], base: int, sink: PayloadSink, head_bytes: int,
                           slots: ShmSlots | None, region: ShmRegion | None,
                           spans: Sequence[tuple[int, LentSpan | None]] | None = None) -> list[bool]:
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
                lent = _lent_span(msg, spans[len(out)][1] if spans else None)
                at = slots.take(msg.total_bytes - (len(lent.view) if lent else 0)) if slots is not None else None
                if at is None:
                    current = incoming  # its bytes follow as data frames
                else:
                    assert region is not None
                    out.append(await _deliver_from_slot(region, at, incoming, lent, msg.verified and lent is not None))
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
        """Unmap the window and close the descriptor of lent memory: a client that kept it open
        kept the pages of a lent file its owner had freed (LMCache unlinks its buffer at close)."""
        if self._region is not None:
            self._region.close()
            self._region = None
        self.unlend()


def _attached(metadata: Any) -> bool:
    return any(k == METADATA_KEY and v in (ATTACHED, ATTACHED.encode()) for k, v in metadata or ())


def _lent_span(start: StartInfo, asked: LentSpan | None) -> LentSpan | None:
    """The lent span a record start says the server delivered into (it must be the one asked)."""
    if not start.lent_bytes and not start.lent_offset:
        return None
    if asked is None or start.lent_offset != asked.offset or start.lent_bytes != len(asked.view):
        raise RecordError("the server delivered into lent memory the caller did not name for this record")
    return asked


async def _deliver_from_slot(region: ShmRegion, at: int, incoming: _Incoming, lent: LentSpan | None = None,
                             verified: bool = False) -> bool:
    """A record the server put in a shm slot, into the sink: header and head read in place, the
    rest copied (off the loop when large), the checksum over what the sink got. With `lent`,
    the record's last bytes lie in that span: taken in place when the sink's dest is the span's
    own view (hashed only, or not at all when the server `verified` them as it delivered them),
    else copied like the rest."""
    in_slot = incoming.total_bytes - (len(lent.view) if lent is not None else 0)
    slot = memoryview(region.buf)[at:at + in_slot]
    try:
        try:
            parts = [slot] if lent is None else [slot, lent.view]
            head = slot if lent is None or len(slot) >= HEADER_SIZE + incoming.head_bytes else \
                memoryview(bytes(slot) + bytes(lent.view[:HEADER_SIZE + incoming.head_bytes - len(slot)]))
            used = incoming.start(head)
            if used is None:
                raise RecordError("a truncated record in its slot")
            incoming.received = incoming.total_bytes
            if lent is not None and used == in_slot and incoming.given is lent.view:
                work = functools.partial(incoming.take_in_place, lent.view, verified)
            else:
                work = functools.partial(incoming.fill_from_parts, parts, used)
                verified = False
            if incoming.total_bytes - used >= COPY_OFF_LOOP_BYTES and not verified:
                await to_thread_to_completion(work)  # it writes into the sink: over before this returns
            else:
                work()
        except (RecordError, ValueError) as exc:
            incoming.fail(str(exc))
        return incoming.finish()
    finally:
        slot.release()
