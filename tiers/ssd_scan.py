"""The SSD tier's start-up scan (`tiers.ssd`), run on worker threads: the root's fan-out
directories, the spares (a whole record in a spare is a put whose rename did not reach the
disk: moved to its name), every leaf's record headers, and what does not belong (temp
leftovers removed, torn or foreign files quarantined, unreadable ones left alone); and the
index snapshot a clean close writes (`tiers.ssd_snapshot`)."""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tiers import _fs, ssd_snapshot
from tiers._iobuffers import IOBuffers
from tiers.record import RecordError, RecordHeader, RecordKey, decode_record
from tiers.ssd_layout import LOCK_FILE, QUARANTINE_DIR, RECORD_SUFFIX, SPARE_SUFFIX, SPARES_DIR, TEMP_SUFFIX, SSDLayout

SCAN_CHUNK = 16  # first-level directories per scan thread call


@dataclass(slots=True)
class DirScan:
    entries: list[tuple[RecordKey, RecordHeader, int]] = dataclasses.field(default_factory=list)
    discarded: list[str] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SnapshotUse:
    """How the last scan indexed the tier: the records it took from an index snapshot
    (`tiers.ssd_snapshot`) and the leaf directories it scanned because they changed since (or
    just before the close); `leaves_scanned` None: no snapshot, every leaf scanned, `why_not` says why."""

    from_snapshot: int
    leaves_scanned: int | None
    why_not: str

    def describe(self, indexed: int) -> str:
        if self.leaves_scanned is None:
            return f"{indexed} records indexed by a full scan ({self.why_not})"
        return (f"{indexed} records indexed: {self.from_snapshot} from the snapshot the last clean close saved, "
                f"the rest by scanning the {self.leaves_scanned} leaf directories changed since")


def write_snapshot(root: Path, entries: list[tuple[RecordHeader, int]], touched: set[ssd_snapshot.Leaf],
                    opened: dict[ssd_snapshot.Leaf, ssd_snapshot.LeafStamp],
                    buffers: IOBuffers) -> tuple[int, int, int]:
    """Worker thread: the snapshot of the leaves it may vouch for (`ssd_snapshot.vouched`);
    returns (leaves vouched for, leaves left out, bytes written)."""
    now = ssd_snapshot.leaf_stamps(root)
    stamps, vouched = ssd_snapshot.vouched(root, now, entries, touched, opened, RECORD_SUFFIX)
    return len(stamps), len(now) - len(stamps), ssd_snapshot.write(root, stamps, vouched, buffers)


def list_root(root: Path) -> tuple[list[str], list[str]]:
    """Worker thread: the first-level fan-out directories, and what else is in the root."""
    tops, discarded = [], []
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name in (QUARANTINE_DIR, SPARES_DIR, LOCK_FILE, ssd_snapshot.SNAPSHOT_FILE,
                              ssd_snapshot.SNAPSHOT_TEMP):
                continue
            if len(entry.name) == 2 and entry.is_dir(follow_symlinks=False):
                tops.append(entry.name)
            else:
                discarded.append(f"{entry.name}: unexpected entry (left alone)")
    return sorted(tops), sorted(discarded)


@dataclass(slots=True)
class SpareScan:
    ready: list[str] = dataclasses.field(default_factory=list)  # empty spares (paths)
    recycled: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (path, size)
    recovered: list[str] = dataclasses.field(default_factory=list)  # records moved to their names
    discarded: list[str] = dataclasses.field(default_factory=list)


def scan_spares(layout: SSDLayout) -> SpareScan:
    """Worker thread, before the fan-out walk: an empty spare is a spare, one whose header
    block is zero a recycled spare; one holding a whole record (header, size and payload
    checksum) is an acknowledged (or finished) put whose rename did not reach the disk,
    renamed to its final name now; anything else is torn (quarantined). Ends with one fsync of the spares directory, so the
    names of the spares it hands back are durable."""
    out = SpareScan()
    spares = layout.spares_dir
    spares.mkdir(exist_ok=True)
    moved_into: set[Path] = set()
    with os.scandir(spares) as entries:
        names = sorted(e.name for e in entries)
    for name in names:
        path = spares / name
        problem = _scan_spare(layout, path, out, moved_into)
        if problem:
            if _fs.quarantine(path, layout.quarantine_dir):
                out.discarded.append(f"{SPARES_DIR}/{name}: {problem} (quarantined)")
    for directory in sorted(moved_into):
        _fs.fsync_dir(directory)
    _fs.fsync_dir(spares)
    return out


