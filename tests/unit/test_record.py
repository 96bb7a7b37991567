"""The record format: round trips, and every kind of damage is detected with a precise message."""

from __future__ import annotations

import dataclasses
import random
import struct

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiers.record import (
    FLAG_ZSTD,
    HEADER_SIZE,
    Record,
    RecordError,
    RecordHeader,
    decode_header,
    decode_record,
    encode_record,
    make_record,
    make_record_key,
    split_record_key,
)

FINGERPRINT = bytes(range(16))
TENANT = bytes(range(16, 32))
BLOCK_KEY = bytes(range(32, 64))
HEADER_BODY = HEADER_SIZE - 8  # bytes covered by the header checksum

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(payload: bytes = b"kv" * 32, **overrides: object) -> Record:
    fields: dict[str, object] = dict(model_fingerprint=FINGERPRINT, tenant_id=TENANT, block_key=BLOCK_KEY,
                                     token_start=256, token_end=512, entry_count=64)
    fields.update(overrides)
    kind = int(fields.pop("kind", 1))  # type: ignore[call-overload]
    codec = int(fields.pop("codec", 0))  # type: ignore[call-overload]
    return make_record(kind, codec, payload, **fields)  # type: ignore[arg-type]


def as_built(header: RecordHeader) -> RecordHeader:
    """A decoded header without the decode-only fields (how the payload was stored)."""
    return dataclasses.replace(header, stored_length=0, flags=0)


def reseal_header(buf: bytearray) -> bytearray:
    """Recompute the header checksum after an edit, to reach the checks behind it."""
    struct.pack_into("<Q", buf, HEADER_BODY, xxhash.xxh3_64_intdigest(bytes(buf[:HEADER_BODY])))
    return buf


# A mix of incompressible and highly compressible payloads, so zstd is both used and skipped.
payloads = st.one_of(
    st.binary(max_size=2048),
    st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=8), st.integers(0, 512)),
)

headers = st.fixed_dictionaries({
    "kind": st.integers(0, 0xFFFF),
    "codec": st.integers(0, 0xFFFF),
    "model_fingerprint": st.binary(min_size=16, max_size=16),
    "tenant_id": st.binary(min_size=16, max_size=16),
    "block_key": st.binary(min_size=32, max_size=32),
    "parent_key": st.binary(min_size=32, max_size=32),
    "token_start": st.integers(0, 1 << 40),
    "num_tokens": st.integers(0, 1 << 20),
    "entry_count": st.integers(0, (1 << 32) - 1),
})


def build(fields: dict, payload: bytes) -> Record:
    fields = dict(fields)
    fields["token_end"] = fields["token_start"] + fields.pop("num_tokens")
    return make(payload, **fields)


@SETTINGS
@given(fields=headers, payload=payloads, level=st.sampled_from([None, 1, 3]))
def test_round_trip_is_exact(fields: dict, payload: bytes, level: int | None) -> None:
    record = build(fields, payload)
    encoded = encode_record(record, zstd_level=level)
    decoded = decode_record(encoded, expect_fingerprint=record.header.model_fingerprint,
                            expect_tenant=record.header.tenant_id, expect_key=record.key)
    assert decoded.payload == payload
    assert as_built(decoded.header) == record.header
    assert len(encoded) == HEADER_SIZE + decoded.header.stored_length
    if decoded.header.flags & FLAG_ZSTD:
        assert level is not None and decoded.header.stored_length < len(payload)
    else:
        assert decoded.header.stored_length == len(payload)
    # the verified checksum travels with the record (None where the stored bytes were compressed)
    assert decoded.payload_sum() == xxhash.xxh3_64_intdigest(payload)
    assert (decoded.checksum is None) == bool(decoded.header.flags & FLAG_ZSTD)
    assert decoded == Record(decoded.header, payload)  # the carried checksum is not part of equality


def test_zstd_is_used_only_when_it_pays() -> None:
    compressible = encode_record(make(b"\0" * 4096), zstd_level=3)
    incompressible = encode_record(make(random.Random(7).randbytes(512)), zstd_level=3)
    assert decode_header(compressible)[0].flags == FLAG_ZSTD
    assert len(compressible) < HEADER_SIZE + 100
    assert decode_header(incompressible)[0].flags == 0  # zstd frame overhead: stored raw


