"""What a stored object is on a medium: the self-describing record.

A record is valid on its own: any tier can be re-indexed from its records after a restart,
and a torn or corrupted record is detected by its checksums and never served. Kinds and
codecs are opaque integer codes here: tiers know neither the model nor the service.

Layout (little-endian), HEADER_SIZE bytes of header then the stored payload::

    offset  size  field
    0       4     magic b"SSR\\x01"
    4       2     format version
    6       2     kind code            (engine_adapter.base.StateKind value, opaque here)
    8       2     codec code           (engine_adapter.base.Codec value, opaque here)
    10      2     flags                (bit 0: payload is zstd-compressed)
    12      16    model fingerprint
    28      16    tenant id
    44      32    block key
    76      32    parent key           (all zero for the first block / per-sequence records)
    108     8     token start
    116     8     token end            (exclusive)
    124     4     entry count
    128     8     stored payload length
    136     8     raw payload length   (after decompression)
    144     8     payload checksum     (xxh3-64 of the stored payload)
    152     8     created at (ns since the epoch)
    160     8     header checksum      (xxh3-64 of bytes 0..160)
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import xxhash
import zstandard

from tiers._memcpy import address, copy_bytes, source_address

MAGIC = b"SSR\x01"
FORMAT_VERSION = 1
FLAG_ZSTD = 0x1
KNOWN_FLAGS = FLAG_ZSTD

KEY_BYTES = 32
FINGERPRINT_BYTES = 16
TENANT_BYTES = 16
ZERO_KEY = bytes(KEY_BYTES)

_HEADER = struct.Struct("<4sHHHH16s16s32s32sQQIQQQQ")
_HEADER_CHECKSUM = struct.Struct("<Q")
HEADER_SIZE = _HEADER.size + _HEADER_CHECKSUM.size  # 168
_WHOLE_HEADER = struct.Struct(_HEADER.format + "Q")  # decode: every field and the checksum in one unpack
_BODY_SIZE = _HEADER.size
MAX_PAYLOAD_BYTES = 1 << 34  # 16 GiB: anything claiming more is corrupt

BlockKey = NewType("BlockKey", bytes)
"""32 bytes: the hash chain over (parent, token ids, model fingerprint, tenant salt)."""

RecordKey = NewType("RecordKey", bytes)
"""34 bytes: 2-byte big-endian kind code, then the block key. What a tier indexes by."""

RECORD_KEY_BYTES = 2 + KEY_BYTES


class RecordError(ValueError):
    """A buffer is not a valid record; the message says exactly what is wrong."""


def make_record_key(kind_code: int, block_key: bytes) -> RecordKey:
    if len(block_key) != KEY_BYTES:
        raise ValueError(f"block key must be {KEY_BYTES} bytes, got {len(block_key)}")
    return RecordKey(record_key_prefix(kind_code) + bytes(block_key))


def record_key_prefix(kind_code: int) -> bytes:
    """The bytes every record key of this kind starts with (its block key follows): a caller
    that builds many keys of a few kinds checks and encodes each kind once."""
    if not 0 <= kind_code <= 0xFFFF:
        raise ValueError(f"kind code {kind_code} outside 0..65535")
    return kind_code.to_bytes(2, "big")


def split_record_key(key: bytes) -> tuple[int, BlockKey]:
    if len(key) != RECORD_KEY_BYTES:
        raise ValueError(f"record key must be {RECORD_KEY_BYTES} bytes, got {len(key)}")
    return int.from_bytes(key[:2], "big"), BlockKey(bytes(key[2:]))


def payload_checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


COPY_HASH_BLOCK_BYTES = 256 << 10  # copied, then hashed while in cache (L2-sized: faster than 1 MiB here)


def copy_hashing(dest: memoryview, src: bytes | memoryview, hasher: xxhash.xxh3_64 | None) -> None:
    """Copy `src` into `dest` (as long) block by block, hashing each block of `dest` right after
    its copy, while it is in cache (one pass over memory instead of two; `hasher` None: copy
    only). What is hashed is what was copied, even if another process writes `src` (shared
    memory) meanwhile. Neither the copy (into a writable buffer from a writable one, or from a
    read-only one of 64 KiB or more: `tiers._memcpy`) nor the hash holds the GIL: the threads
    waiting on the disk, and the event loop, go on meanwhile."""
    view = memoryview(src)
    if dest.nbytes != view.nbytes:
        raise ValueError(f"copy_hashing: {view.nbytes} bytes into a {dest.nbytes}-byte buffer")
    dest_at = address(dest)
    src_at = source_address(view) if dest_at is not None else None
    for start in range(0, len(view), COPY_HASH_BLOCK_BYTES):
        end = min(len(view), start + COPY_HASH_BLOCK_BYTES)
        copy_bytes(dest, dest_at, view, src_at, start, end)
        if hasher is not None:
            hasher.update(dest[start:end])


def copy_gathered(dest: memoryview, sources: Sequence[bytes | memoryview], offset: int,
                  hasher: xxhash.xxh3_64 | None) -> None:
    """Copy bytes [offset, offset + len(dest)) of `sources` laid end to end into `dest`, hashing
    as `copy_hashing` does: a payload that lies in several places (a record's head in one
    buffer, its bulk in memory a client lent) is copied out as if it were one buffer."""
    at, want, end = 0, offset, offset + len(dest)
    for src in sources:
        n = len(src) if isinstance(src, memoryview) else len(memoryview(src))
        lo, hi = max(want, at), min(end, at + n)
        if hi > lo:
            copy_hashing(dest[lo - offset:hi - offset], memoryview(src)[lo - at:hi - at], hasher)
            want = hi
        at += n
        if at >= end:
            break
    if want != end:
        raise ValueError(f"copy_gathered: sources of {at} bytes end before byte {end}")


def copy_scattered(dests: Sequence[memoryview], offset: int, src: bytes | memoryview,
                   hasher: xxhash.xxh3_64 | None) -> None:
    """Copy `src` into bytes [offset, offset + len(src)) of `dests` laid end to end, hashing as
    `copy_hashing` does (in order): the mirror of `copy_gathered`, for a payload delivered
    partly into one buffer and partly into another."""
    view = memoryview(src)
    at, want, end = 0, offset, offset + len(view)
    for dest in dests:
        lo, hi = max(want, at), min(end, at + len(dest))
        if hi > lo:
            copy_hashing(dest[lo - at:hi - at], view[lo - offset:hi - offset], hasher)
            want = hi
        at += len(dest)
        if at >= end:
            break
    if want != end:
        raise ValueError(f"copy_scattered: destinations of {at} bytes end before byte {end}")


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """Everything about a record except its payload. Sizes describe the raw payload."""

    kind: int
    codec: int
    model_fingerprint: bytes
    tenant_id: bytes
    block_key: bytes
    parent_key: bytes = ZERO_KEY
    token_start: int = 0
    token_end: int = 0
    entry_count: int = 0
    raw_length: int = 0
    created_at_ns: int = field(default_factory=time.time_ns)
    # Set by decode: how the payload was stored (0 when the header was built in memory).
    stored_length: int = 0
    flags: int = 0
    # kind code + block key: what tiers index by. Computed once here: the put and get paths
    # ask for it several times per record (the store, the tier, the server).
    key: RecordKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_len("model fingerprint", self.model_fingerprint, FINGERPRINT_BYTES)
        _check_len("tenant id", self.tenant_id, TENANT_BYTES)
        _check_len("block key", self.block_key, KEY_BYTES)
        _check_len("parent key", self.parent_key, KEY_BYTES)
        if not 0 <= self.kind <= 0xFFFF or not 0 <= self.codec <= 0xFFFF:
            raise RecordError(f"kind {self.kind} / codec {self.codec} outside 0..65535")
        if not 0 <= self.token_start <= self.token_end:
            raise RecordError(f"token range [{self.token_start}, {self.token_end}) is not ordered")
        if self.token_end >= 1 << 63 or not 0 <= self.entry_count < 1 << 32:
            raise RecordError("token range or entry count out of bounds")
        if not 0 <= self.raw_length <= MAX_PAYLOAD_BYTES:
            raise RecordError(f"raw payload length {self.raw_length} out of bounds")
        object.__setattr__(self, "key", RecordKey(self.kind.to_bytes(2, "big") + bytes(self.block_key)))


@dataclass(frozen=True, slots=True)
class Record:
    """A header and its raw (uncompressed) payload.

    `checksum` is the payload's xxh3-64 when whoever built the record has just computed or
    verified it (the tiers' reads, the wire's reassembly), else None. It saves hashing the same
    bytes again at the next hop (a host-tier put, a wire frame); it is never trusted in place
    of a verification: a tier stores it as the checksum that every later read verifies.
    """

    header: RecordHeader
    payload: bytes | memoryview  # a read-only view only where a reader kept a received message's bytes
    checksum: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.payload) != self.header.raw_length:
            raise RecordError(
                f"payload is {len(self.payload)} bytes but the header says {self.header.raw_length}"
            )

    @property
    def key(self) -> RecordKey:
        return self.header.key

    @property
    def nbytes(self) -> int:
        """Bytes of this record encoded without compression."""
        return HEADER_SIZE + len(self.payload)

    def payload_sum(self) -> int:
        """The payload's xxh3-64: the carried `checksum`, or computed now."""
        return self.checksum if self.checksum is not None else xxhash.xxh3_64_intdigest(self.payload)


