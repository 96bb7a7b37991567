"""A PutRecords stream turned into whole, verified records: `Reassembler` collects each
record's start and data messages (or its bytes in the caller's shared memory), and `Stager`
assembles the large ones where they will be written, verifying checksums as it copies.

Nothing here stores anything: the servicer puts the records only once every one of the
stream's records has been verified, so a malformed or interrupted stream changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import xxhash
from google.protobuf.message import DecodeError

from proto.statestore.v1 import common_pb2
from statestore.messages import record_key
from statestore.rpc import BadField
from statestore.wire import OFFLOAD_BYTES, PartsChecksum, copy_hashed, split_data_frame
from tiers.record import HEADER_SIZE, RECORD_KEY_BYTES, Record, RecordError, decode_header, encode_header

logger = logging.getLogger(__name__)

STAGE_MIN_BYTES = 1 << 20  # records this large are assembled in the SSD tier's aligned buffers (`Stager`)
DEFER_FILL_MIN_BYTES = 4 << 20  # a LOCAL shm record this large may be copied out by the SSD tier's write
MAX_STAGED_PER_CALL = 8  # beyond these (per PutRecords call) records are joined in the heap


class Reassembler:
    """Collects the start + data messages of a PutRecords stream into whole encoded records."""

    def __init__(self, max_record_bytes: int, max_stream_bytes: int, *, data_in_shm: bool = False) -> None:
        self._max_record, self._max_stream = max_record_bytes, max_stream_bytes
        self._data_in_shm = data_in_shm  # the stream carries starts only (statestore/shm.py)
        self.done: list[tuple[common_pb2.RecordStart, list[bytes | memoryview]]] = []
        self.sums: list[int | None] = []  # per done record: its payload's xxh3 taken part by part, if it came in parts
        self._summed = PartsChecksum()
        self._start: common_pb2.RecordStart | None = None
        self._parts: list[bytes | memoryview] = []
        self._received = 0
        self._total = 0

    def feed_frame(self, frame: bytes | common_pb2.RecordChunk) -> None:
        """One message as the wire carried it: serialized bytes (the fast path), or a parsed chunk."""
        if not isinstance(frame, bytes):
            self.feed(frame)
            return
        data = split_data_frame(frame)
        if data is not None:
            self._feed_data(data)
            return
        try:
            chunk = common_pb2.RecordChunk.FromString(frame)
        except DecodeError:
            raise BadField(f"record {len(self.done)}: a message that is not a RecordChunk") from None
        self.feed(chunk)

    @property
    def _where(self) -> str:  # for error messages only: a property, so the hot path formats nothing
        return f"record {len(self.done)}"

    def feed(self, chunk: common_pb2.RecordChunk) -> None:
        part = chunk.WhichOneof("part")
        if part == "start":
            self._finish()
            start = chunk.start
            if len(start.key) != RECORD_KEY_BYTES:
                record_key(start.key, f"{self._where}: start.key")  # raises, naming the field
            if not HEADER_SIZE <= start.total_bytes <= self._max_record:
                raise BadField(f"{self._where}: start.total_bytes {start.total_bytes} outside [{HEADER_SIZE}, "
                                f"{self._max_record}] (header size .. the server's max_record_bytes)")
            if (start.lent_bytes or start.lent_offset) and not self._data_in_shm:
                raise BadField(f"{self._where}: start.lent_bytes / lent_offset in a PutRecords without shared memory")
            self._total += start.total_bytes
            if self._total > self._max_stream:
                raise BadField(f"{self._where}: the stream's records exceed max_stream_bytes {self._max_stream}; "
                                f"send them in several PutRecords calls")
            self._start = start
        elif part == "data":
            self._feed_data(chunk.data)
        else:
            raise BadField(f"{self._where}: an empty RecordChunk (set start or data)")

    def _feed_data(self, data: bytes | memoryview) -> None:
        if self._start is None:
            raise BadField(f"{self._where}: a data chunk came before its start message")
        if self._data_in_shm:
            raise BadField(f"{self._where}: a data chunk in a shared-memory PutRecords (its bytes are in the window)")
        if self._received + len(data) > self._start.total_bytes:
            raise BadField(f"{self._where}: data exceeds start.total_bytes {self._start.total_bytes}")
        self._parts.append(data)
        self._summed.add(self._parts)  # hashed while the part's bytes are in cache
        self._received += len(data)

    def _finish(self) -> None:
        if self._start is None:
            return
        if self._received != self._start.total_bytes and not self._data_in_shm:
            raise BadField(f"record {len(self.done)}: stream ended after {self._received} of "
                            f"start.total_bytes {self._start.total_bytes} bytes")
        self.done.append((self._start, self._parts))
        self.sums.append(self._summed.value())
        self._start, self._parts, self._received, self._summed = None, [], 0, PartsChecksum()

    def records(self) -> list[tuple[common_pb2.RecordStart, list[bytes | memoryview]]]:
        self._finish()
        if not self.done:
            raise BadField("PutRecords: the stream carried no records")
        return self.done



class Stager:
    """Assembles the large records of one PutRecords call in the SSD tier's pooled, aligned
    buffers (`SSDTier.staging`) instead of joining them in a fresh heap allocation: the payload
    is copied out of the client's shared-memory window or its message parts once, hashed block
    by block as it is copied, into memory that is already mapped (a fresh 32 MiB join faulted
    in its pages on every call: ~10 ms); and a LOCAL put writes that buffer with O_DIRECT as it
    lies, without copying the payload again. The buffers stay staged until the call's puts are
    done (`stack`); a record kept afterwards (by the host tier, a reader) holds a plain view."""

    def __init__(self, ssd: Any, stack: contextlib.ExitStack, host: Any = None) -> None:
        self._ssd, self._stack, self._host = ssd, stack, host
        self._num_staged = 0
        self._deferred: list[Any] = []  # staged buffers whose fill was left to the SSD tier's write
        self._in_host: list[Any] = []  # payloads staged in host pages (`stage_in_host`)

    def stage_in_host(self, record: Record) -> None:
        """Copy a verified MEMORY record into host-tier pages now (`HostTier.stage`), while the
        rest of the stream still comes in: its put after the stream then takes them without a
        copy. Pages no put took go back when the call ends (a later record refused, a failure)."""
        if self._host is not None and self._host.stage(record):
            if not self._in_host:  # one callback per call, not per record
                self._stack.callback(self._unstage_in_host)
            self._in_host.append(record.payload)

    def _unstage_in_host(self) -> None:
        for payload in self._in_host:
            self._host.unstage(payload)
        self._in_host.clear()

    def settle(self) -> None:
        """After the call's puts: a deferred fill that no write consumed means nothing was
        stored from it (the SSD tier, a LOCAL put's first write, refused or failed first)."""
        for staged in self._deferred:
            if staged.pending:
                logger.debug("PutRecords: a deferred fill was not consumed (the put did not reach the SSD tier)")
        self._deferred.clear()

    def check_consumed(self) -> None:
        """After the call's puts succeeded: every deferred fill was done (and verified) by the
        SSD tier's write; anything else would be a store that wrote another tier first."""
        if any(staged.pending for staged in self._deferred):
            raise RuntimeError("a LOCAL put was acknowledged without the SSD tier's write verifying its payload")

    async def join(self, parts: Sequence[bytes | memoryview], start: common_pb2.RecordStart,
                   payload_sum: int | None, shared: bool, *, defer: bool = False,
                   checksum_by_server: bool = False) -> Record | None:
        """The verified record, its payload in a staged buffer; None when it is not worth
        staging (small, or in one message frame: kept as a view) or cannot be (compressed, a
        foreign split of the header): `join_parts` then. RecordError as `join_parts` says it.

        `defer` (a LOCAL record of a shared-memory stream, >= DEFER_FILL_MIN_BYTES: one alone, or
        one whose checksum the server takes, as no checksum of its could fail later): the copy
        and its checksum are left to the SSD tier, which copies the payload out of the window
        piece by piece while it writes the previous piece, and verifies it before the record
        becomes visible (`tiers._fs.Staged.defer_fill`); a mismatch fails the put with the same
        INVALID_ARGUMENT and leaves nothing. The SSD tier is a LOCAL put's first write (the
        store writes the durability tier before any cache copy), so nothing reads the payload
        before it is verified.

        `checksum_by_server` (the header's checksum is not the client's, `RecordStart`): only a
        deferred record is staged, its fill taking the checksum for the header written last;
        for any other the call returns None (see `with_server_checksum`)."""
        total = start.total_bytes
        if self._ssd is None or total < STAGE_MIN_BYTES or self._num_staged >= MAX_STAGED_PER_CALL \
                or (len(parts) == 1 and not shared) or len(parts[0]) < HEADER_SIZE:
            return None
        header, checksum = decode_header(memoryview(parts[0])[:HEADER_SIZE])
        if header.flags:
            return None
        if HEADER_SIZE + header.stored_length != total:
            have = total - HEADER_SIZE
            raise RecordError(f"truncated payload: {have} of {header.stored_length} bytes"
                              if have < header.stored_length else
                              f"{have - header.stored_length} trailing bytes after the payload")
        deferred = defer and shared and total >= DEFER_FILL_MIN_BYTES
        if checksum_by_server and not deferred:
            return None
        staged = self._stack.enter_context(self._ssd.staging(header.stored_length))
        self._num_staged += 1
        pieces = [memoryview(parts[0])[HEADER_SIZE:], *parts[1:]]
        if deferred:
            if header.key != start.key:
                raise RecordError("record key does not match the key it was stored under")
            taken = None if checksum_by_server else checksum  # None: the fill takes it
            staged.defer_fill([memoryview(p) for p in pieces], taken)
            self._deferred.append(staged)
            return Record(header, staged.payload, taken)
        hash_parts = shared or payload_sum is None
        if total >= OFFLOAD_BYTES:
            got = await asyncio.to_thread(copy_hashed, staged.dest, pieces, hash_parts=hash_parts)
        else:
            got = copy_hashed(staged.dest, pieces, hash_parts=hash_parts)
        if (got if hash_parts else payload_sum) != checksum:
            raise RecordError("payload checksum mismatch: the payload is corrupt")
        if header.key != start.key:
            raise RecordError("record key does not match the key it was stored under")
        return Record(header, staged.payload, checksum)


def with_server_checksum(parts: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """A record's parts (header first) whose header's payload checksum the client left to the
    server, with the header made again around the checksum of the payload as the parts hold it
    now (a pass over it): the checks that follow then verify what they copy against that. A
    client writing its memory meanwhile only gets its own put refused."""
    if len(parts[0]) < HEADER_SIZE:
        raise RecordError(f"a {len(parts[0])}-byte first part: the header must lie in the slot")
    header, _ = decode_header(memoryview(parts[0])[:HEADER_SIZE])
    if header.flags:
        raise RecordError("checksum_by_server on an encoded (compressed) payload")
    hasher = xxhash.xxh3_64()
    pieces = [memoryview(parts[0])[HEADER_SIZE:], *parts[1:]]
    for piece in pieces:
        hasher.update(piece)
    head = encode_header(header, stored_length=header.stored_length, flags=0, checksum=hasher.intdigest())
    return [head, *pieces]