@SETTINGS
@given(fields=headers, payload=payloads, level=st.sampled_from([None, 3]), data=st.data())
def test_any_truncation_is_detected(fields: dict, payload: bytes, level: int | None, data: st.DataObject) -> None:
    encoded = encode_record(build(fields, payload), zstd_level=level)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(RecordError, match="truncated"):
        decode_record(encoded[:cut])


@SETTINGS
@given(fields=headers, payload=payloads, level=st.sampled_from([None, 3]), data=st.data())
def test_any_single_byte_corruption_is_detected(fields: dict, payload: bytes, level: int | None,
                                                data: st.DataObject) -> None:
    encoded = bytearray(encode_record(build(fields, payload), zstd_level=level))
    position = data.draw(st.integers(0, len(encoded) - 1))
    encoded[position] ^= data.draw(st.integers(1, 255))
    with pytest.raises(RecordError):
        decode_record(bytes(encoded))


@pytest.mark.parametrize("level", [None, 3], ids=["raw", "zstd"])
def test_every_byte_position_of_a_small_record(level: int | None) -> None:
    """Exhaustive: every truncation, and three different flips at every byte position."""
    payload = b"abcd" * 16 if level is None else b"\0" * 200
    encoded = encode_record(make(payload), zstd_level=level)
    assert bool(decode_header(encoded)[0].flags & FLAG_ZSTD) == (level is not None)
    for cut in range(len(encoded)):
        with pytest.raises(RecordError):
            decode_record(encoded[:cut])
    for position in range(len(encoded)):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(encoded)
            damaged[position] ^= flip
            with pytest.raises(RecordError):
                decode_record(bytes(damaged))


def test_other_model_tenant_or_key_is_rejected() -> None:
    encoded = encode_record(make())
    with pytest.raises(RecordError, match="^record belongs to another model fingerprint$"):
        decode_record(encoded, expect_fingerprint=bytes(16))
    with pytest.raises(RecordError, match="^record belongs to another tenant$"):
        decode_record(encoded, expect_tenant=bytes(16))
    with pytest.raises(RecordError, match="^record key does not match the key it was stored under$"):
        decode_record(encoded, expect_key=make_record_key(2, BLOCK_KEY))
    assert decode_record(encoded, expect_fingerprint=FINGERPRINT, expect_tenant=TENANT,
                         expect_key=make_record_key(1, BLOCK_KEY)).payload == b"kv" * 32


def test_bad_magic_message() -> None:
    encoded = bytearray(encode_record(make()))
    encoded[:4] = b"GIF8"
    with pytest.raises(RecordError, match=r"^bad magic b'GIF8': not a statestore record$"):
        decode_record(bytes(encoded))


def test_unsupported_version_message() -> None:
    encoded = bytearray(encode_record(make()))
    struct.pack_into("<H", encoded, 4, 2)
    with pytest.raises(RecordError, match=r"^record format version 2 is not supported \(expected 1\)$"):
        decode_record(bytes(reseal_header(encoded)))


def test_header_checksum_message() -> None:
    encoded = bytearray(encode_record(make()))
    encoded[100] ^= 0x10  # inside the parent key
    with pytest.raises(RecordError, match="^header checksum mismatch: the header is corrupt$"):
        decode_record(bytes(encoded))


def test_payload_checksum_message() -> None:
    encoded = bytearray(encode_record(make()))
    encoded[HEADER_SIZE + 5] ^= 0x01
    with pytest.raises(RecordError, match="^payload checksum mismatch: the payload is corrupt$"):
        decode_record(bytes(encoded))


def test_trailing_bytes_message() -> None:
    with pytest.raises(RecordError, match="^3 trailing bytes after the payload$"):
        decode_record(encode_record(make()) + b"\0\0\0")


def test_truncation_messages() -> None:
    encoded = encode_record(make(b"x" * 100))
    with pytest.raises(RecordError, match=f"^truncated header: 10 of {HEADER_SIZE} bytes$"):
        decode_record(encoded[:10])
    with pytest.raises(RecordError, match="^truncated payload: 40 of 100 bytes$"):
        decode_record(encoded[: HEADER_SIZE + 40])


def test_unknown_flags_and_length_mismatch_messages() -> None:
    encoded = bytearray(encode_record(make()))
    struct.pack_into("<H", encoded, 10, 0x2)
    with pytest.raises(RecordError, match="^unknown flags 0x2$"):
        decode_record(bytes(reseal_header(encoded)))
    encoded = bytearray(encode_record(make()))
    struct.pack_into("<Q", encoded, 136, 65)  # raw length 65 != stored 64, no zstd flag
    with pytest.raises(RecordError, match="^uncompressed payload: stored length 64 != raw length 65$"):
        decode_record(bytes(reseal_header(encoded)))