def _check_len(name: str, value: bytes, expected: int) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != expected:
        got = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise RecordError(f"{name} must be {expected} bytes, got {got}")


def make_record(
    kind: int,
    codec: int,
    payload: bytes,
    *,
    model_fingerprint: bytes,
    tenant_id: bytes,
    block_key: bytes,
    parent_key: bytes = ZERO_KEY,
    token_start: int = 0,
    token_end: int = 0,
    entry_count: int = 0,
) -> Record:
    header = RecordHeader(
        kind=kind,
        codec=codec,
        model_fingerprint=bytes(model_fingerprint),
        tenant_id=bytes(tenant_id),
        block_key=bytes(block_key),
        parent_key=bytes(parent_key),
        token_start=token_start,
        token_end=token_end,
        entry_count=entry_count,
        raw_length=len(payload),
    )
    return Record(header, bytes(payload))


def encode_record(record: Record, *, zstd_level: int | None = None) -> bytes:
    """Serialise a record. With `zstd_level`, compress the payload, but only if that pays."""
    payload, flags = record.payload, 0
    if zstd_level is not None and payload:
        packed = zstandard.ZstdCompressor(level=zstd_level).compress(payload)
        if len(packed) < len(payload):
            payload, flags = packed, FLAG_ZSTD
    return encode_header(record.header, stored_length=len(payload), flags=flags,
                         checksum=payload_checksum(payload)) + payload


