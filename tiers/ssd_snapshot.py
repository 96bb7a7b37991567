"""The SSD tier's index, saved when the tier closes cleanly and read back at the next open,
so that a restart does not open and read every record's header again.

Why: the start-up scan lists every leaf directory and reads one header per record file. On the
development VM that is ~0.1 s per thousand records (100,000 records: 10-13 s; the few million a
terabyte of 256-token blocks holds: minutes) during which the server does not serve.

What keeps it safe (a snapshot must never hide what a full scan would find):
- It is written only by a clean close, with the tier quiescent (no put or delete in flight),
  as a temp file, fdatasynced, renamed into place, the root fsynced (`_fs.write_durable`).
- It vouches only for leaf directories whose files are exactly the records the index holds
  there: a leaf the tier changed since it opened is listed at close and its names compared with
  the index's keys; a leaf it did not change must carry the (mtime_ns, inode) stamp it had when
  the tier opened. Any other leaf (a stray or missing file, a temp file, a change made behind
  the tier's back) is left out, and the next open scans it.
- Open reads it and removes it (unlink, root fsynced) before the tier serves anything: a crash
  after that finds no snapshot and scans everything, as a crash always did.
- A leaf changed in the last second before the close is left out too: a directory's mtime
  comes from a coarse clock (a tick of a few ms), so a change right after the close could leave
  the stamp as it was; a second's margin leaves none of them unseen.
- Open compares each leaf's stamp with the one saved: a leaf in which anything was created,
  removed or renamed while no tier had it open is scanned file by file (and cleaned up as the
  scan does); the others' entries are taken from the snapshot. A snapshot that does not parse
  or whose checksum does not match is ignored: the tier scans everything.
- What a snapshot cannot see is a record file rewritten in place while the tier was stopped
  (the bytes of a file change, not the directory): every get verifies the header and payload it
  reads, so such a record is a miss and is quarantined at its first get instead of at open.
  `SSDTier(index_snapshot=False)` (`storage.ssd_index_snapshot = false`), or removing the
  file, makes the next open scan every header.

Format (little-endian): MAGIC; u32 leaf count, then per leaf (u8 top, u8 sub, i64 mtime_ns,
u64 inode); u64 entry count, then per entry (u64 file bytes, the encoded header with a zero
payload checksum); u64 xxh3-64 of everything before it.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tiers import _fs
from tiers._iobuffers import IOBuffers
from tiers.record import HEADER_SIZE, RecordError, RecordHeader, decode_header, encode_header

SETTLE_NS = 1_000_000_000  # leaves changed this recently before a close are left to the next open's scan
SNAPSHOT_FILE = "index.snapshot"
SNAPSHOT_TEMP = SNAPSHOT_FILE + ".tmp"
MAGIC = b"SSIDX\x00\x01\n"
_COUNT32 = struct.Struct("<I")
_COUNT64 = struct.Struct("<Q")
_LEAF = struct.Struct("<BBqQ")
_ENTRY_SIZE = struct.Struct("<Q")
_ENTRY_BYTES = _ENTRY_SIZE.size + HEADER_SIZE

Leaf = tuple[int, int]  # (top, sub) fan-out bytes: key[2], key[3]
LeafStamp = tuple[int, int]  # (mtime_ns, inode)


def leaf_of(key: bytes) -> Leaf:
    """The leaf directory a record key lies in, as bytes (`SSDLayout.fanout` names it in hex)."""
    return key[2], key[3]


class SnapshotError(ValueError):
    """The snapshot file is not one this module wrote whole (truncated, corrupt, other format)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a clean close left: each leaf's stamp, and the index entries grouped by leaf."""

    leaves: dict[Leaf, LeafStamp]
    entries: dict[Leaf, list[tuple[RecordHeader, int]]]  # (header, file bytes)

    @property
    def num_records(self) -> int:
        return sum(map(len, self.entries.values()))


