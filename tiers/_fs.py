"""Blocking file-system primitives of the SSD tier; every function here runs in a worker thread.

The SSD tier (`tiers/ssd.py`) keeps the bookkeeping on the event loop and hands each whole
disk operation (encode + write + fdatasync + rename + directory fsync, or open + read +
verify) to one `asyncio.to_thread` call, so an operation costs one thread hop and the loop
never waits on the disk. Nothing here knows about the index or the budget.

Durable write protocol (`write_durable`), POSIX-correct and what the tier acknowledges on::

    1. open  <dir>/<name>.<tag>.tmp   O_CREAT|O_EXCL (O_DIRECT for large records, see below)
    2. write all bytes                (short writes are continued, never ignored)
    3. fdatasync(tmp)                 the bytes and the file size are on the device
    4. rename(tmp, final)             atomic: readers see the old record or the new one
    5. fsync(dir)                     the new name is on the device

A crash before 5 leaves either the old record or a `.tmp` leftover that the start-up scan
removes; it never leaves a half-written file under a record's name.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tiers.record import HEADER_SIZE, RecordError, RecordHeader, decode_header

ALIGN = 4096  # O_DIRECT alignment of buffer, offset and length on every device we target
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

Chunk = bytes | bytearray | memoryview


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir_durable(path: Path) -> None:
    """Create `path` if missing and make its entry durable in its (existing) parent.

    A record is only durable if every directory on its path is, so a directory created for
    it must be fsynced into its parent before the record is acknowledged. The parent is
    fsynced even when the directory already exists: another thread (or a process that died)
    may have created it without having fsynced the parent yet. Callers remember which
    directories they made durable, so this runs once per directory and process.
    """
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    fsync_dir(path.parent)


def _write_all(fd: int, chunks: Sequence[Chunk]) -> None:
    """Write every byte of `chunks` (os.writev may return short; continue where it stopped)."""
    views = [memoryview(c).cast("B") for c in chunks if len(c)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class _AlignedBuffers(threading.local):
    """One page-aligned scratch buffer per worker thread for O_DIRECT writes (grown on need)."""

    buf: mmap.mmap | None = None

    def get(self, nbytes: int) -> mmap.mmap:
        if self.buf is None or len(self.buf) < nbytes:
            if self.buf is not None:
                self.buf.close()
            self.buf = mmap.mmap(-1, round_up(nbytes, 1 << 20))  # anonymous: page-aligned
        return self.buf


_aligned = _AlignedBuffers()


def _write_direct(tmp: Path, chunks: Sequence[Chunk], total: int) -> int:
    """O_DIRECT write of `chunks` padded to ALIGN, then truncated to `total`. Returns the fd.

    Skips the page-cache copy and leaves the cache to the host tier. Raises OSError(EINVAL)
    where the file system refuses O_DIRECT (tmpfs, some overlay set-ups).
    """
    padded = round_up(total, ALIGN)
    buf = _aligned.get(padded)
    offset = 0
    for chunk in chunks:
        buf[offset: offset + len(chunk)] = chunk
        offset += len(chunk)
    buf[total:padded] = bytes(padded - total)  # a stale tail never reaches the disk
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o644)
    try:
        view, done = memoryview(buf), 0
        while done < padded:
            done += os.write(fd, view[done:padded])
        if padded != total:
            os.ftruncate(fd, total)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_durable(tmp: Path, final: Path, chunks: Sequence[Chunk], *, direct: bool) -> None:
    """Steps 1-5 of the module docstring. On any error the temp file is removed and the
    error re-raised: the caller sees either a durable record or nothing at all."""
    total = sum(len(c) for c in chunks)
    try:
        fd = _open_and_write(tmp, chunks, total, direct)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        remove_quietly(tmp)
        raise
    fsync_dir(final.parent)


def _open_and_write(tmp: Path, chunks: Sequence[Chunk], total: int, direct: bool) -> int:
    if direct:
        try:
            return _write_direct(tmp, chunks, total)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            remove_quietly(tmp)  # no O_DIRECT here: fall through to buffered I/O
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, chunks)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(frozen=True, slots=True)
class FileRead:
    """A whole file as read by one `read_whole`, with the inode it came from.

    `data` may be a view of this thread's aligned scratch buffer (O_DIRECT reads): the
    caller must copy what it keeps before the thread reads again.
    """

    data: bytes | memoryview
    inode: int


def read_whole(path: Path, *, direct: bool) -> FileRead:
    """Read a whole file with one read of its full size; a short read raises, never pads.

    `direct`: O_DIRECT into the thread's aligned buffer (one device I/O of the whole file,
    no page-cache copy, no readahead windows); else one buffered os.read. The inode lets
    the caller quarantine exactly the file it read, not a newer one renamed over it.
    """
    fd = _open_for_read(path, direct)
    try:
        st = os.fstat(fd)
        if direct:
            buf = _aligned.get(st.st_size + ALIGN)
            view = memoryview(buf)[: round_up(st.st_size, ALIGN)]
            got = _read_into(fd, view)
            data: bytes | memoryview = view[:got]
        else:
            data = os.read(fd, st.st_size) if st.st_size else b""
            if len(data) < st.st_size:  # one read returns at most ~2 GiB on Linux
                data += os.read(fd, st.st_size - len(data))
            got = len(data)
    finally:
        os.close(fd)
    if got != st.st_size:
        raise RecordError(f"short read: {got} of {st.st_size} bytes")
    return FileRead(data, st.st_ino)


def _read_into(fd: int, view: memoryview) -> int:
    """Fill `view` from fd; stops early only at EOF. O_DIRECT-safe: it only continues from
    an aligned offset (a short read at an unaligned offset is the end of the file)."""
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        got += n
        if n == 0 or got % ALIGN:
            break
    return got


def _open_for_read(path: Path, direct: bool) -> int:
    if direct:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def read_header(path: Path | str, *, dir_fd: int | None = None) -> tuple[RecordHeader, int]:
    """The verified header of a record file and the file's size (the payload stays unread)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEADER_SIZE, 0)
    finally:
        os.close(fd)
    header, _ = decode_header(head)
    if size != HEADER_SIZE + header.stored_length:
        raise RecordError(f"file is {size} bytes but the header says {HEADER_SIZE + header.stored_length}")
    return header, size


def quarantine(path: Path, quarantine_dir: Path, *, inode: int | None = None) -> bool:
    """Move `path` into `quarantine_dir` (same file system: a rename). With `inode`, only if
    the path still names that inode. True if moved."""
    try:
        if inode is not None and os.stat(path).st_ino != inode:
            return False
        os.replace(path, quarantine_dir / f"{path.name}.{time.time_ns()}")
    except FileNotFoundError:
        return False
    return True
