"""The index snapshot's file format (tiers/ssd_snapshot.py): what `encode` writes `decode`
reads back exactly, and a truncated or altered file is refused, never half-read."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.record import RecordHeader, make_record
from tiers.ssd_snapshot import MAGIC, SnapshotError, decode, encode, trusted_entries

leaves = st.tuples(st.integers(0, 255), st.integers(0, 255))
stamps = st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(0, (1 << 64) - 1))


@st.composite
def snapshots(draw: st.DrawFn) -> tuple[dict, list[tuple[RecordHeader, int]]]:
    """Leaf stamps and entries whose keys fall in those leaves (the record key is kind + block
    key, and a leaf is the key's bytes 2 and 3: the block key's first two)."""
    leaf_stamps = draw(st.dictionaries(leaves, stamps, min_size=1, max_size=6))
    entries = []
    for _ in range(draw(st.integers(0, 8))):
        top, sub = draw(st.sampled_from(sorted(leaf_stamps)))
        header = make_record(draw(st.integers(0, 0xFFFF)), 1, b"", model_fingerprint=b"f" * 16,
                             tenant_id=draw(st.binary(min_size=16, max_size=16)),
                             block_key=bytes([top, sub]) + draw(st.binary(min_size=30, max_size=30)),
                             token_start=draw(st.integers(0, 1 << 40)), token_end=1 << 41).header
        length = draw(st.integers(0, 1 << 30))
        header = dataclasses.replace(header, raw_length=length, stored_length=length)
        entries.append((header, draw(st.integers(0, (1 << 64) - 1))))
    return leaf_stamps, entries


@settings(max_examples=60, deadline=None)
@given(snapshots())
def test_what_encode_writes_decode_reads_back(drawn: tuple[dict, list]) -> None:
    leaf_stamps, entries = drawn
    snap = decode(encode(leaf_stamps, entries))
    assert snap.leaves == leaf_stamps
    got = sorted(((h.key, h, n) for hs in snap.entries.values() for h, n in hs), key=lambda t: (t[0], t[2]))
    want = sorted(((h.key, h, n) for h, n in entries), key=lambda t: (t[0], t[2]))
    assert [(k, n) for k, _, n in got] == [(k, n) for k, _, n in want]
    assert [h for _, h, _ in got] == [h for _, h, _ in want]
    assert snap.num_records == len(entries)


@settings(max_examples=40, deadline=None)
@given(snapshots(), st.data())
def test_any_truncation_or_altered_byte_is_refused(drawn: tuple[dict, list], data: st.DataObject) -> None:
    leaf_stamps, entries = drawn
    blob = encode(leaf_stamps, entries)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(SnapshotError):
        decode(blob[:cut])
    at = data.draw(st.integers(0, len(blob) - 1))
    flipped = bytearray(blob)
    flipped[at] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(SnapshotError):
        decode(bytes(flipped))


def test_an_entry_outside_the_listed_leaves_is_refused() -> None:
    header = make_record(1, 1, b"x", model_fingerprint=b"f" * 16, tenant_id=b"t" * 16, block_key=b"k" * 32).header
    header = dataclasses.replace(header, stored_length=1)
    with pytest.raises(SnapshotError, match="leaf the snapshot does not list"):
        decode(encode({(0, 0): (1, 2)}, [(header, 169)]))
    assert decode(encode({(header.key[2], header.key[3]): (1, 2)}, [(header, 169)])).num_records == 1
    with pytest.raises(SnapshotError, match="not an index snapshot"):
        decode(b"\0" * 64)
    assert MAGIC in encode({}, [])


def test_only_unchanged_leaves_are_trusted() -> None:
    header = make_record(1, 1, b"x", model_fingerprint=b"f" * 16, tenant_id=b"t" * 16, block_key=b"k" * 32).header
    header = dataclasses.replace(header, stored_length=1)
    leaf = (header.key[2], header.key[3])
    snap = decode(encode({leaf: (5, 6), (1, 1): (7, 8)}, [(header, 169)]))
    changed, trusted = trusted_entries(snap, {leaf: (5, 6), (1, 1): (7, 9), (2, 2): (1, 1)})
    assert sorted(changed) == [(1, 1), (2, 2)] and list(trusted) == [(header, 169)]
    changed, trusted = trusted_entries(snap, {leaf: (5, 7)})  # the record's leaf changed
    assert changed == [leaf] and list(trusted) == []