def test_undecompressible_zstd_payload_message() -> None:
    """Valid checksums over a payload flagged zstd that is not a zstd frame."""
    garbage = b"not a zstd frame"
    encoded = bytearray(encode_record(make(b"\0" * 64))[:HEADER_SIZE]) + garbage
    struct.pack_into("<H", encoded, 10, FLAG_ZSTD)
    struct.pack_into("<Q", encoded, 128, len(garbage))
    struct.pack_into("<Q", encoded, 144, xxhash.xxh3_64_intdigest(garbage))
    with pytest.raises(RecordError, match="^zstd payload does not decompress: "):
        decode_record(bytes(reseal_header(encoded)))


def test_record_keys_round_trip_and_check_sizes() -> None:
    key = make_record_key(0x0102, BLOCK_KEY)
    assert key[:2] == b"\x01\x02" and split_record_key(key) == (0x0102, BLOCK_KEY)
    with pytest.raises(ValueError, match="block key must be 32 bytes, got 3"):
        make_record_key(1, b"abc")
    with pytest.raises(ValueError, match="kind code 65536 outside 0..65535"):
        make_record_key(1 << 16, BLOCK_KEY)


def test_payload_length_must_match_header() -> None:
    record = make(b"abc")
    with pytest.raises(RecordError, match="^payload is 2 bytes but the header says 3$"):
        Record(record.header, b"ab")


def test_a_wrong_carried_checksum_is_caught_by_the_next_read() -> None:
    """The carried checksum saves a hash, never a verification: a host tier that stores a record
    whose carried checksum is wrong serves a miss on the next read, not the bytes."""
    import asyncio

    from tiers.host import HostTier

    good = make(b"abc" * 100)
    bad = Record(good.header, good.payload, checksum=good.payload_sum() ^ 1)
    tier = HostTier(1 << 20)
    assert asyncio.run(tier.put(bad)) and asyncio.run(tier.get(bad.key)) is None
    assert asyncio.run(tier.put(good))
    got = asyncio.run(tier.get(good.key))
    assert got is not None and got.payload == good.payload and got.checksum == xxhash.xxh3_64_intdigest(good.payload)


@given(st.binary(min_size=16, max_size=16), st.binary(min_size=16, max_size=16), st.integers(0, 1 << 20))
def test_with_tenant_is_replace_without_the_checks_already_made(old: bytes, new: bytes, stored: int) -> None:
    """with_tenant(h, t) == replace(h, tenant_id=t, stored_length=0, flags=0), key included; a
    tenant id of the wrong length is refused as the constructor refuses it."""
    from tiers.record import with_tenant

    h = dataclasses.replace(make_record(3, 1, b"x" * 40, model_fingerprint=FINGERPRINT, tenant_id=old,
                                        block_key=BLOCK_KEY, token_start=5, token_end=9).header,
                            stored_length=stored, flags=0)
    got = with_tenant(h, new)
    assert got == dataclasses.replace(h, tenant_id=new, stored_length=0, flags=0) and got.key == h.key
    with pytest.raises(RecordError, match="tenant id"):
        with_tenant(h, new[:15])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1)), min_size=1, max_size=12), st.integers(-1, HEADER_SIZE - 1))
def test_header_cache_decodes_as_decode_header_and_stays_bounded(picks: list[tuple[int, int]], flip: int) -> None:
    """A HeaderCache gives what decode_header gives for every value read under a key, cached or
    not, also when a key's value changes (two versions per key here); a corrupt or short header
    raises as decode_header does and is not cached; the cache keeps at most its bound."""
    from tiers.record import HeaderCache

    cache = HeaderCache(max_entries=3)
    records = [[make_record(1, 0, bytes([i, v]) * (10 + i), model_fingerprint=FINGERPRINT, tenant_id=TENANT,
                            block_key=bytes([i]) * 32) for v in range(2)] for i in range(4)]
    for i, v in picks:
        value, key = encode_record(records[i][v]), records[i][v].key
        assert cache.decode(value, key) == decode_header(value)
        assert decode_record(value, expect_key=key, headers=cache) == decode_record(value, expect_key=key)
        assert len(cache) <= 3
    i, v = picks[0]
    if flip >= 0:
        bad = bytearray(encode_record(records[i][v]))
        bad[flip] ^= 0x10
        with pytest.raises(RecordError):
            decode_header(bytes(bad))
        with pytest.raises(RecordError):
            cache.decode(bytes(bad), records[i][v].key)
    with pytest.raises(RecordError, match="truncated header"):
        cache.decode(encode_record(records[i][v])[:HEADER_SIZE - 1], records[i][v].key)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(-2, 80)), min_size=1, max_size=16))
