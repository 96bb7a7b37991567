"""Blocking file-system primitives of the SSD tier; every function here runs in a worker thread.

The SSD tier (`tiers/ssd.py`) keeps the bookkeeping on the event loop and hands each whole
disk operation (encode + write + fdatasync + rename, or open + read + verify) to one call
on its own thread pool, so an operation costs one thread hop and the loop never waits on
the disk. Nothing here knows about the index or the budget. Paths are `str` or `Path`; the
tier passes `str` (building `Path` objects costs more than some syscalls here).

Three durable write protocols; the tier acknowledges a put only after one has returned.

New key, through a spare (`write_spare`), one journal commit and no directory fsync::

    0. (ahead of time, in batches) create empty spare files, fsync their directory once
       (`make_spares`): each spare's name is durable before any put claims it
    1. open  spares/<spare>         O_WRONLY (O_DIRECT for large records, see below)
    2. write all bytes              (short writes are continued, never ignored)
    3. fdatasync(spare)             the bytes and the file size are on the device: the
                                    record is durable under the spare's (durable) name
    4. rename(spare, <dir>/<name>)  atomic; not fsynced: the record is durable under one
                                    of its two names, and the scan moves a record it finds
                                    under a spare name to its own name

This deviates from "write to temp, fsync, rename, fsync the directory" (DESIGN section 4) on
purpose: the temp file is a spare whose name was made durable before the put, so the put
needs no directory fsync of its own. A directory fsync after a file's fdatasync is a second
synchronous trip to the device (a journal commit, or on ext4 at least a cache flush when the
journal has nothing left to commit): on the development VM 64-256 KiB puts with it took
~1.3-1.9x as long, and the tier with spares puts 256 KiB records 2.3-2.5x faster than without
(bench/tiers.py, `vs_dirsync`). What the deviation relies on is what every temp + rename
protocol relies on: a rename is atomic across a crash (ext4, XFS, btrfs journal it as one
operation), so the record is found under the spare name or the final one, never neither.
A crash before step 3 returns leaves a spare that is empty (a spare again) or torn (the
scan quarantines it); it never replaced anything: a torn record is never served.

A spare may also be a recycled one (`recycle`): the file of a dropped record, its header block
zeroed and fdatasynced before it was renamed into the spares directory, its size and data
blocks kept. Only a record whose file takes as many blocks claims it, so step 2 overwrites
blocks that are allocated and written (and truncates to the record's size, within the last
block). On the development VM (ext4 on a virtio disk) an O_DIRECT write plus fdatasync into
such a file took 0.35 / 0.65 / 1.73 / 12.5 ms at 256 KiB / 1 / 4 / 32 MiB, against 0.47 /
0.93 / 2.46 / 17.3 ms into an empty spare, which allocates its blocks (and, on a
thin-provisioned disk, makes the host allocate them). A crash in the middle of step 2 leaves a
recycled spare (header still zero), or a new header over old payload bytes at the old file's
size, whose payload checksum the scan verifies for every spare holding a record: quarantined,
never served.

New key without a spare (`write_new`: the pool is empty, or disabled), the data commit
plus the directory fsync::

    1. open  <dir>/<name>         O_CREAT|O_EXCL (O_DIRECT as above)
    2. write all bytes
    3. fdatasync(file)            the bytes and the file size are on the device
    4. fsync(dir)                 the new name is on the device

A crash before 4 returns can leave a torn file under the record's final name. It was
never acknowledged, and it never replaced anything (O_EXCL: the name did not exist), so
no acknowledged record is lost; its checksums fail, and the scan or the first `get`
quarantines it: it is never served. If the name exists (a file the index does not know,
e.g. one the scan could not read), `write_new` writes nothing and the tier falls back to:

Replacing a key (`write_durable`), so an acknowledged older version is never torn::

    1. open  <dir>/<name>.<tag>.tmp   O_CREAT|O_EXCL (O_DIRECT as above)
    2. write all bytes
    3. fdatasync(tmp)
    4. rename(tmp, final)             atomic: readers see the old record or the new one
    5. fsync(dir)                     the new name is on the device

A crash before 5 leaves either the old record or a `.tmp` leftover that the start-up scan
removes; it never leaves a half-written file under a record's name.

Why step 4 of `write_new` stays although ext4 commits the new directory entry in the same
journal transaction as the file's fdatasync: POSIX (and fsync(2) on Linux) only promise
the name after an fsync of the directory, and other file systems (ext4 without a journal,
ext2, vfat) do not give more. That is what the spares buy back, without the assumption.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import xxhash

from tiers._iobuffers import ALIGN, IOBuffers, round_up
from tiers.record import HEADER_SIZE, RecordError, RecordHeader, copy_gathered, copy_hashing, decode_header

NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

Chunk = bytes | bytearray | memoryview


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


class Staged:
    """A record's file image assembled in an aligned pooled buffer (`IOBuffers.lend`) before
    it is stored: HEADER_SIZE bytes of room for the header, then the payload, which the
    receiver fills through `dest` (a server copying a received record out of a client's
    shared memory or its message parts, hashing as it copies). `payload` is the read-only
    view a `Record` carries. A tier that knows the record is staged writes the buffer with
    O_DIRECT as it lies (`LaidOut`), instead of copying the payload into an aligned buffer of
    its own. The buffer goes back to its pool once every view of it is gone."""

    __slots__ = ("buf", "dest", "payload", "_sources", "_checksum")

    def __init__(self, buffers: IOBuffers, payload_bytes: int) -> None:
        if payload_bytes < 0:
            raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
        total = HEADER_SIZE + payload_bytes
        self.buf = buffers.lend(round_up(total, ALIGN))
        self.dest = self.buf[HEADER_SIZE:total]
        self.payload = self.dest.toreadonly()
        self._sources: tuple[memoryview, ...] | None = None
        self._checksum: int | None = 0

    def defer_fill(self, sources: Sequence[memoryview], checksum: int | None) -> None:
        """The payload is to be copied from `sources` (laid end to end, as long) by the write that stores it,
        piece by piece while the previous piece is written (`_write_filling`), and verified
        against `checksum` before the record becomes visible; until then `payload` holds
        nothing valid. For the durability tier's write of a put: nothing may read the payload
        before it (`fill` does the whole copy at once for any other path). `checksum` None: the
        fill takes it (a client that left it to the server, statestore/shm.py "Lent memory"):
        `checksum` then holds it once the fill is done, for the header written last."""
        size = sum(len(s) for s in sources)
        if size != len(self.dest):
            raise ValueError(f"fill sources of {size} bytes for a {len(self.dest)}-byte payload")
        self._sources, self._checksum = tuple(sources), checksum

    @property
    def pending(self) -> bool:
        """A deferred fill has not completed yet."""
        return self._sources is not None

    @property
    def checksum(self) -> int | None:
        """The payload's xxh3 once filled (None while a fill that takes it is pending)."""
        return None if self._sources is not None else self._checksum

    def fill(self) -> None:
        """Do a pending fill now, whole (copy, hash): RecordError if the checksum does not match."""
        if self._sources is not None:
            hasher = xxhash.xxh3_64()
            copy_gathered(self.dest, self._sources, 0, hasher)
            self._filled(hasher)

    def _filled(self, hasher: Any) -> None:
        if self._checksum is None:
            self._checksum = hasher.intdigest()
        elif hasher.intdigest() != self._checksum:
            raise RecordError("payload checksum mismatch: the payload is corrupt")
        self._sources = None

    def laid_out(self, head: Chunk | None, helpers: Executor | None = None,
                 make_head: Callable[[int], bytes] | None = None) -> LaidOut:
        """The chunks (encoded header, payload) of a write from this buffer (`helpers`: where
        a pending fill's writes run while the next piece is copied). `head` None: the header is
        `make_head(checksum)`, made once the fill has taken the checksum."""
        return LaidOut((head if head is not None else bytes(HEADER_SIZE), self.payload), self.buf, self, helpers,
                       None if head is not None else make_head)


