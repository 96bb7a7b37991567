"""Records on the wire: split into chunks and reassembled with one copy of the payload.

A record travels (in `RecordChunk.data` messages, after a `RecordStart`) as its encoded bytes
(tiers/record.py): the 168-byte header, then the payload. The sender makes the header its
own first chunk, so neither side ever builds the concatenated record: the sender slices the
payload it has, the receiver joins the payload chunks once and verifies the header and
payload checksums. Chunks split any other way (a foreign client) fall back to
`decode_record` on the joined bytes: same checks, same error messages, one copy more.
No protobuf here: server.py and client.py wrap these bytes in messages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tiers.record import HEADER_SIZE, Record, RecordError, decode_header, decode_record, encode_header, payload_checksum


def encoded_size(record: Record) -> int:
    """Bytes of the record on the wire (uncompressed encoding)."""
    return HEADER_SIZE + len(record.payload)


def record_parts(record: Record, chunk_bytes: int) -> Iterator[bytes]:
    """The encoded record as chunks: the header alone, then payload slices of `chunk_bytes`."""
    payload = record.payload
    yield encode_header(record.header, stored_length=len(payload), flags=0, checksum=payload_checksum(payload))
    view = memoryview(payload)
    for offset in range(0, len(payload), chunk_bytes):
        yield bytes(view[offset:offset + chunk_bytes])


def join_parts(parts: Sequence[bytes], *, expect_key: bytes | None = None) -> Record:
    """Reassemble and verify a record from its chunks; RecordError says what is wrong."""
    if not parts or len(parts[0]) != HEADER_SIZE:
        return decode_record(b"".join(parts), expect_key=expect_key)
    header, checksum = decode_header(parts[0])
    if header.flags:  # compressed: let decode_record handle it
        return decode_record(b"".join(parts), expect_key=expect_key)
    payload = parts[1] if len(parts) == 2 else b"".join(parts[1:])
    if len(payload) < header.stored_length:
        raise RecordError(f"truncated payload: {len(payload)} of {header.stored_length} bytes")
    if len(payload) > header.stored_length:
        raise RecordError(f"{len(payload) - header.stored_length} trailing bytes after the payload")
    if payload_checksum(payload) != checksum:
        raise RecordError("payload checksum mismatch: the payload is corrupt")
    if expect_key is not None and header.key != expect_key:
        raise RecordError("record key does not match the key it was stored under")
    return Record(header, bytes(payload))
