"""Records on the wire: split into chunks and reassembled with one copy of the payload.

A record travels (in `RecordChunk.data` messages, after a `RecordStart`) as its encoded bytes
(tiers/record.py): the 168-byte header, then the payload. The sender puts the whole header at
the front of the first chunk, so neither side ever builds the concatenated record: the
sender slices the payload it has, the receiver joins the payload pieces once and verifies the
header and payload checksums. Chunks split any other way (a foreign client) fall back to
`decode_record` on the joined bytes: same checks, same error messages, one copy more.
On GetRecords the frames of a record in the host tier are filled straight from its pages
(`frame_slices` gives the layout, `HostTier.read_slices` copies and verifies): one copy from
RAM to the wire, the tier knowing nothing of frames; and a client keeps a record that came in
one frame as a view into that frame (`join_parts(keep_view=True)`), with no copy at all.
Messages, not bytes, dominate the cost of small records, so the header never travels alone
nor costs a message: a chunk carries up to `chunk_bytes` of payload, the first one the header
besides, and a record takes as many messages as its payload alone would.

The bulk data path also skips protobuf objects: a `RecordChunk` holding only `data` is, on
the wire, the byte 0x12 (field 2, length-delimited), a varint length and the bytes, so
`data_frame` builds that serialized message with one copy of the slice and
`split_data_frame` reads it back without copying. Anything else (a `start`, or a frame a
foreign client encoded differently) goes through the generated protobuf classes in
store_service.py/client.py, which import them; this module imports no generated code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import xxhash

from tiers.record import (HEADER_SIZE, Record, RecordError, copy_gathered, decode_header, decode_record, encode_header,
                          payload_checksum)


Buffer = Union[bytes, memoryview]
OFFLOAD_BYTES = 16 << 20  # records this large are joined and verified off the event loop (smaller: ~1 ms)
_DATA_TAG = 0x12  # RecordChunk.data (proto/statestore/v1/common.proto): field 2, wire type 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def data_frame(*pieces: Buffer) -> bytes:
    """The serialized `RecordChunk{data: pieces joined}`, built with one copy of the pieces."""
    return b"".join((bytes((_DATA_TAG,)), _varint(sum(len(p) for p in pieces)), *pieces))


def split_data_frame(frame: bytes) -> memoryview | None:
    """The data of a serialized `RecordChunk` that holds exactly one `data` field (no copy), else None."""
    if len(frame) < 2 or frame[0] != _DATA_TAG:
        return None
    length, shift, pos = 0, 0, 1
    while pos < len(frame) and pos <= 10:
        byte = frame[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return memoryview(frame)[pos:] if pos + length == len(frame) else None
        shift += 7
    return None


def encoded_size(record: Record) -> int:
    """Bytes of the record on the wire (uncompressed encoding)."""
    return HEADER_SIZE + len(record.payload)


def record_frames(record: Record, chunk_bytes: int) -> Iterator[bytes]:
    """The encoded record as serialized `RecordChunk{data}` frames, each carrying at most
    `chunk_bytes` payload bytes; the first also carries the header. A record travels in as
    many messages as its payload alone would (the header never costs a message of its own),
    so each frame is at most `chunk_bytes + HEADER_SIZE` data bytes."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes {chunk_bytes} must be positive")
    payload = record.payload
    header = encode_header(record.header, stored_length=len(payload), flags=0, checksum=record.payload_sum())
    view = memoryview(payload)
    yield data_frame(header, view[:chunk_bytes])
    for offset in range(chunk_bytes, len(payload), chunk_bytes):
        yield data_frame(view[offset:offset + chunk_bytes])