class LaidOut(tuple):  # type: ignore[type-arg]
    """Write chunks (encoded header, payload) whose payload already lies in `buf` right after
    HEADER_SIZE bytes of header room (`Staged`): `_write_direct` copies only the header into
    place and writes `buf` itself. Anywhere else it is the plain chunks it holds (`plain()`).
    With `make_head` the header is made from the checksum the staged fill takes (`head()`)."""

    buf: memoryview
    staged: Staged | None
    helpers: Executor | None
    make_head: Callable[[int], bytes] | None
    made: Chunk | None

    def __new__(cls, chunks: tuple[Chunk, Chunk], buf: memoryview, staged: Staged | None = None,
                helpers: Executor | None = None, make_head: Callable[[int], bytes] | None = None) -> LaidOut:
        self = super().__new__(cls, chunks)
        self.buf, self.staged, self.helpers, self.make_head = buf, staged, helpers, make_head
        self.made: Chunk | None = None
        return self

    def head(self) -> Chunk:
        """The encoded header: given, or made once from the filled payload's checksum (filling it
        first if its fill is still pending)."""
        if self.make_head is None:
            return self[0]
        if self.made is None:
            assert self.staged is not None
            self.staged.fill()
            checksum = self.staged.checksum
            assert checksum is not None
            self.made = self.make_head(checksum)
        return self.made

    def plain(self) -> tuple[Chunk, Chunk]:
        """(header, payload), the payload filled first if its fill is still pending."""
        if self.staged is not None:
            self.staged.fill()
        return self.head(), self[1]


