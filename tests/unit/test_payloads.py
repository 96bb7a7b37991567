"""The byte logic of the payload data path (statestore/payloads.py, statestore/shm.py): frames
sliced from caller buffers, a record reassembled into a sink from any split, the shm window
metadata, and the region's lease allocator."""

from __future__ import annotations

import asyncio
import os

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from statestore.payloads import PayloadPut, _Incoming, put_frames
from statestore.shm import DATA_OFFSET, SLOT_ALIGN, ShmRegion, ShmSlots, ShmUnavailable, ShmWindow, shm_supported
from statestore.wire import split_data_frame
from tiers.record import HEADER_SIZE, RecordHeader, encode_header


def make_put(parts: list[bytes]) -> PayloadPut:
    header = RecordHeader(kind=6, codec=0, model_fingerprint=b"\x01" * 16, tenant_id=bytes(16), block_key=b"\x02" * 32,
                          raw_length=sum(len(p) for p in parts))
    return PayloadPut(header, tuple(parts))


class Sink:
    """Consumes `skip` head bytes, hands out a bytearray for the rest."""

    def __init__(self, skip: int, decline: bool = False) -> None:
        self.skip, self.decline = skip, decline
        self.dest = bytearray()
        self.closed: list[bool] = []

    def open(self, index: int, header: RecordHeader, head: memoryview) -> tuple[int, memoryview] | None:
        if self.decline:
            return None
        skip = min(self.skip, len(head))
        self.dest = bytearray(header.raw_length - skip)
        return skip, memoryview(self.dest)

    def close(self, index: int, ok: bool) -> None:
        self.closed.append(ok)


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.binary(max_size=3000), max_size=5), step=st.integers(HEADER_SIZE + 1, 2048))
def test_put_frames_carry_header_and_parts_in_order(parts: list[bytes], step: int) -> None:
    item = make_put(parts)
    frames = [split_data_frame(f) for f in put_frames(item.encode_header(), item.parts, step)]
    assert all(f is not None and 0 < len(f) <= step for f in frames)
    wire = b"".join(bytes(f) for f in frames)  # type: ignore[arg-type]
    assert wire == item.encode_header() + b"".join(parts)
    assert len(wire) == item.total_bytes


def test_payload_put_checks_its_length() -> None:
    header = RecordHeader(kind=6, codec=0, model_fingerprint=b"\x01" * 16, tenant_id=bytes(16), block_key=b"\x02" * 32,
                          raw_length=5)
    with pytest.raises(ValueError, match="parts hold 4 bytes"):
        PayloadPut(header, (b"ab", b"cd"))


@settings(max_examples=80, deadline=None)
@given(payload=st.binary(max_size=5000), cuts=st.lists(st.integers(0, 6000), max_size=6),
       skip=st.integers(0, 64), head_bytes=st.integers(1, 256), flip=st.one_of(st.none(), st.integers(0, 10_000)))
def test_incoming_reassembles_any_split_and_rejects_any_flip(payload: bytes, cuts: list[int], skip: int,
                                                              head_bytes: int, flip: int | None) -> None:
    item = make_put([payload])
    wire = bytearray(item.encode_header() + payload)
    if flip is not None:
        flip %= len(wire)
        wire[flip] ^= 0x10
    sink = Sink(skip)
    incoming = _Incoming(0, item.header.key, len(wire), sink, head_bytes)  # type: ignore[arg-type]
    bounds = sorted({0, len(wire), *(c for c in cuts if c < len(wire))})
    for a, b in zip(bounds, bounds[1:]):
        incoming.feed(memoryview(bytes(wire[a:b])))
    ok = incoming.finish()
    if flip is None:
        used = min(skip, head_bytes, len(payload))
        assert ok and bytes(sink.dest) == payload[used:] and sink.closed == [True]
    else:
        assert not ok and sink.closed in ([], [False])  # a header flip fails before the sink opens