def restamped(root: Path, stamps: dict[Leaf, LeafStamp], leaves: Iterable[Leaf]) -> dict[Leaf, LeafStamp]:
    """`stamps` with these leaves stamped again as they are now (gone ones dropped): after a
    scan changed them, without stamping every leaf again."""
    out = dict(stamps)
    for top, sub in leaves:
        try:
            st = os.stat(root / f"{top:02x}" / f"{sub:02x}", follow_symlinks=False)
        except FileNotFoundError:
            out.pop((top, sub), None)
            continue
        out[(top, sub)] = (st.st_mtime_ns, st.st_ino)
    return out


def leaf_stamps(root: Path) -> dict[Leaf, LeafStamp]:
    """(mtime_ns, inode) of every leaf directory root/<top>/<sub>/ that exists now."""
    stamps: dict[Leaf, LeafStamp] = {}
    for top, top_entry in _fanout_dirs(root):
        for sub, sub_entry in _fanout_dirs(top_entry.path):
            st = sub_entry.stat(follow_symlinks=False)
            stamps[(top, sub)] = (st.st_mtime_ns, st.st_ino)
    return stamps


def _fanout_dirs(path: Path | str) -> Iterator[tuple[int, os.DirEntry[str]]]:
    """The fan-out directories in `path` (two hex digits), with the byte each stands for."""
    with os.scandir(path) as entries:
        for entry in entries:
            if len(entry.name) == 2 and entry.is_dir(follow_symlinks=False):
                try:
                    yield int(entry.name, 16), entry
                except ValueError:
                    continue