def test_header_cache_decode_many_equals_decode_record(picks: list[tuple[int, int, int]]) -> None:
    """decode_many gives, value by value, what decode_record gives under the same key: the same
    record for a good value (cached header or not, across a key's two versions), the RecordError
    for a value corrupted anywhere or read under another key, None for None, never a raise."""
    from tiers.record import HeaderCache

    cache = HeaderCache(max_entries=3)
    records = [[make_record(1, 0, bytes([i, v]) * (10 + i), model_fingerprint=FINGERPRINT, tenant_id=TENANT,
                            block_key=bytes([i]) * 32) for v in range(2)] for i in range(4)]
    keys, values = [], []
    for i, v, flip in picks:
        value = bytearray(encode_record(records[i][v]))
        if flip >= 0:
            value[(flip * 7) % len(value)] ^= 0x20  # header or payload
        keys.append(records[(i + 1) % 4][v].key if flip == -2 else records[i][v].key)  # -2: another key's name
        values.append(None if flip == -1 and v else bytes(value))
    for _ in range(2):  # cold, then with what the first pass cached
        got = cache.decode_many(values, keys)
        assert len(got) == len(values)
        for key, value, g in zip(keys, values, got):
            if value is None:
                assert g is None
                continue
            try:
                want: object = decode_record(value, expect_key=key)
            except RecordError as exc:
                assert isinstance(g, RecordError) and type(g) is type(exc)
            else:
                assert g == want and g.payload == want.payload


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3 * (256 << 10) + 17), st.lists(st.integers(0, 600_000), max_size=4), st.booleans())
def test_copy_hashing_copies_and_hashes_what_it_copied(size: int, cuts: list[int], hashed: bool) -> None:
    """copy_hashing leaves dest equal to src and the hasher with the xxh3 of those bytes, across
    block boundaries; wire.copy_hashed does the same over any split of the bytes into parts and
    refuses parts that do not fill the destination exactly."""
    import xxhash

    from statestore.wire import copy_hashed
    from tiers.record import copy_hashing

    src = bytes(range(256)) * (size // 256) + bytes(size % 256)
    dest = bytearray(size)
    hasher = xxhash.xxh3_64() if hashed else None
    copy_hashing(memoryview(dest), src, hasher)
    assert dest == src
    if hasher is not None:
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(src)
    bounds = sorted({0, size, *(c for c in cuts if c < size)})
    parts = [src[a:b] for a, b in zip(bounds, bounds[1:])]
    dest2 = bytearray(size)
    got = copy_hashed(memoryview(dest2), parts, hash_parts=hashed)
    assert dest2 == src and got == (xxhash.xxh3_64_intdigest(src) if hashed else None)
    with pytest.raises(ValueError, match="copy_hashed"):
        copy_hashed(memoryview(bytearray(size + 1)), parts)
    if size:
        with pytest.raises(ValueError, match="copy_hashed"):
            copy_hashed(memoryview(bytearray(size - 1)), parts)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3 * (256 << 10) + 17), st.integers(0, 5000), st.integers(0, 5000), st.booleans(),
       st.booleans())
def test_copy_hashing_between_writable_buffers_copies_without_slices(size: int, src_off: int, dest_off: int,
                                                                     hashed: bool, src_writable: bool) -> None:
    """Between writable buffers copy_hashing copies with ctypes.memmove (no GIL held), at any
    offset into either buffer, exactly the bytes a slice copy would, touching nothing around
    them; from a read-only source too (by slices below 64 KiB); a destination of another length is refused."""
    from tiers._memcpy import address
    from tiers.record import copy_hashing

    data = bytearray((i * 13 + 5) % 256 for i in range(src_off + size))
    src = memoryview(data)[src_off:] if src_writable else memoryview(bytes(data))[src_off:]
    assert (address(src) is not None) == (src_writable and size > 0)
    backing = bytearray(b"\xee" * (dest_off + size + 64))
    dest = memoryview(backing)[dest_off:dest_off + size]
    hasher = xxhash.xxh3_64() if hashed else None
    copy_hashing(dest, src, hasher)
    assert backing[dest_off:dest_off + size] == data[src_off:]
    assert backing[:dest_off] == b"\xee" * dest_off and backing[dest_off + size:] == b"\xee" * 64
    if hasher is not None:
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(bytes(data[src_off:]))
    with pytest.raises(ValueError, match="copy_hashing"):
        copy_hashing(memoryview(backing)[dest_off:dest_off + size + 1], src, None)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 4096), st.integers(1, 3 * (64 << 10)))