class Piecewise(tuple):  # type: ignore[type-arg]
    """Write chunks (header room, payload) of a record that `_write_direct` copies into its
    aligned buffer hashing as it copies (one pass over the payload instead of a hash, then a
    copy), and, with `helpers`, piece by piece while the previous pieces are written there (a
    17 MiB put spent ~2.5 ms of its ~12 ms in that hash and copy on the development VM). The
    header is `head` when known; else `make_head(checksum)` makes it once the copy has hashed
    the whole payload (`head` is then set). Anywhere else (a buffered fallback) `plain()`
    gives the ordinary chunks."""

    make_head: Callable[[int], bytes]
    head: bytes | None
    helpers: Executor | None

    def __new__(cls, payload: Chunk, head: bytes | None, make_head: Callable[[int], bytes],
                helpers: Executor | None) -> Piecewise:
        self = super().__new__(cls, (head if head is not None else bytes(HEADER_SIZE), payload))
        self.head, self.make_head, self.helpers = head, make_head, helpers
        return self

    def plain(self) -> tuple[bytes, Chunk]:
        """(header, payload), hashing the payload now if the header is still to be made."""
        if self.head is None:
            self.head = self.make_head(xxhash.xxh3_64_intdigest(self[1]))
        return self.head, self[1]


WRITE_PIECE_BYTES = 2 << 20  # piecewise writes and deferred fills copy pieces this large (a multiple of ALIGN)
WRITE_PIECES_IN_FLIGHT = 2  # pieces written at once while the next is copied


