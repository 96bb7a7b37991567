"""Records on the wire (statestore/wire.py): the hand-built frames are exactly the protobuf
serialization of `RecordChunk{data}`, and reassembly accepts any split of the encoded record
with the same checks and messages as `decode_record`."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.statestore.v1 import common_pb2
from statestore.wire import (PartsChecksum, data_frame, encoded_size, frame_slices, join_parts, record_frames,
                            split_data_frame)
from tiers.record import HEADER_SIZE, RecordError, encode_record, make_record


def record(nbytes: int):  # type: ignore[no-untyped-def]
    return make_record(1, 1, os.urandom(nbytes), model_fingerprint=b"\x01" * 16, tenant_id=bytes(16),
                       block_key=b"\x02" * 32, token_end=256)


def same(a, b) -> bool:  # type: ignore[no-untyped-def]
    """Equal records (decoding also records how the payload was stored: not part of identity)."""
    return a.payload == b.payload and replace(a.header, stored_length=0, flags=0) == b.header


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16383, 16384, 1 << 20])
def test_data_frames_are_the_protobuf_serialization(n: int) -> None:
    data = os.urandom(n)
    frame = data_frame(data[: n // 2], memoryview(data)[n // 2:])
    assert frame == common_pb2.RecordChunk(data=data).SerializeToString()
    view = split_data_frame(frame)
    assert view is not None and bytes(view) == data


def test_other_messages_are_not_data_frames() -> None:
    start = common_pb2.RecordChunk(start=common_pb2.RecordStart(key=b"k" * 34, total_bytes=9)).SerializeToString()
    assert split_data_frame(start) is None
    assert split_data_frame(b"") is None and split_data_frame(b"\x12\x05abc") is None  # length disagrees


@pytest.mark.parametrize("nbytes, chunk", [(0, 1024), (100, 1024), (1024, 1024), (5000, 1024), (3 << 20, 1 << 20)])
def test_frames_round_trip(nbytes: int, chunk: int) -> None:
    r = record(nbytes)
    frames = list(record_frames(r, chunk))
    parts = [split_data_frame(f) for f in frames]
    assert all(p is not None for p in parts)
    # The header rides in the first frame: as many messages as the payload alone needs.
    assert len(parts) == max(1, -(-nbytes // chunk))
    assert len(parts[0]) == HEADER_SIZE + min(nbytes, chunk)  # type: ignore[arg-type]
    assert all(len(p) <= chunk for p in parts[1:])  # type: ignore[arg-type]
    assert sum(len(p) for p in parts) == encoded_size(r)  # type: ignore[arg-type]
    assert b"".join(parts) == encode_record(r)  # type: ignore[arg-type]
    assert same(join_parts(parts, expect_key=r.key), r)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(nbytes=st.integers(0, 5000), chunk=st.integers(1, 2048))
def test_frames_round_trip_any_sizes(nbytes: int, chunk: int) -> None:
    r = record(nbytes)
    parts = [split_data_frame(f) for f in record_frames(r, chunk)]
    assert len(parts) == max(1, -(-nbytes // chunk))
    assert b"".join(parts) == encode_record(r)  # type: ignore[arg-type]
    assert same(join_parts(parts, expect_key=r.key), r)  # type: ignore[arg-type]


def test_frames_need_a_positive_chunk() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        list(record_frames(record(10), 0))


@pytest.mark.parametrize("cuts", [[], [10], [HEADER_SIZE], [HEADER_SIZE + 1, 300], [50, 100, 150, 2000]])
def test_any_split_reassembles(cuts: list[int]) -> None:
    r = record(4000)
    data = encode_record(r)
    bounds = [0, *cuts, len(data)]
    assert same(join_parts([data[a:b] for a, b in zip(bounds, bounds[1:])], expect_key=r.key), r)


def _summed(parts: list[bytes]) -> int | None:
    summed = PartsChecksum()
    for i in range(len(parts)):
        summed.add(parts[: i + 1])
    return summed.value()


@settings(max_examples=80, deadline=None)
@given(nbytes=st.integers(0, 3000), cuts=st.lists(st.integers(0, 3200), max_size=4), flip=st.integers(-1, 3200))
def test_a_checksum_taken_part_by_part_verifies_as_join_parts_does(nbytes: int, cuts: list[int], flip: int) -> None:
    """PartsChecksum over the parts as they arrive gives join_parts the same verdict as hashing
    the joined payload: the same record, or the same checksum error for a flipped payload byte;
    a one-part record (or a first part shorter than the header) is left to join_parts."""
    r = record(nbytes)
    data = bytearray(encode_record(r))
    if HEADER_SIZE <= flip < len(data):
        data[flip] ^= 0x40
    bounds = [0, *sorted(c for c in cuts if c < len(data)), len(data)]
    parts = [bytes(data[a:b]) for a, b in zip(bounds, bounds[1:])]
    summed = _summed(parts)
    assert (summed is None) == (len(parts) < 2 or len(parts[0]) < HEADER_SIZE)
    try:
        assert same(join_parts(parts, expect_key=r.key), r)
    except RecordError as exc:
        assert "checksum mismatch" in str(exc) and flip >= HEADER_SIZE
        with pytest.raises(RecordError, match="payload checksum mismatch"):
            join_parts(parts, expect_key=r.key, payload_sum=summed)
        return
    assert same(join_parts(parts, expect_key=r.key, payload_sum=summed), r)


@pytest.mark.parametrize("split", [True, False])
def test_corruption_and_mismatch_get_decode_records_messages(split: bool) -> None:
    r = record(2000)
    data = bytearray(encode_record(r))
    data[-1] ^= 1
    parts = [bytes(data[:HEADER_SIZE + 10]), bytes(data[HEADER_SIZE + 10:])] if split else [bytes(data[:50]), bytes(data[50:])]
    with pytest.raises(RecordError, match="payload checksum mismatch"):
        join_parts(parts)
    good = encode_record(r)
    with pytest.raises(RecordError, match="record key does not match"):
        join_parts([good[:HEADER_SIZE + 5], good[HEADER_SIZE + 5:]], expect_key=b"\x00" * 34)
    with pytest.raises(RecordError, match="truncated payload"):
        join_parts([good[:HEADER_SIZE + 5], good[HEADER_SIZE + 5:-1]])
    with pytest.raises(RecordError, match="trailing bytes"):
        join_parts([good[:HEADER_SIZE + 5], good[HEADER_SIZE + 5:] + b"x"])


@settings(max_examples=60, deadline=None)
@given(nbytes=st.integers(0, 5000), chunk=st.integers(1, 2048))
def test_frame_slices_lay_out_exactly_the_frames_of_record_frames(nbytes: int, chunk: int) -> None:
    """A tier filling `frame_slices` from its pages sends the very bytes `record_frames` builds."""
    r = record(nbytes)
    header = encode_record(r)[:HEADER_SIZE]
    slices = frame_slices(chunk)(header, nbytes)
    assert [prefix + r.payload[a:b] for prefix, a, b in slices] == list(record_frames(r, chunk))
    with pytest.raises(ValueError, match="must be positive"):
        frame_slices(0)


def test_a_one_frame_record_keeps_its_payload_as_a_view_and_is_still_verified() -> None:
    r = record(3000)
    (frame,) = record_frames(r, 4096)
    got = join_parts([split_data_frame(frame)], expect_key=r.key, keep_view=True)  # type: ignore[list-item]
    assert isinstance(got.payload, memoryview) and got.payload.readonly and same(got, r)
    assert type(join_parts([split_data_frame(frame)]).payload) is bytes  # type: ignore[list-item]  # default: a copy
    bad = bytearray(frame)
    bad[-1] ^= 1
    with pytest.raises(RecordError, match="payload checksum mismatch"):
        join_parts([split_data_frame(bytes(bad))], keep_view=True)  # type: ignore[list-item]
    two = [split_data_frame(f) for f in record_frames(r, 1024)]  # several frames: joined, as before
    assert type(join_parts(two, keep_view=True).payload) is bytes  # type: ignore[arg-type]