def test_incoming_declined_or_short_is_a_failure() -> None:
    item = make_put([os.urandom(1000)])
    wire = item.encode_header() + b"".join(item.parts)
    declined = _Incoming(0, item.header.key, len(wire), Sink(0, decline=True), 64)  # type: ignore[arg-type]
    declined.feed(memoryview(wire))
    assert not declined.finish() and declined.failed == "the sink declined it"
    sink = Sink(0)
    short = _Incoming(0, item.header.key, len(wire), sink, 64)  # type: ignore[arg-type]
    short.feed(memoryview(wire[:-1]))
    assert not short.finish() and sink.closed == [False]
    other = _Incoming(0, b"\x00" * 34, len(wire), Sink(0), 64)  # type: ignore[arg-type]
    other.feed(memoryview(wire))
    assert not other.finish() and other.failed == "the server answered another key"
    checksum = xxhash.xxh3_64_intdigest(b"".join(item.parts))
    assert item.encode_header() == encode_header(item.header, stored_length=1000, flags=0, checksum=checksum)


@settings(max_examples=60, deadline=None)
@given(secret=st.binary(min_size=32, max_size=32), pid=st.integers(1, 10**9), fd=st.integers(0, 10**6),
       offset=st.integers(1, 1 << 20).map(lambda n: n * SLOT_ALIGN), length=st.integers(SLOT_ALIGN, 1 << 40))
def test_window_metadata_round_trips(secret: bytes, pid: int, fd: int, offset: int, length: int) -> None:
    window = ShmWindow(f"/proc/{pid}/fd/{fd}", secret, offset, length)
    key, value = window.to_metadata()
    assert key == "x-statestore-shm" and ShmWindow.parse(value) == window


@settings(max_examples=100, deadline=None)
@given(value=st.text(max_size=120))
def test_window_metadata_garbage_is_refused(value: str) -> None:
    try:
        window = ShmWindow.parse(value)
    except ShmUnavailable as exc:
        assert str(exc).startswith("shm:")
    else:
        assert window.name.startswith("/proc/") and window.offset >= DATA_OFFSET


@pytest.mark.parametrize("value", ["/etc/passwd " + "00" * 32 + " 4096 4096", "/proc/1/fd/3 abcd 4096 4096",
                                   "/proc/1/fd/3 " + "00" * 32 + " 0 4096", "/proc/1/fd/3 " + "00" * 32 + " 4097 4096",
                                   "/proc/../fd/3 " + "00" * 32 + " 4096 4096", ""])
def test_window_names_and_ranges_are_checked(value: str) -> None:
    with pytest.raises(ShmUnavailable):
        ShmWindow.parse(value)


def test_slots_are_aligned_and_bounded() -> None:
    slots = ShmSlots(ShmWindow("/proc/1/fd/3", bytes(32), DATA_OFFSET, 3 * SLOT_ALIGN))
    assert slots.take(1) == DATA_OFFSET
    assert slots.take(SLOT_ALIGN + 1) == DATA_OFFSET + SLOT_ALIGN
    assert slots.take(1) is None and slots.num_used == 2


@pytest.mark.skipif(not shm_supported(), reason="memfd is Linux-only")
async def test_region_leases_first_fit_and_waits_for_room() -> None:
    region = ShmRegion(DATA_OFFSET + 8 * SLOT_ALIGN)
    try:
        assert region.capacity == 8 * SLOT_ALIGN
        assert await region.lease(9 * SLOT_ALIGN) is None  # larger than the region: never
        a = await region.lease(3 * SLOT_ALIGN)
        b = await region.lease(1)
        c = await region.lease(4 * SLOT_ALIGN)
        assert a and b and c
        assert (a.offset - DATA_OFFSET, b.offset - DATA_OFFSET, c.offset - DATA_OFFSET) == (0, 3 * SLOT_ALIGN,
                                                                                           4 * SLOT_ALIGN)
        waiting = asyncio.create_task(region.lease(4 * SLOT_ALIGN))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await region.release(a)
        await asyncio.sleep(0.01)
        assert not waiting.done()  # 3 pages free, then 1 taken: no 4-page hole yet
        await region.release(b)
        d = await asyncio.wait_for(waiting, 1)
        assert d.offset == DATA_OFFSET  # the merged hole
        await region.release(c)
        await region.release(d)
        whole = await region.lease(8 * SLOT_ALIGN)
        assert whole is not None and whole.offset == DATA_OFFSET
        assert region.name.startswith("/proc/") and os.readlink(region.name).startswith("/memfd:statestore-shm")
    finally:
        region.close()