def read_back(encoded_header: bytes, payload: bytes, *, verified: bool = True) -> Record | None:
    """A record a memory tier held, rebuilt from its stored header and the payload read back.

    None when the payload no longer matches the checksum the header stored (a bit flip in RAM
    or device memory: the caller drops the copy, and the read is a miss, never served).
    `verified=False`: the header holds no checksum of this payload, so nothing is checked and
    none is carried.
    """
    header, checksum = decode_header(encoded_header)
    if not verified:
        return Record(header, payload)
    if payload_checksum(payload) != checksum:
        return None
    return Record(header, payload, checksum)


def encode_header(header: RecordHeader, *, stored_length: int, flags: int, checksum: int) -> bytes:
    h = header
    body = _HEADER.pack(
        MAGIC, FORMAT_VERSION, h.kind, h.codec, flags, h.model_fingerprint, h.tenant_id,
        h.block_key, h.parent_key, h.token_start, h.token_end, h.entry_count,
        stored_length, h.raw_length, checksum, h.created_at_ns,
    )
    return body + _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(buf: bytes | memoryview) -> tuple[RecordHeader, int]:
    """Parse and verify a header. Returns it with the stored payload's checksum.

    One struct unpack, no copy of the header bytes, and the header built without
    re-running `RecordHeader.__post_init__` (every check it makes is made here, on the
    fields as unpacked): this runs once per record read, ~4 us instead of ~11 us.
    """
    if len(buf) < HEADER_SIZE:
        raise RecordError(f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
    (magic, version, kind, codec, flags, fp, tenant, key, parent, t0, t1, entries,
     stored_len, raw_len, checksum, created, header_sum) = _WHOLE_HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise RecordError(f"bad magic {magic!r}: not a statestore record")
    if xxhash.xxh3_64_intdigest(buf[:_BODY_SIZE]) != header_sum:
        raise RecordError("header checksum mismatch: the header is corrupt")
    if version != FORMAT_VERSION:
        raise RecordError(f"record format version {version} is not supported (expected {FORMAT_VERSION})")
    if flags & ~KNOWN_FLAGS:
        raise RecordError(f"unknown flags 0x{flags:x}")
    if stored_len > MAX_PAYLOAD_BYTES:
        raise RecordError(f"stored payload length {stored_len} out of bounds")
    if not flags & FLAG_ZSTD and stored_len != raw_len:
        raise RecordError(f"uncompressed payload: stored length {stored_len} != raw length {raw_len}")
    # What __post_init__ would check beyond the struct's own widths and sizes.
    if not t0 <= t1:
        raise RecordError(f"token range [{t0}, {t1}) is not ordered")
    if t1 >= 1 << 63:
        raise RecordError("token range or entry count out of bounds")
    if raw_len > MAX_PAYLOAD_BYTES:
        raise RecordError(f"raw payload length {raw_len} out of bounds")
    header = _new(RecordHeader)
    (set_kind, set_codec, set_fp, set_tenant, set_key, set_parent, set_t0, set_t1, set_entries,
     set_raw_len, set_created, set_stored_len, set_flags, set_record_key) = _HEADER_SETTERS
    set_kind(header, kind)
    set_codec(header, codec)
    set_fp(header, fp)
    set_tenant(header, tenant)
    set_key(header, key)
    set_parent(header, parent)
    set_t0(header, t0)
    set_t1(header, t1)
    set_entries(header, entries)
    set_raw_len(header, raw_len)
    set_created(header, created)
    set_stored_len(header, stored_len)
    set_flags(header, flags)
    set_record_key(header, RecordKey(kind.to_bytes(2, "big") + key))
    return header, checksum


def with_tenant(header: RecordHeader, tenant_id: bytes) -> RecordHeader:
    """`header` for tenant `tenant_id`, as built in memory (stored_length and flags 0): what a
    server stamps on a record it received and verified. A copy by slot setters: the fields of
    a header already passed `__post_init__`'s checks, so only the new tenant id is checked."""
    _check_len("tenant id", tenant_id, TENANT_BYTES)
    new = _new(RecordHeader)
    for name, set_field in _NAMED_SETTERS:
        set_field(new, getattr(header, name))
    _SET_TENANT(new, tenant_id)
    _SET_STORED_LENGTH(new, 0)
    _SET_FLAGS(new, 0)
    return new


# RecordHeader's slot setters in field order: decode_header fills a header it has already
# validated without the frozen dataclass's __init__ and __post_init__.
_new = object.__new__
_HEADER_SETTERS = tuple(getattr(RecordHeader, name).__set__ for name in RecordHeader.__dataclass_fields__)
_NAMED_SETTERS = tuple(zip(RecordHeader.__dataclass_fields__, _HEADER_SETTERS))
_SET_TENANT = RecordHeader.tenant_id.__set__  # type: ignore[attr-defined]
_SET_STORED_LENGTH = RecordHeader.stored_length.__set__  # type: ignore[attr-defined]
_SET_FLAGS = RecordHeader.flags.__set__  # type: ignore[attr-defined]
assert tuple(RecordHeader.__dataclass_fields__) == (
    "kind", "codec", "model_fingerprint", "tenant_id", "block_key", "parent_key", "token_start", "token_end",
    "entry_count", "raw_length", "created_at_ns", "stored_length", "flags", "key"), "update decode_header's field order"
_RECORD_HEADER_SET = Record.header.__set__  # type: ignore[attr-defined]
_RECORD_PAYLOAD_SET = Record.payload.__set__  # type: ignore[attr-defined]
_RECORD_CHECKSUM_SET = Record.checksum.__set__  # type: ignore[attr-defined]


class HeaderCache:
    """Decoded headers of the records a reader sees again (a tier's re-reads of hot records), by
    record key. A value whose header bytes equal the ones decoded before for its key decodes to
    the same fields, whose parse and checks (header checksum included) were made then, so
    `decode_record(..., headers=cache, expect_key=key)` skips them (~1.1 of its ~2.2 µs for a
    4 KiB record); any other value is decoded and replaces the entry. Bounded: beyond
    `max_entries` the oldest entry leaves first."""

    def __init__(self, max_entries: int = 16384) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._max = max_entries
        self._entries: dict[bytes, tuple[bytes, RecordHeader, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def decode(self, buf: bytes | memoryview, key: bytes) -> tuple[RecordHeader, int]:
        """`decode_header(buf)`, from the cache when `key`'s header bytes were seen before."""
        hit = self._entries.get(key)
        if hit is not None and buf[:HEADER_SIZE] == hit[0]:
            return hit[1], hit[2]
        header, checksum = decode_header(buf)  # raises on a short or corrupt header: nothing is cached
        if hit is None and len(self._entries) >= self._max:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (bytes(buf[:HEADER_SIZE]), header, checksum)
        return header, checksum

    def decode_many(self, values: Sequence[bytes | memoryview | None],
                    keys: Sequence[bytes]) -> list[Record | RecordError | None]:
        """`decode_record(value, expect_key=key, headers=self)` for each pair, in one loop: a
        batch read's per-record calls cost as much as the checks (~0.5 of ~1.5 µs for 4 KiB).
        None stays None; a value that does not decode gives its RecordError, not a raise, so
        one corrupt value does not hide the others. A read-only memoryview value gives a record
        whose payload is a view of it (`keep_view`: the reader's buffer outlives the record)."""
        out: list[Record | RecordError | None] = []
        entries, digest = self._entries, xxhash.xxh3_64_intdigest
        for key, value in zip(keys, values):
            kept = type(value) is memoryview
            hit = entries.get(key) if type(value) is bytes or kept else None
            if hit is not None and value[:HEADER_SIZE] == hit[0]:  # type: ignore[index]
                header = hit[1]
                if (len(value) == HEADER_SIZE + header.stored_length and not header.flags  # type: ignore[arg-type]
                        and header.key == key):
                    payload = value[HEADER_SIZE:]  # type: ignore[index]
                    if digest(payload) == hit[2]:
                        record = _new(Record)
                        _RECORD_HEADER_SET(record, header)
                        _RECORD_PAYLOAD_SET(record, payload)
                        _RECORD_CHECKSUM_SET(record, hit[2])
                        out.append(record)
                        continue
            if value is None:
                out.append(None)
                continue
            try:  # not cached, or anything to report: the full path says what is wrong
                out.append(decode_record(value, expect_key=key, headers=self, keep_view=kept))
            except RecordError as exc:
                out.append(exc)
        return out


def decode_record(
    buf: bytes | memoryview,
    *,
    expect_fingerprint: bytes | None = None,
    expect_tenant: bytes | None = None,
    expect_key: bytes | None = None,
    keep_view: bool = False,
    headers: HeaderCache | None = None,
) -> Record:
    """Parse and verify a whole record; reject anything malformed or not the one expected.

    The payload is copied once (into the returned `bytes`), after its checksum was
    verified on a view of `buf`; with `keep_view` (and no compression) it is not copied: the
    payload is a read-only view of `buf`, for a caller whose `buf` outlives the record.
    """
    header, checksum = (decode_header(buf) if headers is None or expect_key is None
                        else headers.decode(buf, expect_key))
    end = HEADER_SIZE + header.stored_length
    if len(buf) != end:
        if len(buf) < end:
            raise RecordError(f"truncated payload: {len(buf) - HEADER_SIZE} of {header.stored_length} bytes")
        raise RecordError(f"{len(buf) - end} trailing bytes after the payload")
    compressed = header.flags & FLAG_ZSTD
    # bytes in, bytes out: one slice is the copy and what is hashed; else hash a view, copy after
    stored = buf[HEADER_SIZE:] if type(buf) is bytes and not keep_view else memoryview(buf)[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(stored) != checksum:
        raise RecordError("payload checksum mismatch: the payload is corrupt")
    if expect_fingerprint is not None and header.model_fingerprint != expect_fingerprint:
        raise RecordError("record belongs to another model fingerprint")
    if expect_tenant is not None and header.tenant_id != expect_tenant:
        raise RecordError("record belongs to another tenant")
    if expect_key is not None and expect_key != header.key:
        raise RecordError("record key does not match the key it was stored under")
    if type(stored) is bytes:
        payload: bytes | memoryview = stored
    else:
        payload = stored.toreadonly() if keep_view and not compressed else bytes(stored)
    if compressed:
        try:
            payload = zstandard.ZstdDecompressor().decompress(payload, max_output_size=header.raw_length)
        except zstandard.ZstdError as exc:
            raise RecordError(f"zstd payload does not decompress: {exc}") from exc
        if len(payload) != header.raw_length:
            raise RecordError(f"decompressed {len(payload)} bytes, header says {header.raw_length}")
    record = _new(Record)  # len(payload) == header.raw_length: checked above
    _RECORD_HEADER_SET(record, header)
    _RECORD_PAYLOAD_SET(record, payload)
    _RECORD_CHECKSUM_SET(record, None if compressed else checksum)  # stored == raw bytes
    return record