def test_source_address_reads_read_only_buffers_from_64_kib(offset: int, size: int) -> None:
    """A read-only source (a bytes payload, a message's view) has an address from 64 KiB up, the
    very address of its bytes (so copy_hashing copies it with memmove, without the GIL); below
    that it is copied by slices; a writable one has its address at any size."""
    from tiers._memcpy import READONLY_MIN_BYTES, address, source_address

    backing = bytearray(offset + size)
    writable = memoryview(backing)[offset:]
    read_only = writable.toreadonly()
    assert source_address(writable) == address(writable)
    if size >= READONLY_MIN_BYTES:
        assert source_address(read_only) == address(writable)
    else:
        assert source_address(read_only) is None
    assert source_address(memoryview(bytes(backing))[::2]) is None  # not contiguous


def test_copy_hashing_from_bytes_copies_exactly() -> None:
    """A large bytes source goes through memmove from its own memory: the copy and the hash are
    those of the bytes, and the source is untouched."""
    from tiers.record import copy_hashing

    src = bytes((i * 7 + 3) % 251 for i in range(1 << 20))
    dest = memoryview(bytearray(len(src) + 8))[4:-4]
    hasher = xxhash.xxh3_64()
    copy_hashing(dest, memoryview(src)[0:], hasher)
    assert bytes(dest) == src and hasher.intdigest() == xxhash.xxh3_64_intdigest(src)
    assert dest.obj[:4] == b"\0" * 4 and dest.obj[-4:] == b"\0" * 4


def test_address_is_none_for_what_ctypes_cannot_copy_into_or_from() -> None:
    from tiers._memcpy import address

    buf = bytearray(64)
    assert address(memoryview(buf)) is not None
    assert address(memoryview(buf).toreadonly()) is None  # read-only
    assert address(memoryview(buf)[::2]) is None  # not contiguous
    assert address(memoryview(buf).cast("I")) is None  # not bytes
    assert address(memoryview(buf)[:0]) is None  # empty


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 * (256 << 10) + 33), st.lists(st.integers(0, 600_000), max_size=4),
       st.integers(0, 600_000), st.integers(0, 600_000), st.booleans())
def test_copy_gathered_and_scattered_treat_parts_as_one_buffer(size: int, cuts: list[int], a: int, b: int,
                                                               hashed: bool) -> None:
    """copy_gathered copies any range of parts laid end to end as if they were one buffer, and
    copy_scattered writes any range of such parts; both hash exactly the bytes of the range, in
    order, and refuse a range that runs past the parts' end."""
    from tiers.record import copy_gathered, copy_scattered

    src = bytes((i * 7 + 3) % 251 for i in range(size))
    bounds = sorted({0, size, *(c for c in cuts if c < size)})
    lo, hi = sorted((min(a, size), min(b, size)))
    parts = [memoryview(src)[x:y] for x, y in zip(bounds, bounds[1:])]
    dest = bytearray(hi - lo)
    hasher = xxhash.xxh3_64() if hashed else None
    copy_gathered(memoryview(dest), parts, lo, hasher)
    assert dest == src[lo:hi]
    if hasher is not None:
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(src[lo:hi])
    targets = [bytearray(y - x) for x, y in zip(bounds, bounds[1:])]
    hasher = xxhash.xxh3_64() if hashed else None
    copy_scattered([memoryview(t) for t in targets], lo, src[lo:hi], hasher)
    joined = b"".join(targets)
    assert joined[lo:hi] == src[lo:hi] and joined[:lo] == bytes(lo) and joined[hi:] == bytes(size - hi)
    if hasher is not None:
        assert hasher.intdigest() == xxhash.xxh3_64_intdigest(src[lo:hi])
    with pytest.raises(ValueError, match="copy_gathered"):
        copy_gathered(memoryview(bytearray(size - lo + 1)), parts, lo, None)
    with pytest.raises(ValueError, match="copy_scattered"):
        copy_scattered([memoryview(t) for t in targets], lo, src[lo:] + b"x", None)