def _write_piecewise(fd: int, chunks: Piecewise, total: int, padded: int, buffers: IOBuffers) -> None:
    """O_DIRECT write of a `Piecewise` record (its docstring). Each piece is copied (and hashed,
    if the header waits for the checksum) on this thread, then written on a helper thread while
    the next piece is copied. The first block, which holds the header, is written last, once
    every other piece is on the file: a crash leaves a file whose header is a hole (zeros) or
    one whose every byte is written, never one that a header and size check take for whole
    while a piece in its middle is missing (the pieces may land out of order)."""
    payload = memoryview(chunks[1]).cast("B")
    hasher = xxhash.xxh3_64() if chunks.head is None else None
    if chunks.helpers is None:  # one pass, one write
        with buffers.lease(padded) as buf:
            copy_hashing(buf[HEADER_SIZE:total], payload, hasher)
            if hasher is not None:
                chunks.head = chunks.make_head(hasher.intdigest())
            assert chunks.head is not None
            buf[:HEADER_SIZE] = chunks.head
            if padded != total:
                buf[total:padded] = bytes(padded - total)  # a stale tail never reaches the disk
            _write_aligned(fd, buf, padded)
        return
    with buffers.lease(padded) as buf:
        if padded != total:
            buf[total:padded] = bytes(padded - total)  # a stale tail never reaches the disk
        _copy_and_write_pieces(fd, buf, (payload,), total, padded, hasher, chunks.helpers, WRITE_PIECES_IN_FLIGHT)
        if hasher is not None:
            chunks.head = chunks.make_head(hasher.intdigest())
        assert chunks.head is not None
        buf[:HEADER_SIZE] = chunks.head
        _pwrite_all(fd, buf[:ALIGN], 0)


def _copy_and_write_pieces(fd: int, buf: memoryview, payload: Sequence[Chunk], total: int, padded: int,
                           hasher: Any, helpers: Executor, max_in_flight: int) -> None:
    """Copy `payload` (its parts end to end) into `buf` after its HEADER_SIZE bytes of header room, piece by piece
    (`WRITE_PIECE_BYTES`, hashing each into `hasher` right after its copy when one is given),
    each piece written on `helpers` while the next is copied, at most `max_in_flight` writes
    at once. On return every block of the file but the first is written; the caller writes
    the first, which holds the header, last. A failed write raises once none is in flight
    any more (so none still writes from `buf` after this returns or raises)."""
    in_flight: collections.deque[Future[None]] = collections.deque()
    try:
        for lo in range(0, padded, WRITE_PIECE_BYTES):
            hi = min(padded, lo + WRITE_PIECE_BYTES)
            start, stop = max(lo, HEADER_SIZE), min(hi, total)
            if stop > start:
                copy_gathered(buf[start:stop], payload, start - HEADER_SIZE, hasher)
            write_from = max(lo, ALIGN)  # the header's block waits
            if hi > write_from:
                if len(in_flight) >= max_in_flight:
                    in_flight.popleft().result()
                in_flight.append(helpers.submit(_pwrite_all, fd, buf[write_from:hi], write_from))
        while in_flight:
            in_flight.popleft().result()
    finally:
        futures_wait(in_flight)


def _write_direct(fd: int, chunks: Sequence[Chunk], total: int, buffers: IOBuffers) -> None:
    """O_DIRECT write of `chunks` padded to ALIGN, then truncated to `total`.

    Skips the page-cache copy and leaves the cache to the host tier. The chunks are copied
    once, into an aligned buffer of `buffers` (O_DIRECT needs aligned memory), unless they
    are `LaidOut` in one already: then only the header is copied, into its room.
    """
    padded = round_up(total, ALIGN)
    if isinstance(chunks, Piecewise):
        _write_piecewise(fd, chunks, total, padded, buffers)
    elif isinstance(chunks, LaidOut) and len(chunks) == 2 and len(chunks[0]) == HEADER_SIZE \
            and len(chunks.buf) >= padded:
        buf = chunks.buf
        if padded != total:
            buf[total:padded] = bytes(padded - total)  # a stale tail never reaches the disk
        staged = chunks.staged
        if staged is not None and staged.pending and chunks.helpers is not None:
            _write_filling(fd, chunks, buf, total, padded, chunks.helpers)
        else:
            buf[:HEADER_SIZE] = chunks.plain()[0]  # (a pending fill done whole first; the header made from it if it waited)
            _write_aligned(fd, buf, padded)
    else:
        if isinstance(chunks, LaidOut):
            chunks = chunks.plain()  # a pending fill, done whole before the payload is copied
        with buffers.lease(padded) as buf:
            _write_padded(fd, chunks, total, padded, buf)
    if padded != total:
        os.ftruncate(fd, total)