def frame_slices(chunk_bytes: int) -> Callable[[bytes, int], list[tuple[bytes, int, int]]]:
    """The layout of `record_frames` as (prefix, start, stop) slices of the payload, for a
    tier that copies a record's payload straight into its frames (`HostTier.read_slices`):
    each frame is its prefix (tag, length, and in the first the encoded header) followed by
    payload bytes start..stop."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes {chunk_bytes} must be positive")

    def layout(header: bytes, payload_len: int) -> list[tuple[bytes, int, int]]:
        first = min(chunk_bytes, payload_len)
        out = [(b"".join((bytes((_DATA_TAG,)), _varint(len(header) + first), header)), 0, first)]
        for offset in range(chunk_bytes, payload_len, chunk_bytes):
            stop = min(payload_len, offset + chunk_bytes)
            out.append((bytes((_DATA_TAG,)) + _varint(stop - offset), offset, stop))
        return out

    return layout


def copy_hashed(dest: memoryview, parts: Sequence[Buffer], *, hash_parts: bool = True) -> int | None:
    """Copy `parts` one after another into `dest` (exactly as long) and return the xxh3 of what
    was copied, hashed block by block right after each block's copy (`tiers.record.copy_gathered`);
    with `hash_parts=False` only copy (None)."""
    size = sum(len(memoryview(part)) for part in parts)
    if size != len(dest):
        raise ValueError(f"copy_hashed: {size} bytes for a {len(dest)}-byte destination")
    hasher = xxhash.xxh3_64() if hash_parts else None
    copy_gathered(dest, parts, 0, hasher)
    return None if hasher is None else hasher.intdigest()


class PartsChecksum:
    """The xxh3 of a record's payload taken part by part as a multi-part record arrives, each
    part hashed right after it is appended, while the bytes gRPC just copied into it are in the
    CPU cache; `join_parts(..., payload_sum=...)` then joins without a second pass over them.
    A one-part record is left to `join_parts`, which hashes it once anyway."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state: Any = None

    def add(self, parts: Sequence[Buffer]) -> None:
        """Call after appending each part to `parts` (a record's parts so far, header first)."""
        if len(parts) == 2 and len(parts[0]) >= HEADER_SIZE:  # a shorter first part: join_parts hashes
            self._state = xxhash.xxh3_64(memoryview(parts[0])[HEADER_SIZE:])
        if self._state is not None:
            self._state.update(parts[-1])

    def value(self) -> int | None:
        """The payload's checksum so far; None for a record that has not come in parts."""
        return None if self._state is None else self._state.intdigest()


def join_parts(parts: Sequence[Buffer], *, expect_key: bytes | None = None, keep_view: bool = False,
               payload_sum: int | None = None) -> Record:
    """Reassemble and verify a record from its chunks; RecordError says what is wrong.

    `keep_view`: a record that arrived in one chunk keeps its payload as a read-only view into
    that chunk (no copy; the view holds the chunk's few header bytes alive with it): a reader
    that hands the record on, or a server whose tiers copy the payload where it lives.
    `payload_sum`: the xxh3 of the payload bytes of `parts` (`PartsChecksum`), checked against
    the header instead of hashing them again (uncompressed records)."""
    if not parts or len(parts[0]) < HEADER_SIZE:
        return decode_record(b"".join(parts), expect_key=expect_key)
    first = memoryview(parts[0])
    header, checksum = decode_header(first[:HEADER_SIZE])
    if header.flags:  # compressed: let decode_record handle it
        return decode_record(b"".join(parts), expect_key=expect_key)
    if keep_view and len(parts) == 1 and first.readonly:
        payload: Buffer = first[HEADER_SIZE:]
    else:
        payload = b"".join((first[HEADER_SIZE:], *parts[1:]))  # the one copy
    if len(payload) < header.stored_length:
        raise RecordError(f"truncated payload: {len(payload)} of {header.stored_length} bytes")
    if len(payload) > header.stored_length:
        raise RecordError(f"{len(payload) - header.stored_length} trailing bytes after the payload")
    if (payload_checksum(payload) if payload_sum is None else payload_sum) != checksum:
        raise RecordError("payload checksum mismatch: the payload is corrupt")
    if expect_key is not None and header.key != expect_key:
        raise RecordError("record key does not match the key it was stored under")
    return Record(header, payload, checksum)  # type: ignore[arg-type]  # a view only with keep_view


async def join_parts_off_loop(parts: Sequence[Buffer], total_bytes: int, *, expect_key: bytes | None = None,
                              keep_view: bool = False, payload_sum: int | None = None) -> Record:
    """`join_parts`, in a worker thread when the record is large enough to stall the event loop."""
    if total_bytes >= OFFLOAD_BYTES:
        return await asyncio.to_thread(join_parts, parts, expect_key=expect_key, keep_view=keep_view,
                                       payload_sum=payload_sum)
    return join_parts(parts, expect_key=expect_key, keep_view=keep_view, payload_sum=payload_sum)