def _scan_spare(layout: SSDLayout, path: Path, out: SpareScan, moved_into: set[Path]) -> str:
    """One file of spares/; "" when dealt with, else what is wrong with it."""
    try:
        st = os.lstat(path)
        if not path.name.endswith(SPARE_SUFFIX) or not stat.S_ISREG(st.st_mode):
            return "unexpected file in the spares directory"
        if st.st_size == 0:
            out.ready.append(str(path))
            return ""
        if _fs.is_recycled_spare(path):
            out.recycled.append((str(path), st.st_size))
            return ""
        header, _ = _fs.read_header(path)
        # The payload too (spares holding records are crash leftovers: few): a put torn inside a
        # recycled spare can leave a new header over old payload bytes at the old file's size.
        decode_record(path.read_bytes(), expect_key=header.key)
    except RecordError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable ({exc})"
    final = layout.path(header.key)
    try:
        _fs.make_dir_durable(final.parent)
        os.replace(path, final)  # the spare's record is newer than any file under its name
    except OSError as exc:
        return f"whole record not moved to {final.relative_to(layout.root)} ({exc})"
    moved_into.add(final.parent)
    out.recovered.append(f"{SPARES_DIR}/{path.name} -> {final.relative_to(layout.root)}")
    return ""


def scan_top_dirs(layout: SSDLayout, tops: Sequence[str]) -> DirScan:
    """Worker thread: classify every file under root/<top>/<sub>/, clean up as it goes."""
    out = DirScan()
    for top in tops:
        with os.scandir(layout.root / top) as subs:
            for sub in subs:
                if sub.is_dir(follow_symlinks=False) and len(sub.name) == 2:
                    _scan_leaf(layout, top, sub.name, out)
                else:
                    out.discarded.append(f"{top}/{sub.name}: unexpected entry (left alone)")
    return out


def scan_leaves(layout: SSDLayout, leaves: Sequence[ssd_snapshot.Leaf]) -> DirScan:
    """Worker thread: `_scan_leaf` of each of these leaves (those an index snapshot does not cover)."""
    out = DirScan()
    for top, sub in leaves:
        _scan_leaf(layout, f"{top:02x}", f"{sub:02x}", out)
    return out


def _scan_leaf(layout: SSDLayout, top: str, sub: str, out: DirScan) -> None:
    """One leaf directory, opened once: files are opened relative to it (no path walks),
    which matters at millions of records."""
    try:
        fanout = (int(top, 16), int(sub, 16))
    except ValueError:
        fanout = (-1, -1)
    dir_fd = os.open(layout.root / top / sub, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in os.listdir(dir_fd):
            problem = _scan_file(dir_fd, name, fanout, out)
            if problem:
                _set_aside(layout, top, sub, name, problem, out)
    finally:
        os.close(dir_fd)


def _scan_file(dir_fd: int, name: str, fanout: tuple[int, int], out: DirScan) -> str:
    """Index one file; "" when done with it, else what is wrong with it."""
    if name.endswith(TEMP_SUFFIX):
        return "leftover temp file of an unacknowledged put"
    key = SSDLayout.key_from_name(name)
    if key is None or (key[2], key[3]) != fanout:
        return "unexpected file name or directory"
    try:
        header, size = _fs.read_header(name, dir_fd=dir_fd)
    except RecordError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable ({exc})"
    if header.key != key:
        return "header key does not match the file name"
    out.entries.append((key, header, size))
    return ""


def _set_aside(layout: SSDLayout, top: str, sub: str, name: str, problem: str, out: DirScan) -> None:
    """Temp leftovers are removed; unreadable files left alone; anything else quarantined."""
    path = layout.root / top / sub / name
    where = f"{top}/{sub}/{name}"
    if name.endswith(TEMP_SUFFIX):
        _fs.remove_quietly(path)
        out.discarded.append(f"{where}: {problem} (removed)")
    elif problem.startswith("unreadable"):
        out.discarded.append(f"{where}: {problem}; left in place, not indexed")
    else:
        _fs.quarantine(path, layout.quarantine_dir)
        out.discarded.append(f"{where}: {problem} (quarantined)")