def _write_padded(fd: int, chunks: Sequence[Chunk], total: int, padded: int, buf: memoryview) -> None:
    offset = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        buf[offset: offset + len(view)] = view
        offset += len(view)
    if padded != total:
        buf[total:padded] = bytes(padded - total)  # a stale tail never reaches the disk
    _write_aligned(fd, buf, padded)


def _write_aligned(fd: int, buf: memoryview, padded: int) -> None:
    done = 0
    while done < padded:
        done += os.write(fd, buf[done:padded])




def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _write_filling(fd: int, laid: LaidOut, buf: memoryview, total: int, padded: int, helpers: Executor) -> None:
    """O_DIRECT write of a staged record whose payload is still to be copied in (`defer_fill`):
    piece by piece, each piece copied and hashed on this thread while the previous ones (up to
    WRITE_PIECES_IN_FLIGHT) are written on helper threads, so the copy hides behind the disk.
    (One write in flight until lent memory made the source plain shared memory: 32 MiB deferred
    fills from LMCache's lent buffer took 15.9 against 17.2 ms a write with two in flight, six
    alternations on the development VM.) The first block (the one
    holding the header) is written last, once the checksum of everything copied matched: a
    crash before that leaves a file whose first block is a hole (zeros), never a record that
    looks whole. RecordError on a mismatch (the caller removes the file)."""
    staged = laid.staged
    assert staged is not None and staged._sources is not None
    hasher = xxhash.xxh3_64()
    _copy_and_write_pieces(fd, buf, staged._sources, total, padded, hasher, helpers, WRITE_PIECES_IN_FLIGHT)
    staged._filled(hasher)  # RecordError on a mismatch: nothing readable was written
    buf[:HEADER_SIZE] = laid.head()  # made now if it waited for the checksum the fill took
    _pwrite_all(fd, buf[:ALIGN], 0)


def make_spares(directory: str | Path, names: Sequence[str], sync: bool = True) -> list[str]:
    """Step 0 of the spare protocol: create each empty file (O_CREAT|O_EXCL), then fsync
    `directory` once, so that every name is durable (`sync=False`: the caller fsyncs it once
    after several calls). Returns the paths made; an error (ENOSPC: fewer spares, the tier
    falls back to `write_new`) propagates after what was made is synced and removed."""
    made: list[str] = []
    try:
        for name in names:
            path = f"{directory}/{name}"
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
            made.append(path)
    except BaseException:
        for path in made:
            remove_quietly(path)
        raise
    if sync and made:
        fsync_dir(Path(directory))
    return made


def recycle(path: str | Path, spare: str | Path) -> int:
    """Turn the file of a dropped record into a recycled spare; returns its size.

    Its first block (the header) is zeroed and fdatasynced before the file is renamed into the
    spares directory: a spare holding a whole record is a put to be finished (the scan moves it
    to its record's name), so a dropped record must be invalid before it can be found there,
    or a crash could bring an old version back over a newer one. The spares directory is then
    fsynced: a put may claim the spare only once its name is durable (`write_spare`). A
    recycled spare keeps its data blocks and its size: a put of a record of that size
    overwrites blocks that are allocated and written, which spares the file system (and on a
    thin-provisioned virtual disk, the host) the allocation a new file's write pays (module
    docstring)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        _pwrite_all(fd, memoryview(bytes(min(ALIGN, size))), 0)  # within the file: its size is unchanged
        os.fdatasync(fd)
    finally:
        os.close(fd)
    os.replace(path, spare)
    try:
        fsync_dir(Path(spare).parent)
    except BaseException:
        remove_quietly(spare)  # a name that may not be durable is never claimed
        raise
    return size


# File systems that never overwrite a block in place: writing into a recycled file allocates new
# blocks there as writing a new file does, so recycling would only add its header write and syncs.
COPY_ON_WRITE_FILE_SYSTEMS = frozenset({"btrfs", "zfs", "bcachefs"})


def file_system_type(path: str | Path, mounts: str = "/proc/self/mounts") -> str:
    """The type of the file system `path` lies on (the longest mount point above it in
    `mounts`), or "" where that cannot be read (no /proc: not Linux)."""
    target = os.path.realpath(path)
    best, kind = -1, ""
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) > best:
                    best, kind = len(point), fields[2]
    except OSError:
        return ""
    return kind


def is_recycled_spare(path: str | Path) -> bool:
    """Whether a non-empty spare is a recycled one (`recycle`: its header block is zero)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        head = os.pread(fd, HEADER_SIZE, 0)
    finally:
        os.close(fd)
    return len(head) == HEADER_SIZE and not any(head)