def encode(stamps: dict[Leaf, LeafStamp], entries: Iterable[tuple[RecordHeader, int]]) -> bytes:
    """The snapshot file's bytes for these leaf stamps and (header, file bytes) entries."""
    parts = [MAGIC, _COUNT32.pack(len(stamps))]
    parts += [_LEAF.pack(top, sub, mtime, ino) for (top, sub), (mtime, ino) in sorted(stamps.items())]
    body: list[bytes] = []
    for header, file_bytes in entries:
        body.append(_ENTRY_SIZE.pack(file_bytes))
        body.append(encode_header(header, stored_length=header.stored_length, flags=header.flags, checksum=0))
    parts.append(_COUNT64.pack(len(body) // 2))
    parts += body
    blob = b"".join(parts)
    return blob + _COUNT64.pack(xxhash.xxh3_64_intdigest(blob))


def decode(blob: bytes | memoryview) -> Snapshot:
    """Parse a snapshot file's bytes; SnapshotError says what is wrong with them."""
    view = memoryview(blob)
    if len(view) < len(MAGIC) + _COUNT32.size + _COUNT64.size * 2 or bytes(view[:len(MAGIC)]) != MAGIC:
        raise SnapshotError("not an index snapshot of this format")
    body, (stored_sum,) = view[:-_COUNT64.size], _COUNT64.unpack(view[-_COUNT64.size:])
    if xxhash.xxh3_64_intdigest(body) != stored_sum:
        raise SnapshotError("checksum mismatch: the snapshot is truncated or corrupt")
    at = len(MAGIC)
    (num_leaves,) = _COUNT32.unpack_from(body, at)
    at += _COUNT32.size
    if at + num_leaves * _LEAF.size + _COUNT64.size > len(body):
        raise SnapshotError(f"{num_leaves} leaves do not fit the file")
    leaves = {(top, sub): (mtime, ino) for top, sub, mtime, ino in _LEAF.iter_unpack(body[at:at + num_leaves * _LEAF.size])}
    at += num_leaves * _LEAF.size
    (num_entries,) = _COUNT64.unpack_from(body, at)
    at += _COUNT64.size
    if at + num_entries * _ENTRY_BYTES != len(body):
        raise SnapshotError(f"{num_entries} entries do not match the file's {len(body) - at} bytes")
    entries: dict[Leaf, list[tuple[RecordHeader, int]]] = {}
    try:
        for i in range(num_entries):
            (file_bytes,) = _ENTRY_SIZE.unpack_from(body, at)
            header, _ = decode_header(body[at + _ENTRY_SIZE.size:at + _ENTRY_BYTES])
            at += _ENTRY_BYTES
            leaf = leaf_of(header.key)
            if leaf not in leaves:
                raise SnapshotError(f"entry {i} lies in a leaf the snapshot does not list")
            entries.setdefault(leaf, []).append((header, file_bytes))
    except RecordError as exc:
        raise SnapshotError(f"entry {i}: {exc}") from None
    return Snapshot(leaves, entries)


def vouched(root: Path, now: dict[Leaf, LeafStamp], entries: Iterable[tuple[RecordHeader, int]],
            touched: set[Leaf], opened: dict[Leaf, LeafStamp],
            suffix: str) -> tuple[dict[Leaf, LeafStamp], list[tuple[RecordHeader, int]]]:
    """Of the leaves as they are `now` (`leaf_stamps`), those a snapshot may vouch for, with
    their stamps, and their entries: a leaf the tier changed since it opened (`touched`) if its
    file names are exactly its entries' keys (hex + `suffix`), any other if its stamp is still
    the one it had at open (`opened`)."""
    by_leaf: dict[Leaf, list[tuple[RecordHeader, int]]] = {}
    for header, file_bytes in entries:
        by_leaf.setdefault(leaf_of(header.key), []).append((header, file_bytes))
    stamps: dict[Leaf, LeafStamp] = {}
    settled = time.time_ns() - SETTLE_NS
    for leaf, stamp in now.items():
        if stamp[0] > settled:
            continue
        if leaf in touched:
            names = os.listdir(root / f"{leaf[0]:02x}" / f"{leaf[1]:02x}")
            if sorted(names) == sorted(h.key.hex() + suffix for h, _ in by_leaf.get(leaf, ())):
                stamps[leaf] = stamp
        elif opened.get(leaf) == stamp:
            stamps[leaf] = stamp
    return stamps, [entry for leaf in stamps for entry in by_leaf.get(leaf, ())]


def write(root: Path, stamps: dict[Leaf, LeafStamp], entries: Iterable[tuple[RecordHeader, int]],
          buffers: IOBuffers) -> int:
    """Write the snapshot durably, as the tier replaces a record (`_fs.write_durable`: temp file,
    fdatasync, rename, root fsync; `buffers` unused by a buffered write); returns its bytes."""
    blob = encode(stamps, entries)
    _fs.write_durable(root / SNAPSHOT_TEMP, root / SNAPSHOT_FILE, [blob], direct=False, buffers=buffers)
    return len(blob)


def take(root: Path) -> tuple[Snapshot | None, str]:
    """Read and remove the snapshot (and any temp left by a close that died writing one),
    durably, before the tier serves: (the snapshot, "") or (None, why there is none)."""
    path, temp = root / SNAPSHOT_FILE, root / SNAPSHOT_TEMP
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        blob = None
    removed = False
    for leftover in (path, temp):
        try:
            os.unlink(leftover)
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        _fs.fsync_dir(root)
    if blob is None:
        return None, "no snapshot (the tier was not closed cleanly, or never opened)"
    try:
        return decode(blob), ""
    except SnapshotError as exc:
        return None, f"snapshot ignored: {exc}"


def trusted_entries(snapshot: Snapshot, stamps: dict[Leaf, LeafStamp]) -> tuple[list[Leaf], Iterator[tuple[RecordHeader, int]]]:
    """The leaves that changed since the snapshot (or are new: scan them) and the entries of
    those that did not (take them as they are)."""
    changed = [leaf for leaf, stamp in stamps.items() if snapshot.leaves.get(leaf) != stamp]
    unchanged = (leaf for leaf, stamp in stamps.items() if snapshot.leaves.get(leaf) == stamp)
    return changed, (entry for leaf in unchanged for entry in snapshot.entries.get(leaf, ()))