def write_spare(spare: str, final: str, chunks: Sequence[Chunk], *, direct: bool, buffers: IOBuffers,
                uncache: bool = False) -> None:
    """Steps 1-4 of the spare protocol (module docstring): the record is durable once this
    returns. On any error the spare is removed (it may hold part of a record) and the error
    re-raised: the caller sees either a durable record under `final` or nothing. `uncache`:
    a buffered write's pages leave the page cache once durable (`_sync`)."""
    total = sum(len(c) for c in chunks)
    try:
        fd, direct = _open(spare, direct, os.O_WRONLY | os.O_NOFOLLOW)
    except BaseException:
        remove_quietly(spare)
        raise
    _write_or_remove(fd, spare, chunks, total, direct, buffers)
    try:
        if os.fstat(fd).st_size != total:  # a recycled spare of another size within its last block
            os.ftruncate(fd, total)
    except BaseException:
        os.close(fd)
        remove_quietly(spare)
        raise
    _sync_and_rename(fd, spare, final, uncache)


def write_new(final: str | Path, chunks: Sequence[Chunk], *, direct: bool, buffers: IOBuffers,
              dir_sync: Executor | None = None, uncache: bool = False) -> bool:
    """Steps 1-4 of the new-key protocol (module docstring). False, with nothing written,
    if `final` already exists. On any other error the file is removed and the error
    re-raised: the caller sees either a durable record or nothing at all.

    `dir_sync`: run step 4 there, started right after the create, while this thread
    writes and fdatasyncs the data (the directory fsync covers every entry created before
    it starts). On ext4 a directory fsync is a journal commit of its own; overlapped with
    a large write it costs little (4 MiB new files in a plain loop on the dev VM: ~10 ms -> ~7 ms).
    """
    total = sum(len(c) for c in chunks)
    try:
        fd, direct = _create(final, direct)
    except FileExistsError:
        return False
    parent = os.path.dirname(final)
    pending = None
    try:
        try:
            if dir_sync is not None:
                pending = dir_sync.submit(fsync_dir, parent)
            _write(fd, chunks, total, direct, buffers)
            _sync(fd, uncache)
        finally:
            os.close(fd)
        if pending is not None:
            pending.result()
        else:
            fsync_dir(parent)
    except BaseException:
        if pending is not None:
            futures_wait([pending])  # an unacknowledged directory fsync is harmless; let it end
        remove_quietly(final)
        raise
    return True


def write_durable(tmp: str | Path, final: str | Path, chunks: Sequence[Chunk], *, direct: bool,
                  buffers: IOBuffers, uncache: bool = False) -> None:
    """Steps 1-5 of the replace protocol (module docstring). On any error the temp file is
    removed and the error re-raised: the caller sees either a durable record or nothing."""
    total = sum(len(c) for c in chunks)
    fd = _create_and_write(tmp, chunks, total, direct, buffers)
    _sync_and_rename(fd, tmp, final, uncache)
    fsync_dir(os.path.dirname(final))


def _create_and_write(path: str | Path, chunks: Sequence[Chunk], total: int, direct: bool,
                      buffers: IOBuffers) -> int:
    """Create `path` (O_EXCL) and write `chunks`; returns the open fd. FileExistsError comes
    only from the create, with nothing touched; after any later error the file this call
    created is removed before the error propagates."""
    fd, direct = _create(path, direct)
    _write_or_remove(fd, path, chunks, total, direct, buffers)
    return fd


def _write_or_remove(fd: int, path: str | Path, chunks: Sequence[Chunk], total: int, direct: bool,
                     buffers: IOBuffers) -> None:
    """`_write` to `fd` (open on `path`); after any error `fd` is closed and `path` removed
    before the error propagates."""
    try:
        _write(fd, chunks, total, direct, buffers)
    except BaseException:
        os.close(fd)
        remove_quietly(path)
        raise


def _sync(fd: int, uncache: bool) -> None:
    """fdatasync `fd`; `uncache`: then drop its pages from the page cache. For a buffered write
    of a record the tier reads back with O_DIRECT: the tier sits below the host RAM tier, so
    those clean pages would only be a second copy, taking memory from the inference server.
    The record is durable before they are dropped, so a failure to drop them is ignored."""
    os.fdatasync(fd)
    if uncache and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _sync_and_rename(fd: int, path: str | Path, final: str | Path, uncache: bool) -> None:
    """fdatasync (`_sync`) and close `fd` (open on `path`), then rename `path` to `final`: the
    record is durable under its final name (a new name still needs its directory synced). After
    any error `path` is removed before the error propagates: the caller sees the record or nothing."""
    try:
        try:
            _sync(fd, uncache)
        finally:
            os.close(fd)
        os.replace(path, final)
    except BaseException:
        remove_quietly(path)
        raise


def _create(path: str | Path, direct: bool) -> tuple[int, bool]:
    """O_CREAT|O_EXCL, with O_DIRECT where asked and allowed (see `_open`)."""
    return _open(path, direct, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def _open(path: str | Path, direct: bool, flags: int) -> tuple[int, bool]:
    """`flags`, with O_DIRECT where asked and the file system allows it (tmpfs and some
    overlays refuse it: buffered then). Returns the fd and whether it is O_DIRECT."""
    if direct:
        try:
            return os.open(path, flags | os.O_CLOEXEC | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags | os.O_CLOEXEC, 0o644), False


def _write(fd: int, chunks: Sequence[Chunk], total: int, direct: bool, buffers: IOBuffers) -> None:
    """Write every byte of `chunks` to the new, empty file `fd`; if the file system refuses
    O_DIRECT only at write time (EINVAL), drop the flag and start again buffered."""
    if direct:
        try:
            _write_direct(fd, chunks, total, buffers)
            return
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
    # (a pending fill the direct write did not finish is done whole, from the start, by plain())
    _write_all(fd, chunks.plain() if isinstance(chunks, (Piecewise, LaidOut)) else chunks)


def remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_all(paths: Sequence[str | Path]) -> None:
    for path in paths:
        remove_quietly(path)


def open_for_read(path: str | Path, *, direct: bool) -> int:
    """O_DIRECT where asked and the file system allows it, else buffered."""
    if direct:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def read_upto(fd: int, max_bytes: int, buf: memoryview) -> memoryview:
    """Read up to `max_bytes` from the start of `fd` into `buf` (aligned, at least
    `max_bytes` rounded up to ALIGN: from `IOBuffers`); fewer only at end of file. Returns the
    view of `buf` that was filled.

    One preadv of the whole request (rounded up to ALIGN, so it serves O_DIRECT and
    buffered fds alike, into memory that is already mapped: no allocation, no page-fault
    per read); continued only from aligned offsets, as O_DIRECT requires. Callers ask for
    one byte more than they expect, so a file that grew shows as too long, not as whole.
    """
    view = buf[: round_up(max_bytes, ALIGN)]
    return view[: min(read_range(fd, view, 0, len(view)), max_bytes)]


def read_range(fd: int, view: memoryview, lo: int, hi: int) -> int:
    """Bytes read into view[lo:hi] from file offset `lo` (aligned), one preadv of the whole range
    continued only from aligned offsets, as O_DIRECT requires; fewer only at end of file."""
    got = lo
    while got < hi:
        n = os.preadv(fd, [view[got:hi]], got)
        got += n
        if n == 0 or got % ALIGN:
            break
    return got - lo


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
