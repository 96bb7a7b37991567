"""The SSD tier: one file per record, written durably, indexed in memory.

Layout under `root` (two levels of fan-out keep every directory small at millions of
records; the fan-out bytes come from the block-key part of the record key, a uniform hash,
not from its leading kind code, which would put everything under `00/01`)::

    root/
      .lock                        flock: one SSDTier per directory at a time
      quarantine/                  torn/corrupt/foreign files, moved aside with their name
      spares/<tag><n>.spare        files whose names are already durable, for new keys: empty
                                   (the spare pool) or recycled (a deleted record's, header zeroed)
      ab/cd/<68 hex>.rec           record key = 2-byte kind + 32-byte block key ab cd ...
      ab/cd/<68 hex>.rec.<tag>.tmp a put replacing a record; a leftover after a crash, removed at scan

Durability: `put` returns True only once the record is durable (`tiers._fs` has the three
protocols and why). A key the index does not hold claims a spare: the record is written
into it, fdatasynced (acknowledged from here: the spare's name was durable before the
put) and renamed to its final name, with no directory fsync on the put's path (not even
for a directory the put creates: `_make_dir`). The pool
is refilled in the background once puts pause (or it runs low), in batches with one
directory fsync each; when it is empty
(or `spare_files=0`) a new key is written in place under its final name and its directory
fsynced (`write_new`). A key the index holds goes through a temp file, a rename and a
directory fsync (`write_durable`), so an acknowledged version is never torn. An
acknowledged put survives `kill -9` and power loss. This deviates from DESIGN section 4's
"write to temp, fsync, rename" only in when the temp file's name is made durable (before
the put instead of after it: a directory fsync costs a device cache flush, ~1.3-1.9x the
time of a 64-256 KiB put on the development VM); `tiers._fs` says what it relies on.

A crash in the middle of a new key's write can leave a torn spare (or a torn file under
the key's name, on the fallback path), never acknowledged: the scan (size or header check)
or the first `get` (payload checksum) quarantines it, and it is never served. A spare
holding a whole record is a put whose rename did not reach the disk: the scan renames it
to its final name and indexes it. The index (key -> header, file size) lives in memory;
`scan()` rebuilds it from the record headers (headers only; payload checksums are
verified lazily by `get`). Empty spares hold no data blocks; they are not records and count
0 bytes in `usage()` (`spare_files` says how many there are).

Recycled spares: deleting an O_DIRECT-sized record (an eviction, mostly) keeps its file as a
spare for the next new record whose file takes as many blocks (`tiers._fs.recycle`: the
header block is zeroed and fdatasynced first, so a crash never brings the record back). That put overwrites
blocks already allocated and written instead of allocating new ones: 1.3-1.4x faster writes
on the development VM (`tiers._fs`), which is what a full cache, dropping about as many bytes
as it writes, does all day. They count in `usage().reserve_bytes` and against the budget, up
to `recycle_bytes`, and are unlinked first when a put needs their room.

Every disk operation is one call on the tier's own threads (`max_concurrency` of them, `tiers._hop`):
encode + write + syncs for a put, open + read + verify for a get. Each takes an aligned I/O
buffer from the tier's pool (`tiers._fs.IOBuffers`: huge pages from 512 KiB, mapped and faulted
in once, reused by whichever thread runs the next operation). A get of a record from 128 KiB
(`SMALL_LEND_MIN_BYTES`, `LEND_MIN_BYTES`) returns its payload as a read-only view of the buffer
it was read into, which goes back to the pool when the caller drops the payload, instead of
copying it out; a put of 8 MiB or more copies the payload into its buffer piece by piece while
the previous pieces are written (`PIECEWISE_MIN_BYTES`).

Two hand-offs let a large record skip a copy of its own. `staging` lends a pool buffer laid out
as the record's file (header room, payload): a caller that assembles a record there gets it
written with O_DIRECT as it lies, and may even leave the copy into it to the write, which then
copies piece by piece while writing the previous piece and verifies the checksum before the
record becomes visible (`tiers._fs.Staged.defer_fill`). `reading_into` names where a get should
also deliver a payload: the read goes in pieces, each copied there on a helper thread while the
next ones are read (from the event loop with native AIO, a few in flight, where the kernel
allows; else one at a time on a thread).

The tier never evicts. With a budget, `put` refuses (False) a record that would not fit,
writing nothing; the store decides what to delete to make room.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import fcntl
import itertools
import logging
import os
import secrets
import stat
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aiofiles.os
import xxhash

from tiers import _fs, ssd_snapshot
from tiers._aio import DEFAULT_POLL_S, AioReads, Unsupported, WouldBlock
from tiers._hop import Workers
from tiers.base import KindUsage, ScanResult, Tier, TierUsage
from tiers.locks import KeyLocks
from tiers.offload import wait_through_cancel
from tiers.record import (
    HEADER_SIZE,
    RECORD_KEY_BYTES,
    Record,
    RecordError,
    RecordHeader,
    RecordKey,
    copy_scattered,
    decode_header,
    decode_record,
    encode_header,
    encode_record,
    make_record,
)

if TYPE_CHECKING:
    from tiers.registry import TierConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

RECORD_SUFFIX = ".rec"
TEMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"
SPARES_DIR = "spares"
SPARE_SUFFIX = ".spare"
LOCK_FILE = ".lock"
# Records at least this large are written and read with O_DIRECT (aligned buffer): on the
# development machine (ext4 on virtio) one device I/O per record beat buffered I/O from
# 128 KiB up, cold reads most of all (bench/tiers.py).
DEFAULT_DIRECT_IO_MIN_BYTES = 128 << 10
DEFAULT_MAX_CONCURRENCY = 8  # puts/gets in flight for put_many/get_many (journal group commit)
# New records at least this large fsync their directory on a second thread while the data
# is written (`_fs.write_new(dir_sync=...)`): on ext4 that fsync is a journal commit, hidden
# behind a write this long; below it the extra thread handoff cost about what it saved
# (bench/tiers.py, 256 KiB vs 1 and 4 MiB).
OVERLAP_DIR_SYNC_MIN_BYTES = 1 << 20
# A get (or get_many) of a record at least this large returns its payload as a view of the
# pooled (huge-page) buffer it was read into, instead of a copy (`tiers._fs.IOBuffers.lend`);
# the buffer is busy until the caller drops the payload (a batch maps one per record held, as
# a copy would allocate one).
LEND_MIN_BYTES = 1 << 20
# Records from this size whose read buffer is a small one (up to `tiers._fs.SMALL_IO_BUFFER_BYTES`:
# a plain map of the record's size, rounded to 4 KiB) are lent as well: a held payload pins what
# its copy would. Those between (~0.5-1 MiB) are copied: their buffer is a 2 MiB huge page. The
# copy and its allocation were what the machine's two cores could least afford with several
# gets in flight (256 KiB, get_many at queue depth 4, interleaved rounds on the development VM:
# 0.61-0.77 of the O_DIRECT reference copied, 0.83-1.03 lent); below this size the copy is cheap.
SMALL_LEND_MIN_BYTES = 128 << 10
# A get with a delivery target (`SSDTier.reading_into`) of a record at least this large reads
# it in pieces of READ_PIECE_BYTES and copies each piece into the target on a helper thread
# while the next piece is read (on the event loop, READ_WINDOW pieces in flight, where native
# AIO serves; else one at a time on a thread). On the development VM (shared, load ~2.4), 32 MiB records read
# and put into a shm slot, alternating with read-then-copy: 2 MiB pieces 18.0-21.5 ms against
# 19.3-24.1 (1-2.6 ms saved in each of 7 runs); 4 MiB pieces were 1.3-2 ms slower than
# read-then-copy, 8 and 32 MiB even: the copy thread and the reads share 2 busy vCPUs.
DELIVER_MIN_BYTES = 4 << 20
# Records whose file is smaller than this are read on the event loop with native AIO
# (`tiers._aio`: no thread hop) when they are O_DIRECT-sized, uncompressed and their path is in the
# lookup cache; the payload checksum is then taken on the loop too. A lone read in flight is
# polled for (`read_poll_s`), so that a depth-1 get wakes no halted vCPU. Against the same tier
# with every read on threads, same rounds, development VM: 256 KiB get_many at depth 4
# 1.08-1.35x; depth-1 gets 256 KiB 0.80-0.98 of the O_DIRECT reference polled, 0.73-0.94 not,
# 0.73-0.87 on threads; 1 MiB 0.83-0.85 polled, 0.72-0.78 on threads, at depth 4 level. From
# 2 MiB the loop gained nothing (4 MiB: 0.86-0.95 polled, 0.89-0.90 on threads) and would
# hash ~100 us per record on the loop, so those stay on the threads, which hash in parallel
# without the GIL.
LOOP_READ_MAX_FILE_BYTES = 2 << 20
# Free I/O buffers the tier keeps beyond one per thread, for a second (`tiers._fs.IOBuffers`):
# a get_many of large records holds one lent buffer per record until its caller drops the
# payloads, and mapping and faulting them in anew for each batch cost 1 MiB gets at queue
# depth 4 about a third of their speed (32 records: 0.53 of the O_DIRECT reference -> 0.80).
RETAIN_BUFFER_BYTES = 128 << 20
READ_PIECE_BYTES = 2 << 20
# A delivering get on the event loop (`SSDTier._read_into_on_loop`, native AIO) keeps this many
# pieces in flight, each copied into the target on a helper thread as it lands, in order. All
# of a record's pieces at once landed together at the end (the virtio host serves them in
# parallel), leaving nothing for the copies to overlap; one at a time left the disk idle between
# pieces. 32 MiB into /dev/shm, in-process on the development VM: read whole 9.0 ms (no copy);
# pieces one at a time on a thread 11.5; 3 x 2 MiB in flight 9.8 (2 x 2 MiB 10.2, 2 x 4 MiB 10.1,
# all 16 at once 12.0).
READ_WINDOW = 3
# A put of a record at least this large (not staged, written with O_DIRECT) copies its payload
# into the aligned buffer and hashes it piece by piece while the previous pieces are written
# (`tiers._fs.Piecewise`), instead of hashing, copying and then writing it whole; smaller ones
# without a carried checksum are hashed by their copy, one pass, then written whole (4 MiB:
# 4.85 -> 4.58 ms a put, interleaved, distinct payloads; 1 MiB 1.70 -> 1.66 ms). Development
# VM, new keys into spares, interleaved: 17 MiB 11.7 -> 10.8 ms (the write alone 9.8 ms),
# 32 MiB 28 -> 24 ms and 8 MiB 12 -> 8 ms when the disk throttled; 1 and 4 MiB were slower
# in pieces (1.3 -> 1.5 ms, 3.9 -> 4.3 ms): a single write keeps more of the device busy.
PIECEWISE_MIN_BYTES = 8 << 20
SCAN_CHUNK = 16  # first-level directories per scan thread call
# Spare files kept ready for new keys. The pool starts at INITIAL_SPARE_FILES and doubles,
# up to `spare_files`, each time claims bring it down to a quarter (a tier that sees few new
# keys keeps a few spares; a busy one grows until its bursts take at most half). It is
# refilled in the background once half of it is claimed (after the batch, for `put_many`):
# SPARE_CHUNK creates per thread call, one directory fsync per refill.
DEFAULT_SPARE_FILES = 256
INITIAL_SPARE_FILES = 32
SPARE_CHUNK = 32
# A refill waits until no put has run for this long, unless the pool is down to a quarter
# (then at once: an empty pool costs every new key a directory fsync). Its creates and its
# directory fsync are journal commits of their own; run beside a stream of puts they made
# each put's fdatasync wait behind them: 128 256 KiB puts at qd 1 on the dev VM took ~1.3-2x
# as long with the refill in the middle of the stream as with it after.
REFILL_QUIET_S = 0.005
# Disk bytes the tier keeps as recycled spares (files of dropped records, `tiers._fs.recycle`)
# for new records of the same size in blocks, by default (`recycle_bytes`; never more than a quarter
# of a budget). A full cache drops about as many bytes as it writes, so a small reserve
# serves a steady stream; its bytes count against the budget and are given up first when a
# put needs room.
DEFAULT_RECYCLE_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class SSDLayout:
    """Where a record key lives on disk, and the inverse for the scan."""

    root: Path

    @staticmethod
    def fanout(key: bytes) -> tuple[str, str]:
        return f"{key[2]:02x}", f"{key[3]:02x}"

    def path(self, key: bytes) -> Path:
        top, sub = self.fanout(key)
        return self.root / top / sub / (key.hex() + RECORD_SUFFIX)

    def path_str(self, key: bytes) -> str:
        """`path(key)` as a str, built without Path objects (on every get and put)."""
        return f"{self.root}/{key[2]:02x}/{key[3]:02x}/{key.hex()}{RECORD_SUFFIX}"

    @property
    def quarantine_dir(self) -> Path:
        return self.root / QUARANTINE_DIR

    @property
    def spares_dir(self) -> Path:
        return self.root / SPARES_DIR

    @staticmethod
    def key_from_name(name: str) -> RecordKey | None:
        stem = name.removesuffix(RECORD_SUFFIX)
        if stem == name or len(stem) != 2 * RECORD_KEY_BYTES:
            return None
        try:
            return RecordKey(bytes.fromhex(stem))
        except ValueError:
            return None


@dataclass(slots=True)
class _Entry:
    """One index entry: the verified header and the file's size on disk."""

    header: RecordHeader
    file_bytes: int


@dataclass(slots=True)
class _KindTally:
    num_records: int = 0
    payload_bytes: int = 0
    overhead_bytes: int = 0


def estimate_index_entry_bytes() -> int:
    """Python heap bytes one index entry costs, measured on a sample (dict slot included).

    Measured rather than guessed so that `usage()` stays honest across Python versions.
    """
    header = make_record(1, 0, b"", model_fingerprint=b"f" * 16, tenant_id=b"t" * 16,
                         block_key=b"k" * 32, parent_key=b"p" * 32, token_start=1 << 40,
                         token_end=(1 << 40) + 256, entry_count=1 << 20).header
    header = dataclasses.replace(header, raw_length=1 << 33, stored_length=1 << 33)
    entry = _Entry(header, 1 << 33)
    key = header.key
    parts = [entry, header, key, header.model_fingerprint, header.tenant_id, header.block_key,
             header.parent_key, header.created_at_ns, header.raw_length, header.token_start,
             header.token_end, header.entry_count, header.stored_length]
    dict_slot = 3 * 8 * 3 // 2 + 8  # hash, key, value pointers at 2/3 load, plus the index
    return _fs.round_up(sum(sys.getsizeof(p) for p in parts) + dict_slot, 16)


INDEX_ENTRY_BYTES = estimate_index_entry_bytes()


class _ScanGate:
    """Mutations (put/delete/quarantine) share the gate; `scan` takes it alone.

    A scan rebuilds the index from the disk; a put finishing in the middle of it would be
    lost from the new index, and the scan would delete its temp file as a leftover.
    `try_enter`/`leave` are the put's path: plain calls, no context-manager objects, while
    no scan runs (an asynccontextmanager costs a generator and two awaitables per use).
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._scanning = False
        self._notifier: asyncio.Task[None] | None = None
        self.mutations = 0  # mutations begun: tells whether the index is still what a scan built

    def try_enter(self, changes_index: bool = True) -> bool:
        """Enter at once if no scan runs (else False: `await enter()`)."""
        if self._scanning:
            return False
        self.mutations += changes_index
        self._active += 1
        return True

    async def enter(self, changes_index: bool = True) -> None:
        if self._scanning:
            async with self._cond:
                await self._cond.wait_for(lambda: not self._scanning)
        self.mutations += changes_index
        self._active += 1

    def leave(self) -> None:
        self._active -= 1
        if self._scanning and not self._active:  # the scan waiting for the last mutation
            self._notifier = asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def mutation(self, *, changes_index: bool = True) -> AsyncIterator[None]:
        """`changes_index=False`: excludes a scan but leaves the index as a scan built it
        (a spare refill)."""
        await self.enter(changes_index)
        try:
            yield
        finally:
            self.leave()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._scanning)
            self._scanning = True
            await self._cond.wait_for(lambda: self._active == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._scanning = False
                self._cond.notify_all()


@dataclass(slots=True)
class _SparePool:
    """Spare files (paths) whose names are durable, claimed by new keys' puts on the loop."""

    limit: int  # the most spares kept
    target: int = 0  # spares kept now: doubles up to `limit` when claims bring the pool to a quarter
    ready: collections.deque[str] = dataclasses.field(default_factory=collections.deque)
    refilling: bool = False
    ran_low: bool = False  # since the last refill: grow once per time the pool runs low

    def __post_init__(self) -> None:
        self.target = min(self.limit, INITIAL_SPARE_FILES)

    def claim(self) -> str | None:
        spare = self.ready.popleft() if self.ready else None
        if len(self.ready) <= self.target // 4 and not self.ran_low:
            self.ran_low = True
            self.target = min(self.limit, 2 * self.target)
        return spare

    def wants_refill(self) -> bool:
        return self.target > 0 and not self.refilling and len(self.ready) <= self.target // 2

    def running_low(self) -> bool:
        """Down to a quarter: refill now, busy or not."""
        return len(self.ready) <= self.target // 4


@dataclass(slots=True)
class _RecyclePool:
    """Recycled spares (`tiers._fs.recycle`: durable names) by size in file-system blocks,
    claimed on the loop by new keys whose file takes as many blocks (sizes of one kind's records
    differ by a few bytes of metadata: an LMCache chunk's key string)."""

    limit_bytes: int
    block_bytes: int = 4096
    ready: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # block-rounded size -> paths
    held_bytes: int = 0  # block-rounded sizes of every file above, and of those being recycled

    def footprint(self, size: int) -> int:
        return _fs.round_up(size, self.block_bytes)

    def admit(self, size: int) -> bool:
        """Reserve room for one more file of `size` (False: over the limit, unlink it instead)."""
        need = self.footprint(size)
        if self.held_bytes + need > self.limit_bytes:
            return False
        self.held_bytes += need
        return True

    def abandon(self, size: int) -> None:
        """An admitted file that did not become a spare."""
        self.held_bytes -= self.footprint(size)

    def resize(self, admitted: int, actual: int) -> None:
        """An admitted file turned out to be `actual` bytes long, not `admitted`."""
        self.held_bytes += self.footprint(actual) - self.footprint(admitted)

    def claim(self, size: int) -> str | None:
        """A spare for a file of `size` bytes: one that takes as many blocks, or None."""
        rounded = self.footprint(size)
        paths = self.ready.get(rounded)
        if not paths:
            return None
        path = paths.pop()
        if not paths:
            del self.ready[rounded]
        self.held_bytes -= rounded
        return path

    def unclaim(self, path: str, size: int) -> None:
        """A claimed file its put did not use after all."""
        self.held_bytes += self.footprint(size)
        self.promote([(path, size)])

    def promote(self, files: Sequence[tuple[str, int]]) -> None:
        for path, size in files:
            self.ready.setdefault(self.footprint(size), []).append(path)

    def give_up(self, nbytes: int) -> list[str]:
        """Files to unlink so that `nbytes` more fit under a budget, largest first."""
        out: list[str] = []
        for rounded in sorted(self.ready, reverse=True):
            if nbytes <= 0:
                break
            paths = self.ready[rounded]
            while paths and nbytes > 0:
                out.append(paths.pop())
                self.held_bytes -= rounded
                nbytes -= rounded
            if not paths:
                del self.ready[rounded]
        return out


@dataclass(frozen=True, slots=True)
class _ReadResult:
    """What one worker-thread read found: a verified record, or why not."""

    record: Record | None
    inode: int = -1  # of the file read; -1 when none was read
    problem: str = ""  # why the bytes are not a valid record (-> quarantine)
    missing: bool = False  # the file is gone (-> drop from the index)
    error: OSError | None = None  # the read itself failed (-> a miss, file left alone)


_GetJob = tuple[int, str, RecordKey, "_Entry"]  # get_many: (index in the keys, path, key, index entry)


def _read_records(jobs: Sequence[tuple[str, RecordKey, int, bool, bool]], buffers: _fs.IOBuffers) -> list[_ReadResult]:
    """Worker thread: `_read_record` for each (path, key, file size, direct, lend); never raises per file."""
    return [_read_record(path, key, file_bytes, direct, lend, buffers) for path, key, file_bytes, direct, lend in jobs]


def _open_record(path: str, direct: bool) -> int | _ReadResult:
    """A record file's fd, or the `_ReadResult` of a file that is gone or cannot be opened."""
    try:
        return _fs.open_for_read(path, direct=direct)
    except FileNotFoundError:
        return _ReadResult(None, missing=True)
    except OSError as exc:
        return _ReadResult(None, error=exc)


def _read_record(path: str, key: RecordKey, file_bytes: int, direct: bool, lend: bool,
                 buffers: _fs.IOBuffers) -> _ReadResult:
    """One open, one read of the indexed size (+1 byte: a grown file shows as too long)
    into an aligned buffer of `buffers`, verified there. The payload is copied out, or with
    `lend` is a read-only view of the buffer, which goes back to the pool once the caller
    drops the payload (`IOBuffers.lend`). The inode is looked up only for a bad file, so that
    the caller quarantines exactly the file it read."""
    fd = _open_record(path, direct)
    if isinstance(fd, _ReadResult):
        return fd
    try:
        if lend:
            return _read_verified(fd, key, file_bytes, buffers.lend(_fs.round_up(file_bytes + 1, _fs.ALIGN)), True)
        with buffers.lease(_fs.round_up(file_bytes + 1, _fs.ALIGN)) as buf:
            return _read_verified(fd, key, file_bytes, buf, False)
    finally:
        os.close(fd)


def _read_verified(fd: int, key: RecordKey, file_bytes: int, buf: memoryview, keep_view: bool) -> _ReadResult:
    """Read `fd` into `buf` and verify it there; `keep_view`: the payload is a view of `buf`."""
    try:
        data = _fs.read_upto(fd, file_bytes + 1, buf)
    except OSError as exc:
        return _ReadResult(None, error=exc)
    return _decoded(fd, key, data, keep_view)


def _decoded(fd: int, key: RecordKey, data: memoryview, keep_view: bool) -> _ReadResult:
    """The record in `data` (read from `fd`), verified; a bad one names the inode read, so that
    the caller quarantines exactly that file."""
    try:
        return _ReadResult(decode_record(data, expect_key=key, keep_view=keep_view))
    except RecordError as exc:
        return _ReadResult(None, os.fstat(fd).st_ino, str(exc))


def _open_on_loop(aio: AioReads, path: str) -> int | _ReadResult | None:
    """A record file opened for a read on the loop (O_DIRECT), the `_ReadResult` of one that is
    gone or cannot be opened, or None where the open would wait (the caller reads on a thread)."""
    try:
        return aio.open_cached(path)
    except WouldBlock:
        return None
    except FileNotFoundError:
        return _ReadResult(None, missing=True)
    except OSError as exc:
        return _ReadResult(None, error=exc)


@dataclass(frozen=True, slots=True)
class _PieceRead:
    """One piece of a delivering read on the loop: a native AIO read (`aio`), or, where that
    would have waited, a read on a helper thread (`thread`)."""

    lo: int
    hi: int
    aio: asyncio.Future[int] | None = None
    thread: Future[int] | None = None

    def result(self) -> Awaitable[int]:
        return self.aio if self.aio is not None else asyncio.wrap_future(self.thread)  # type: ignore[arg-type]

    def when_landed(self, aio: AioReads, fn: Callable[[], None]) -> None:
        """`fn` once the read is over (not merely once nobody waits for it any more)."""
        if self.aio is not None:
            aio.after(self.aio, fn)
        else:
            self.thread.add_done_callback(lambda _: fn())  # type: ignore[union-attr]


async def _settle_loop_reads(aio: AioReads, reads: Sequence[_PieceRead], copying: Future[None] | None,
                             fd: int) -> None:
    """After a delivering read on the loop, however it ended: the fd is closed once every read in
    flight has landed, and the copy in flight, which writes into the caller's target, is waited
    for (even through a cancellation, which is raised again afterwards). `copying` is the
    helper thread's own future: an asyncio future awaiting it is cancelled along with the task
    that awaits it (then done, while the thread still copies into the target)."""
    left = len(reads)
    lock = threading.Lock()  # (a thread's read lands on that thread)

    def landed() -> None:
        nonlocal left
        with lock:
            left -= 1
            last = left == 0
        if last:
            os.close(fd)
    if not reads:
        os.close(fd)
    for piece in reads:
        piece.when_landed(aio, landed)
    if copying is not None and not copying.done():
        with contextlib.suppress(Exception):  # its failure is the caller's to report, not the clean-up's
            await wait_through_cancel(asyncio.wrap_future(copying))


@dataclass(slots=True)
class ReadTarget:
    """Where a get of `key` delivers the payload as it reads it (`SSDTier.reading_into`).

    `filled` turns True only when the get read the record from the disk, its header matched
    (key, `expect_tenant`, uncompressed, `len(dest)` payload bytes) and its payload checksum
    verified over exactly the bytes copied into `dest`; else `dest` may hold anything of that
    record (never another tenant's bytes: the header is checked before the first copy).
    `dests`: the payload's destination, as one buffer or several laid end to end (a client's
    slot for the first bytes, memory it lent for the rest)."""

    key: RecordKey
    dests: tuple[memoryview, ...]
    expect_tenant: bytes | None
    filled: bool = False

    @property
    def size(self) -> int:
        return sum(len(d) for d in self.dests)


def _read_record_into(path: str, key: RecordKey, file_bytes: int, direct: bool, buffers: _fs.IOBuffers,
                      target: ReadTarget, helpers: ThreadPoolExecutor) -> _ReadResult:
    """`_read_record` (lending the buffer) that also delivers the payload into `target`: the file
    is read in pieces, and each piece is copied into `target.dest` and hashed on a helper thread
    while the next one is read. Anything unusual (a header that does not match, a short or long
    file, a checksum mismatch) leaves the target unfilled and ends as `_read_verified` ends."""
    fd = _open_record(path, direct)
    if isinstance(fd, _ReadResult):
        return fd
    try:
        buf = buffers.lend(_fs.round_up(file_bytes + 1, _fs.ALIGN))
        try:
            view, checksum = _read_delivering(fd, file_bytes, buf, target, helpers)
        except OSError as exc:
            return _ReadResult(None, error=exc)
        if target.filled:
            header, _ = decode_header(view[:HEADER_SIZE])
            return _ReadResult(Record(header, view[HEADER_SIZE:].toreadonly(), checksum))
        return _decoded(fd, key, view, True)
    finally:
        os.close(fd)


def _read_delivering(fd: int, file_bytes: int, buf: memoryview, target: ReadTarget,
                     helpers: ThreadPoolExecutor) -> tuple[memoryview, int]:
    """Read up to `file_bytes + 1` bytes into `buf` in pieces (aligned offsets, as O_DIRECT
    wants), delivering each into the target once the first showed a matching header; returns
    the bytes read and the header's payload checksum. Sets `target.filled` when the whole
    payload was delivered and its hash is the header's."""
    want = file_bytes + 1
    view = buf[: _fs.round_up(want, _fs.ALIGN)]
    delivery = _Delivery(target, file_bytes)
    pending: Future[None] | None = None
    got = 0
    try:
        for lo in range(0, len(view), READ_PIECE_BYTES):
            hi = min(len(view), lo + READ_PIECE_BYTES)
            got = lo + _fs.read_range(fd, view, lo, hi)
            if lo == 0:
                delivery.first(view[:got])
            span = delivery.span(lo, got)
            if span is not None:
                if pending is not None:
                    pending.result()
                pending = helpers.submit(delivery.copy, view, *span)
            if got < hi:
                break
    finally:
        if pending is not None:
            pending.result()
    delivery.finish(got)
    return view[: min(got, want)], delivery.checksum


class _Delivery:
    """What both delivering reads (`_read_delivering` on a thread, `SSDTier._read_into_on_loop`
    on the event loop) decide alike: whether the record's header, seen in the first piece,
    allows delivering it into the target; which bytes of each piece go there, hashed as they are
    copied; and whether the whole payload arrived with the header's checksum (`finish`)."""

    __slots__ = ("target", "file_bytes", "checksum", "hasher")

    def __init__(self, target: ReadTarget, file_bytes: int) -> None:
        self.target, self.file_bytes = target, file_bytes
        self.checksum = 0
        self.hasher: Any = None  # set once the header allows delivering

    def first(self, head: memoryview) -> None:
        checksum = _delivery_header(head, self.file_bytes, self.target)
        if checksum is not None:
            self.checksum, self.hasher = checksum, xxhash.xxh3_64()

    def span(self, lo: int, got: int) -> tuple[int, int] | None:
        """The file bytes [start, stop) of the piece read from `lo` up to `got` that go into the
        target, or None (nothing of it, or no delivery)."""
        start, stop = max(lo, HEADER_SIZE), min(got, self.file_bytes)
        return (start, stop) if self.hasher is not None and stop > start else None

    def copy(self, view: memoryview, start: int, stop: int) -> None:
        """Copy file bytes [start, stop) of `view` into the target, hashing them (in order)."""
        copy_scattered(self.target.dests, start - HEADER_SIZE, view[start:stop], self.hasher)

    def finish(self, got: int) -> None:
        if self.hasher is not None and got == self.file_bytes and self.hasher.intdigest() == self.checksum:
            self.target.filled = True


def _delivery_header(head: memoryview, file_bytes: int, target: ReadTarget) -> int | None:
    """The payload checksum when the record's header allows delivering it into `target`, else None."""
    try:
        header, checksum = decode_header(head[:HEADER_SIZE])
    except RecordError:
        return None
    if header.key != target.key or header.flags or HEADER_SIZE + header.stored_length != file_bytes \
            or target.size != header.stored_length \
            or (target.expect_tenant is not None and header.tenant_id != target.expect_tenant):
        return None
    return checksum


@dataclass(slots=True)
class _DirScan:
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


def _write_snapshot(root: Path, entries: list[tuple[RecordHeader, int]], touched: set[ssd_snapshot.Leaf],
                    opened: dict[ssd_snapshot.Leaf, ssd_snapshot.LeafStamp],
                    buffers: _fs.IOBuffers) -> tuple[int, int, int]:
    """Worker thread: the snapshot of the leaves it may vouch for (`ssd_snapshot.vouched`);
    returns (leaves vouched for, leaves left out, bytes written)."""
    now = ssd_snapshot.leaf_stamps(root)
    stamps, vouched = ssd_snapshot.vouched(root, now, entries, touched, opened, RECORD_SUFFIX)
    return len(stamps), len(now) - len(stamps), ssd_snapshot.write(root, stamps, vouched, buffers)


def _list_root(root: Path) -> tuple[list[str], list[str]]:
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
class _SpareScan:
    ready: list[str] = dataclasses.field(default_factory=list)  # empty spares (paths)
    recycled: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (path, size)
    recovered: list[str] = dataclasses.field(default_factory=list)  # records moved to their names
    discarded: list[str] = dataclasses.field(default_factory=list)


def _scan_spares(layout: SSDLayout) -> _SpareScan:
    """Worker thread, before the fan-out walk: an empty spare is a spare, one whose header
    block is zero a recycled spare; one holding a whole record (header, size and payload
    checksum) is an acknowledged (or finished) put whose rename did not reach the disk,
    renamed to its final name now; anything else is torn (quarantined). Ends with one fsync of the spares directory, so the
    names of the spares it hands back are durable."""
    out = _SpareScan()
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


def _scan_spare(layout: SSDLayout, path: Path, out: _SpareScan, moved_into: set[Path]) -> str:
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


def _scan_top_dirs(layout: SSDLayout, tops: Sequence[str]) -> _DirScan:
    """Worker thread: classify every file under root/<top>/<sub>/, clean up as it goes."""
    out = _DirScan()
    for top in tops:
        with os.scandir(layout.root / top) as subs:
            for sub in subs:
                if sub.is_dir(follow_symlinks=False) and len(sub.name) == 2:
                    _scan_leaf(layout, top, sub.name, out)
                else:
                    out.discarded.append(f"{top}/{sub.name}: unexpected entry (left alone)")
    return out


def _scan_leaves(layout: SSDLayout, leaves: Sequence[ssd_snapshot.Leaf]) -> _DirScan:
    """Worker thread: `_scan_leaf` of each of these leaves (those an index snapshot does not cover)."""
    out = _DirScan()
    for top, sub in leaves:
        _scan_leaf(layout, f"{top:02x}", f"{sub:02x}", out)
    return out


def _scan_leaf(layout: SSDLayout, top: str, sub: str, out: _DirScan) -> None:
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


def _scan_file(dir_fd: int, name: str, fanout: tuple[int, int], out: _DirScan) -> str:
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


def _set_aside(layout: SSDLayout, top: str, sub: str, name: str, problem: str, out: _DirScan) -> None:
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


class SSDTier(Tier):
    """Records as files under `root`, durable on put, verified on get.

    Args:
        root: the tier's directory (created if missing); one SSDTier owns it at a time.
        budget_bytes: 0 = unbounded; else `put` refuses what would exceed it.
        zstd_kinds: kind code -> zstd level for the kinds worth compressing. Empty by
            default: FP4 KV payloads measure ~1.00x under zstd (bench/tiers.py), so the
            tier would only pay CPU for nothing.
        direct_io_min_bytes: records this large or larger are written and read with
            O_DIRECT (None: never). The SSD tier sits below the host RAM tier, so the page
            cache would only hold a second copy; one device I/O per record also beats
            buffered readahead windows on cold reads (bench/tiers.py).
        max_concurrency: puts/gets in flight in `put_many`/`get_many`, and the number of
            threads of the tier's own pool that runs every disk operation.
        spare_files: spares kept ready for new keys (0: none; every new key then pays a
            directory fsync, `_fs.write_new`).
        recycle_bytes: disk bytes kept as recycled spares, the files of deleted records for
            new records of as many blocks (`tiers._fs.recycle`; 0: none, deleted files are
            unlinked). None: DEFAULT_RECYCLE_BYTES, at most a quarter of the budget, and 0 on
            a copy-on-write file system (btrfs, ZFS, bcachefs: an overwrite allocates new
            blocks there anyway). Only O_DIRECT-sized records are recycled; the bytes count
            against the budget and are unlinked first when a put needs the room.
        loop_reads: read O_DIRECT-sized records below LOOP_READ_MAX_FILE_BYTES on the event
            loop with native AIO where the kernel allows it (`tiers._aio`); False: every read
            takes a worker thread.
        read_poll_s: while a loop read is the only one in flight, the loop looks for its
            completion between its other work instead of sleeping until the eventfd wakes it,
            for up to this long (`tiers._aio.AioReads`): a core busy meanwhile, for a read that
            lands without a halted vCPU to wake. 0: never poll.
        index_snapshot: a clean close saves the index and the next open reads it back, scanning
            only the leaf directories changed since (`tiers.ssd_snapshot`); False: every open
            reads every record's header.

    Call `await open()` (or use `await SSDTier.create(...)`) before use: it locks the
    directory and scans it (or reads the snapshot of the last clean close).
    """

    name = "ssd"

    def __init__(self, root: Path | str, budget_bytes: int = 0, zstd_kinds: dict[int, int] | None = None,
                 *, direct_io_min_bytes: int | None = DEFAULT_DIRECT_IO_MIN_BYTES,
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY, spare_files: int = DEFAULT_SPARE_FILES,
                 recycle_bytes: int | None = None, loop_reads: bool = True,
                 read_poll_s: float = DEFAULT_POLL_S, index_snapshot: bool = True) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if spare_files < 0:
            raise ValueError(f"spare_files must be >= 0, got {spare_files}")
        if recycle_bytes is not None and recycle_bytes < 0:
            raise ValueError(f"recycle_bytes must be >= 0, got {recycle_bytes}")
        if not 0 <= read_poll_s <= 1:
            raise ValueError(f"read_poll_s must be within [0, 1] seconds, got {read_poll_s}")
        self._recycle_auto = recycle_bytes is None  # decided in open(), once the file system is known
        if recycle_bytes is None:
            recycle_bytes = min(DEFAULT_RECYCLE_BYTES, budget_bytes // 4) if budget_bytes else DEFAULT_RECYCLE_BYTES
        self._layout = SSDLayout(Path(root))
        self._budget_bytes = budget_bytes
        self._zstd_kinds = dict(zstd_kinds or {})
        self._direct_io_min_bytes = direct_io_min_bytes
        self._max_concurrency = max_concurrency
        self._buffers = _fs.IOBuffers(max_concurrency, RETAIN_BUFFER_BYTES)  # aligned I/O buffers (lent ones too)
        self._staged: dict[int, _fs.Staged] = {}  # id(payload) -> records staged for a put (`staging`)
        self._targets: dict[RecordKey, ReadTarget] = {}  # key -> where a get delivers it (`reading_into`)
        self._index: dict[RecordKey, _Entry] = {}
        self._tally: dict[int, _KindTally] = {}
        self._resident_bytes = 0
        self._reserved_bytes = 0
        self._block_bytes = 4096
        # (top, sub) -> whether that leaf directory is durable in its top (False: made for spare
        # puts only, `_make_dir`); absent: not made by this tier or seen by its scan
        self._dirs: dict[tuple[str, str], bool] = {}
        self._tmp_tag = f"{os.getpid():x}{secrets.token_hex(3)}"
        self._tmp_seq = itertools.count()
        self._spares = _SparePool(spare_files)
        self._recycled = _RecyclePool(recycle_bytes)
        self._spare_seq = itertools.count()
        self._refill_task: asyncio.Task[None] | None = None
        self._puts_in_flight = 0  # put/put_many calls running (a refill waits for none, `_wait_quiet`)
        self._last_put_s = 0.0  # loop.time() when the last one ended
        self._closing = False
        self._gate = _ScanGate()
        self._locks = KeyLocks()
        self._lock_fd: int | None = None
        self._workers: Workers | None = None
        self._helpers: ThreadPoolExecutor | None = None  # directory fsyncs, spare refills, get deliveries
        self._loop_reads = loop_reads
        self._read_poll_s = read_poll_s
        self._aio: AioReads | None = None  # reads on the event loop (`tiers._aio`), where available
        self.last_scan: ScanResult | None = None
        self._scan_mark: int | None = None  # gate.mutations when open()'s scan finished; None once reported
        self.snapshot_use: SnapshotUse | None = None  # what the last scan took from an index snapshot
        self._index_snapshot = index_snapshot
        self._opened_stamps: dict[ssd_snapshot.Leaf, ssd_snapshot.LeafStamp] | None = None  # leaves after the last scan
        self._touched: set[ssd_snapshot.Leaf] = set()  # leaves whose records changed since the last scan

    # ----- life cycle -------------------------------------------------------------------

    @classmethod
    async def create(cls, root: Path | str, budget_bytes: int = 0,
                     zstd_kinds: dict[int, int] | None = None, **kwargs: object) -> SSDTier:
        tier = cls(root, budget_bytes, zstd_kinds, **kwargs)  # type: ignore[arg-type]
        await tier.open()
        return tier

    @classmethod
    def from_config(cls, config: TierConfig) -> SSDTier:
        if config.path is None:
            raise ValueError(f"tier {config.name!r}: the ssd tier needs a path")
        return cls(config.path, config.budget_bytes, config.zstd_kinds, **config.options)

    async def open(self) -> ScanResult:
        """Lock the directory and rebuild the index from it. Returns what the scan found."""
        if self._workers is None:
            self._workers = Workers(self._max_concurrency, "ssd-tier")
            self._helpers = ThreadPoolExecutor(self._max_concurrency, thread_name_prefix="ssd-tier-helper")
        if self._aio is None and self._loop_reads and self._direct_io_min_bytes is not None:
            self._aio = AioReads.create(poll_s=self._read_poll_s, busy=self._threads_busy)
        if self._lock_fd is None:
            self._lock_fd = await self._run(self._prepare_root)
        self.last_scan = await self.scan(snapshot=True)
        self._closing = False
        self._start_refill()  # in the background: new keys fsync their directory until it is done
        self._scan_mark = self._gate.mutations
        return self.last_scan

    def _threads_busy(self) -> bool:
        """Work of this tier is on its threads (a put's pieces may be on the helpers too): the
        loop's reads then wait for the eventfd rather than poll (`tiers._aio`)."""
        return self._puts_in_flight > 0 or (self._workers is not None and self._workers.in_flight > 0)

    def _run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """One thread hop on the tier's own threads (`tiers._hop`: leaner than run_in_executor)."""
        if self._workers is None:
            raise RuntimeError("SSDTier is closed")
        return self._workers.run(fn, *args)

    def _prepare_root(self) -> int:
        """Worker thread: create the root, take its lock, create the first fan-out level."""
        root = self._layout.root
        if not root.is_dir():
            root.mkdir(parents=True)
            _fs.fsync_dir(root.parent)
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"{root} is in use by another SSDTier (flock on {root / LOCK_FILE}); "
                               "close it first or give this tier its own directory") from None
        self._layout.quarantine_dir.mkdir(exist_ok=True)
        # The 256 first-level directories up front (1 MiB of directory blocks, one fsync):
        # a put then creates (and fsyncs into its parent) at most its second-level directory.
        created = False
        for top in range(256):
            try:
                os.mkdir(root / f"{top:02x}")
                created = True
            except FileExistsError:
                pass
        if created:
            _fs.fsync_dir(root)
        self._block_bytes = os.stat(root).st_blksize or 4096
        self._recycled.block_bytes = self._block_bytes
        if self._recycle_auto and _fs.file_system_type(root) in _fs.COPY_ON_WRITE_FILE_SYSTEMS:
            self._recycled.limit_bytes = 0
        return fd

    async def aclose(self) -> None:
        self._closing = True  # a refill in flight stops after its current chunk
        if self._refill_task is not None:
            with contextlib.suppress(Exception):
                await self._refill_task  # not left running unowned
            self._refill_task = None
        if self._lock_fd is not None and self._workers is not None:
            await self._save_index()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock; closing an fd does not block
            self._lock_fd = None
        if self._workers is not None:
            self._workers.shutdown()  # operations still queued finish on their own
            self._workers = None
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)
            self._helpers = None
        if self._aio is not None:
            self._aio.close()  # once the reads in flight have landed
            self._aio = None

    async def _save_index(self) -> None:
        """At a clean close, with no put or delete in flight: the index as an `ssd_snapshot`,
        which the next open reads instead of every header. A failure only costs that open a
        full scan."""
        if not self._index_snapshot or self._opened_stamps is None:
            return
        async with self._gate.exclusive():
            entries = [(entry.header, entry.file_bytes) for entry in self._index.values()]
            try:
                kept, left_out, nbytes = await self._run(_write_snapshot, self._layout.root, entries,
                                                         self._touched, self._opened_stamps, self._buffers)
            except OSError as exc:
                logger.warning("ssd tier %s: index snapshot not written (%s): the next open scans every record",
                               self._layout.root, exc)
                return
        logger.info("ssd tier %s: index saved for the next open: %d leaf directories (%d left to its scan), "
                    "%d bytes", self._layout.root, kept, left_out, nbytes)

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise RuntimeError("SSDTier is not open: await tier.open() (or SSDTier.create) first")

    # ----- spare pool -------------------------------------------------------------------

    @property
    def spare_files(self) -> int:
        """Spares ready for new keys (empty files: no data blocks, 0 bytes in `usage()`)."""
        return len(self._spares.ready)

    def _claim_spare(self, refill: bool = True) -> str | None:
        """A spare for a new key's put (None: the pool is empty; the put falls back to
        `write_new`); starts a background refill once half the pool is claimed (`refill=False`:
        the caller starts it after its batch, so that the refill does not compete with it)."""
        spare = self._spares.claim()
        if refill:
            self._start_refill()
        return spare

    def _start_refill(self) -> None:
        if self._spares.wants_refill() and not self._closing:
            self._spares.refilling = True
            self._refill_task = asyncio.get_running_loop().create_task(self._refill())

    async def _wait_quiet(self) -> None:
        """Until no put has run for REFILL_QUIET_S, the pool runs low, or the tier closes."""
        loop = asyncio.get_running_loop()
        while not self._closing and not self._spares.running_low():
            idle_s = loop.time() - self._last_put_s
            if not self._puts_in_flight and idle_s >= REFILL_QUIET_S:
                return
            await asyncio.sleep(REFILL_QUIET_S if self._puts_in_flight else REFILL_QUIET_S - idle_s)

    @contextlib.contextmanager
    def _putting(self) -> Iterator[None]:
        """Marks a put/put_many in flight, for `_wait_quiet`."""
        self._puts_in_flight += 1
        try:
            yield
        finally:
            self._puts_in_flight -= 1
            self._last_put_s = asyncio.get_running_loop().time()

    async def _refill(self) -> None:
        """Top the pool up to its target once puts pause (`_wait_quiet`): creates in chunks,
        then one directory fsync, on the second thread pool (not behind the puts queued on
        the first). A scan waits for it."""
        pool, loop = self._spares, asyncio.get_running_loop()
        pool.refilling = True
        made: list[str] = []
        try:
            await self._wait_quiet()
            async with self._gate.mutation(changes_index=False):
                missing = pool.target - len(pool.ready)
                try:
                    while len(made) < missing and not self._closing and self._helpers is not None:
                        names = [f"{self._tmp_tag}{next(self._spare_seq):x}{SPARE_SUFFIX}"
                                 for _ in range(min(SPARE_CHUNK, missing - len(made)))]
                        made += await loop.run_in_executor(self._helpers, _fs.make_spares,
                                                           str(self._layout.spares_dir), names, False)
                except OSError as exc:
                    logger.warning("ssd spare files not made (%s): new keys fsync their directory until "
                                   "there are", exc)
                if made and self._helpers is not None:  # closing: made but unsynced, the next scan takes them
                    await loop.run_in_executor(self._helpers, _fs.fsync_dir, self._layout.spares_dir)
                    pool.ready.extend(made)  # durable names from here on
                    pool.ran_low = False
        except OSError as exc:
            logger.warning("ssd spare directory not synced (%s): its new spares are not used", exc)
        finally:
            pool.refilling = False

    # ----- accounting -------------------------------------------------------------------

    def _footprint_of(self, file_bytes: int) -> int:
        return _fs.round_up(file_bytes, self._block_bytes) + INDEX_ENTRY_BYTES

    def _file_bytes(self, record: Record) -> int:
        level = self._zstd_kinds.get(record.header.kind)
        if level is None:
            return HEADER_SIZE + len(record.payload)
        return len(encode_record(record, zstd_level=level))

    def scanned_footprint(self, header: RecordHeader) -> int:
        """Exact: a record's file is its header plus its stored payload (the scan checks)."""
        return self._footprint_of(HEADER_SIZE + header.stored_length)

    def footprint(self, record: Record) -> int:
        """Block-rounded file size plus one index entry. For a zstd kind this compresses the
        payload to learn the size (costly; no kind is compressed by default)."""
        return self._footprint_of(self._file_bytes(record))

    def _rebuild_index(self, entries: Iterable[tuple[RecordKey, RecordHeader, int]]) -> None:
        """The index, its tallies and its directories from a scan's (key, header, file bytes),
        in one pass: `_index_add` per entry costs ~5 us of bookkeeping, seconds at a million
        records, on the loop, at start-up."""
        index = self._index = {key: _Entry(header, size) for key, header, size in entries}
        block, extra, header_bytes = self._block_bytes, INDEX_ENTRY_BYTES, HEADER_SIZE
        sums: dict[int, list[int]] = {}
        leaves: set[ssd_snapshot.Leaf] = set()
        for key, entry in index.items():
            size = entry.file_bytes
            kind_sums = sums.get(entry.header.kind)
            if kind_sums is None:
                kind_sums = sums[entry.header.kind] = [0, 0, 0]
            kind_sums[0] += 1
            kind_sums[1] += size - header_bytes
            kind_sums[2] += -(-size // block) * block + extra - (size - header_bytes)
            leaves.add(ssd_snapshot.leaf_of(key))
        self._tally = {kind: _KindTally(n, payload, overhead) for kind, (n, payload, overhead) in sums.items()}
        self._resident_bytes = sum(t.payload_bytes + t.overhead_bytes for t in self._tally.values())
        self._dirs.update(((f"{top:02x}", f"{sub:02x}"), True) for top, sub in leaves)

    def _index_add(self, key: RecordKey, entry: _Entry) -> None:
        self._index_remove(key)
        self._index[key] = entry
        self._count(entry, +1)
        self._touched.add(ssd_snapshot.leaf_of(key))

    def _index_remove(self, key: RecordKey) -> _Entry | None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._count(entry, -1)
            self._touched.add(ssd_snapshot.leaf_of(key))
        return entry

    def _count(self, entry: _Entry, sign: int) -> None:
        tally = self._tally.setdefault(entry.header.kind, _KindTally())
        footprint = self._footprint_of(entry.file_bytes)
        payload = entry.file_bytes - HEADER_SIZE
        tally.num_records += sign
        tally.payload_bytes += sign * payload
        tally.overhead_bytes += sign * (footprint - payload)
        self._resident_bytes += sign * footprint
        if not tally.num_records:
            del self._tally[entry.header.kind]

    def usage(self) -> TierUsage:
        by_kind = {kind: KindUsage(t.num_records, t.payload_bytes, t.overhead_bytes)
                   for kind, t in self._tally.items()}
        return TierUsage(self.name, self._budget_bytes, by_kind, healthy=True,
                         reserve_bytes=self._recycled.held_bytes)

    def _try_reserve(self, need: int, old: _Entry | None) -> bool:
        """Check/act pair with `_release`: hold `need` bytes of budget while a put is in flight.
        Recycled spares count against the budget; as many as it takes are unlinked to make
        room before a put is refused."""
        if self._budget_bytes:
            freed = self._footprint_of(old.file_bytes) if old is not None else 0
            excess = (self._resident_bytes - freed + self._reserved_bytes + self._recycled.held_bytes
                      + need - self._budget_bytes)
            if excess > 0:
                self._unlink_recycled(self._recycled.give_up(excess))
                if self._resident_bytes - freed + self._reserved_bytes + self._recycled.held_bytes \
                        + need > self._budget_bytes:
                    return False
        self._reserved_bytes += need
        return True

    def _reserve_put(self, key: RecordKey, new_key: bool, file_bytes: int, need: int, *,
                     refill: bool = True) -> tuple[bool, str | None]:
        """Reserve the budget for a put (`_try_reserve`) and pick a new key's spare: a recycled
        file as large in blocks (its bytes become the record's: claimed before the budget is
        checked), else an empty one. (False, None): it does not fit, nothing is claimed."""
        reuse = self._recycled.claim(file_bytes) if new_key else None
        if not self._try_reserve(need, self._index.get(key)):
            if reuse is not None:
                self._recycled.unclaim(reuse, file_bytes)
            logger.debug("ssd put refused: %d bytes do not fit the budget of %d", need, self._budget_bytes)
            return False, None
        return True, reuse if reuse is not None else self._claim_spare(refill) if new_key else None

    def _unlink_recycled(self, paths: Sequence[str]) -> None:
        """In the background: the budget no longer counts them, and a crash before the
        unlinks only leaves recycled spares, which the next scan trims to the limit."""
        if paths and self._helpers is not None:
            self._helpers.submit(_fs.remove_all, paths)

    def _release(self, need: int) -> None:
        self._reserved_bytes -= need

    # ----- operations -------------------------------------------------------------------

    async def put(self, record: Record) -> bool:
        self._check_open()
        key, gate, locks = record.key, self._gate, self._locks
        if not gate.try_enter():
            await gate.enter()  # a cancellation here leaves nothing entered or counted
        self._puts_in_flight += 1
        try:
            if not locks.try_acquire(key):
                await locks.acquire(key)
            try:
                return await self._put_locked(key, record)
            finally:
                locks.release(key)
        finally:
            gate.leave()
            self._puts_in_flight -= 1
            self._last_put_s = asyncio.get_running_loop().time()

    @contextlib.contextmanager
    def staging(self, payload_bytes: int) -> Iterator[_fs.Staged]:
        """An aligned buffer to assemble a record's payload in (`tiers._fs.Staged`: fill
        `dest`, build the Record on `payload`) before it is put: while the context is open a
        put of that record writes the buffer as it lies, with no copy of the payload. Any
        other use of the record (another tier, a later read) sees an ordinary read-only view;
        the buffer returns to the tier's pool once the last view of it is dropped."""
        staged = _fs.Staged(self._buffers, payload_bytes)
        self._staged[id(staged.payload)] = staged  # holds `payload`: its id stays its own meanwhile
        try:
            yield staged
        finally:
            del self._staged[id(staged.payload)]

    def _staged_for(self, record: Record) -> _fs.Staged | None:
        staged = self._staged.get(id(record.payload)) if self._staged else None
        return staged if staged is not None and staged.payload is record.payload else None

    async def _put_locked(self, key: RecordKey, record: Record) -> bool:
        """put's body, the key held and the gate entered."""
        level = self._zstd_kinds.get(record.header.kind)
        staged = self._staged_for(record)
        if level is not None and staged is not None and staged.pending:
            await self._run(staged.fill)  # the encoder reads the payload: fill it first (RecordError: corrupt)
        encoded = None if level is None else await self._run(
            functools.partial(encode_record, record, zstd_level=level))
        file_bytes = HEADER_SIZE + len(record.payload) if encoded is None else len(encoded)
        need = self._footprint_of(file_bytes)
        new_key = key not in self._index
        reserved, spare = self._reserve_put(key, new_key, file_bytes, need)
        if not reserved:
            return False
        writing = self._run(self._write_record, record, encoded, new_key, spare, staged)
        try:
            header = await wait_through_cancel(writing)
        except asyncio.CancelledError:  # raised once the write ended: a record it wrote whole is indexed,
            if not writing.cancelled() and writing.exception() is None:  # so the index says what the disk holds
                self._index_add(key, _Entry(writing.result(), file_bytes))
            raise
        except OSError as exc:
            self._log_write_failure(key, exc)
            return False
        finally:
            self._release(need)
        self._index_add(key, _Entry(header, file_bytes))
        return True

    def _next_tmp(self, final: str) -> str:
        return f"{final}.{self._tmp_tag}{next(self._tmp_seq)}{TEMP_SUFFIX}"

    def _write_record(self, record: Record, encoded: bytes | None, new_key: bool, spare: str | None,
                      staged: _fs.Staged | None = None) -> RecordHeader:
        """Worker thread: checksum, write durably (a new key into its spare, or in place
        without one; a key the index holds through a temp file and a rename), return the
        header as stored. A `staged` record is written from its buffer as it lies."""
        total = HEADER_SIZE + len(record.payload) if encoded is None else len(encoded)
        direct = self._direct_io_min_bytes is not None and total >= self._direct_io_min_bytes
        pipelined = total >= PIECEWISE_MIN_BYTES and self._helpers is not None
        head: bytes | None
        chunks: Sequence[bytes | memoryview]
        if encoded is not None:
            head, chunks = encoded[:HEADER_SIZE], (encoded,)
        elif staged is None and direct and (pipelined or record.checksum is None):  # copied while hashed
            head = None if record.checksum is None else self._encode_head(record, record.checksum)
            chunks = _fs.Piecewise(record.payload, head, functools.partial(self._encode_head, record),
                                   self._helpers if pipelined else None)
        elif staged is not None and staged.pending and record.checksum is None:  # the fill takes the checksum
            head = None
            chunks = staged.laid_out(None, self._helpers, functools.partial(self._encode_head, record))
        else:
            head = self._encode_head(record, record.payload_sum())
            chunks = (head, record.payload) if staged is None else staged.laid_out(head, self._helpers)
        key = record.key
        top, sub = SSDLayout.fanout(key)
        final = self._layout.path_str(key)
        written = False
        if spare is not None:
            self._make_dir(top, sub, durable=False)
            try:
                _fs.write_spare(spare, final, chunks, direct=direct, buffers=self._buffers)
                written = True
            except FileNotFoundError:  # the spare is gone (removed behind the tier's back)
                logger.warning("ssd spare %s vanished; %s written without it", spare, key.hex())
        if not written:
            self._make_dir(top, sub, durable=True)
            dir_sync = self._helpers if total >= OVERLAP_DIR_SYNC_MIN_BYTES else None
            if not (new_key and _fs.write_new(final, chunks, direct=direct, buffers=self._buffers, dir_sync=dir_sync)):
                _fs.write_durable(self._next_tmp(final), final, chunks, direct=direct, buffers=self._buffers)
        if head is None:  # the write made it (Piecewise, or a LaidOut whose fill took the checksum)
            assert isinstance(chunks, (_fs.Piecewise, _fs.LaidOut))
            head = bytes(chunks.plain()[0])
        stored, _ = decode_header(head)
        return stored

    def _make_dir(self, top: str, sub: str, *, durable: bool) -> None:
        """Worker thread: the directory a record of (top, sub) goes in, created if missing.

        `durable`: fsynced into its top directory too (`_fs.make_dir_durable`), once per
        directory, as a put written under its final name needs. A spare put does not: its
        record is durable in the spare, whose name was durable before the put; a crash that
        loses the directory loses the rename with it (metadata reaches an ext4 or XFS journal
        in order), and the scan moves the whole record from the spare into a directory it makes
        durable (`_scan_spare`). A first put into each of the 65,536 directories skips a
        journal commit that way (~0.5-0.9 ms of a 32 MiB put on the development VM)."""
        state = self._dirs.get((top, sub))
        if state or (state is not None and not durable):
            return
        path = self._layout.root / top / sub
        if durable:
            _fs.make_dir_durable(path)
            self._dirs[(top, sub)] = True
            return
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        self._dirs.setdefault((top, sub), False)  # never over a durable mark another thread set meanwhile

    @staticmethod
    def _encode_head(record: Record, checksum: int) -> bytes:
        return encode_header(record.header, stored_length=len(record.payload), flags=0, checksum=checksum)

    def _log_write_failure(self, key: RecordKey, exc: OSError) -> None:
        if exc.errno in _fs.NO_ROOM_ERRNOS:
            logger.warning("ssd put of %s refused by the file system: %s", key.hex(), exc)
        else:
            logger.error("ssd put of %s failed: %s", key.hex(), exc, exc_info=True)

    async def get(self, key: RecordKey) -> Record | None:
        self._check_open()
        entry = self._index.get(key)
        if entry is None:
            return None
        path = self._layout.path_str(key)
        target = self._targets.get(key) if self._targets else None
        if target is not None and entry.file_bytes >= DELIVER_MIN_BYTES and self._helpers is not None:
            result = await self._read_into_on_loop(path, key, entry, target) or \
                await self._run(_read_record_into, path, key, entry.file_bytes, self._read_direct(entry),
                                self._buffers, target, self._helpers)
        else:
            result = await self._read_on_loop(path, key, entry) or \
                await self._run(_read_record, path, key, entry.file_bytes, *self._read_mode(entry), self._buffers)
        return result.record if result.record is not None else await self._finish_get(key, path, result)

    async def _read_on_loop(self, path: str, key: RecordKey, entry: _Entry) -> _ReadResult | None:
        """`_read_record` on the event loop (`tiers._aio`: no thread hop), or None where it
        would wait on the loop (a path not in the lookup cache, a read that would block, no
        native AIO) or the record is not one for it: the caller then reads on a worker thread."""
        aio = self._aio
        if aio is None or not self._loop_readable(entry) or not aio.usable():
            return None
        lend = self._read_mode(entry)[1]
        fd = _open_on_loop(aio, path)
        if not isinstance(fd, int):
            return fd
        want = entry.file_bytes + 1  # one byte more: a file that grew shows as too long
        size = _fs.round_up(want, _fs.ALIGN)
        buf = self._buffers.lend(size) if lend else self._buffers.take(size)

        def release() -> None:
            os.close(fd)
            if not lend:  # (a lent buffer comes back once its views are gone)
                self._buffers.give(buf)

        try:
            fut = aio.submit(fd, buf[:size], 0)
        except BaseException as exc:
            release()
            if isinstance(exc, Unsupported):  # not on this file system: stop trying
                logger.info("ssd tier %s: reads stay on threads (%s)", self._layout.root, exc)
                aio.close()
                self._aio = None
            if isinstance(exc, WouldBlock):
                return None
            if isinstance(exc, OSError):
                return _ReadResult(None, error=exc)
            raise
        try:
            got = await fut
        except asyncio.CancelledError:
            aio.after(fut, release)  # the buffer is free once the read has landed
            raise
        except (WouldBlock, OSError) as exc:
            release()
            return _ReadResult(None, error=exc) if isinstance(exc, OSError) else None
        if got < entry.file_bytes:  # fewer bytes than the index knows: the thread path reads it
            release()               # again and judges it (a truncated file is quarantined there)
            return None
        try:
            return _decoded(fd, key, buf[:min(got, want)], lend)
        finally:
            release()

    async def _read_into_on_loop(self, path: str, key: RecordKey, entry: _Entry, target: ReadTarget
                                 ) -> _ReadResult | None:
        """`_read_record_into` with its reads on the event loop (`tiers._aio`): READ_WINDOW pieces
        in flight, each copied into the target (and hashed) on a helper thread once it and the
        pieces before it have landed; a piece whose read would wait (RWF_NOWAIT) or finds the AIO
        context full is read on a helper thread instead. None where it cannot start or finish
        this way (no native AIO, a path not in the lookup cache, a file shorter than the index
        says): the caller then reads the record on a thread, as before. Returns only once no read
        and no copy is in flight: nothing writes into the target after the get."""
        aio, helpers = self._aio, self._helpers
        if aio is None or helpers is None or not self._read_direct(entry) or not aio.usable():
            return None
        fd = _open_on_loop(aio, path)
        if not isinstance(fd, int):
            return fd
        try:
            inode = os.fstat(fd).st_ino  # a bad record's file is quarantined by the inode read
        except OSError as exc:
            os.close(fd)
            return _ReadResult(None, error=exc)
        loop = asyncio.get_running_loop()
        file_bytes = entry.file_bytes
        size = _fs.round_up(file_bytes + 1, _fs.ALIGN)
        view = self._buffers.lend(size)[:size]
        pieces = iter(range(0, len(view), READ_PIECE_BYTES))
        reads: collections.deque[_PieceRead] = collections.deque()
        copying: Future[None] | None = None  # the copy in flight into the target, on a helper thread
        delivery = _Delivery(target, file_bytes)
        got = 0

        def on_thread(lo: int, hi: int) -> _PieceRead:
            return _PieceRead(lo, hi, None, helpers.submit(_fs.read_range, fd, view, lo, hi))

        def read_next() -> None:
            lo = next(pieces, None)
            if lo is not None:
                hi = min(len(view), lo + READ_PIECE_BYTES)
                try:
                    reads.append(_PieceRead(lo, hi, aio.submit(fd, view[lo:hi], lo)))
                except WouldBlock:  # a full context: this piece on a thread
                    reads.append(on_thread(lo, hi))

        try:
            for _ in range(READ_WINDOW):
                read_next()
            while reads:
                piece = reads[0]
                try:
                    n = await piece.result()
                except WouldBlock:  # it would have waited (nothing was read): this piece on a thread
                    piece = reads[0] = on_thread(piece.lo, piece.hi)
                    n = await piece.result()
                reads.popleft()
                lo, hi = piece.lo, piece.hi
                got = lo + n
                if got == hi:  # (fewer: the end of the file, which a short file reaches early)
                    read_next()
                if lo == 0:
                    delivery.first(view[:got])
                span = delivery.span(lo, got)
                if span is not None:
                    if copying is not None:
                        await asyncio.wrap_future(copying)
                    copying = helpers.submit(delivery.copy, view, *span)
                if got < hi:
                    break
            if copying is not None:
                await asyncio.wrap_future(copying)
        except OSError as exc:
            return _ReadResult(None, error=exc)
        finally:
            await _settle_loop_reads(aio, reads, copying, fd)
        if got < file_bytes:
            return None  # fewer bytes than the index knows: the thread path reads it again and judges it
        data = view[: min(got, file_bytes + 1)]
        delivery.finish(got)
        if target.filled:
            header, _ = decode_header(data[:HEADER_SIZE])
            return _ReadResult(Record(header, data[HEADER_SIZE:].toreadonly(), delivery.checksum))
        try:  # not delivered (a header the target does not match, a bad record): verified as a plain get
            return _ReadResult(await loop.run_in_executor(
                helpers, functools.partial(decode_record, data, expect_key=key, keep_view=True)))
        except RecordError as exc:
            return _ReadResult(None, inode, str(exc))

    @contextlib.contextmanager
    def reading_into(self, key: RecordKey, dest: memoryview | Sequence[memoryview],
                     expect_tenant: bytes | None = None) -> Iterator[ReadTarget]:
        """While open, a `get` of `key` that reads a large record from the disk also copies its
        payload into `dest` (one buffer, or several laid end to end: as long as the payload together), piece by piece as the
        pieces arrive, hashing what it copies; `filled` then says whether `dest` holds the
        verified payload of the record returned. For a reader that wants the payload elsewhere
        (a client's shared memory): the copy overlaps the read instead of following it. A key
        that already has a target (another call reading it) gets one that is never filled."""
        target = ReadTarget(key, (dest,) if isinstance(dest, memoryview) else tuple(dest), expect_tenant)
        if key in self._targets:
            yield target
            return
        self._targets[key] = target
        try:
            yield target
        finally:
            del self._targets[key]

    def _read_direct(self, entry: _Entry) -> bool:
        limit = self._direct_io_min_bytes
        return limit is not None and entry.file_bytes >= limit

    def _read_mode(self, entry: _Entry) -> tuple[bool, bool]:
        """(O_DIRECT, lend the read buffer as the payload) for a read of `entry`."""
        size = entry.file_bytes
        return self._read_direct(entry), size >= LEND_MIN_BYTES or \
            SMALL_LEND_MIN_BYTES <= size and _fs.round_up(size + 1, _fs.ALIGN) <= _fs.SMALL_IO_BUFFER_BYTES

    async def get_many(self, keys: Sequence[RecordKey]) -> list[Record | None]:
        """Reads split over `max_concurrency` worker threads, one thread hop per share, while
        the records the event loop can read itself (`_read_on_loop`) are read there,
        `max_concurrency` in flight; a loop read that would wait goes to the threads after."""
        self._check_open()
        index = self._index
        jobs = [(i, self._layout.path_str(k), k, index[k]) for i, k in enumerate(keys) if k in index]
        out: list[Record | None] = [None] * len(keys)
        on_loop: list[_GetJob] = []
        on_threads: list[_GetJob] = []
        for job in jobs:
            (on_loop if self._aio is not None and self._loop_readable(job[3]) else on_threads).append(job)
        if not on_loop:
            await self._get_many_on_threads(on_threads, out)
            return out
        left: list[_GetJob] = []
        await asyncio.gather(self._get_many_on_loop(on_loop, out, left), self._get_many_on_threads(on_threads, out))
        await self._get_many_on_threads(left, out)
        return out

    def _loop_readable(self, entry: _Entry) -> bool:
        """Whether `_read_on_loop` takes a record of this entry (as far as the index tells)."""
        return not entry.header.flags and entry.file_bytes < LOOP_READ_MAX_FILE_BYTES and self._read_direct(entry)

    def _shares(self, jobs: list[_GetJob]) -> list[list[_GetJob]]:
        """`jobs` dealt round-robin into at most `max_concurrency` shares, one in flight each."""
        return [jobs[i:: self._max_concurrency] for i in range(min(self._max_concurrency, len(jobs)))]

    async def _get_many_on_threads(self, jobs: list[_GetJob], out: list[Record | None]) -> None:
        shares = self._shares(jobs)
        results = await asyncio.gather(*(
            self._run(_read_records, [(p, k, e.file_bytes, *self._read_mode(e)) for _, p, k, e in share], self._buffers)
            for share in shares))
        for share, share_results in zip(shares, results):
            for (i, path, key, _), result in zip(share, share_results):
                out[i] = result.record if result.record is not None else await self._finish_get(key, path, result)

    async def _get_many_on_loop(self, jobs: list[_GetJob], out: list[Record | None], left: list[_GetJob]) -> None:
        """`get_many`'s reads on the loop, `max_concurrency` at a time, each share in order;
        the jobs it cannot do there go to `left`."""

        async def share(part: list[_GetJob]) -> None:
            for job in part:
                i, path, key, entry = job
                result = await self._read_on_loop(path, key, entry)
                if result is None:
                    left.append(job)
                else:
                    out[i] = result.record if result.record is not None else await self._finish_get(key, path, result)

        await asyncio.gather(*(share(part) for part in self._shares(jobs)))

    async def _finish_get(self, key: RecordKey, path: str, result: _ReadResult) -> Record | None:
        if result.record is not None:
            return result.record
        if result.missing:
            await self._forget_missing(key)
        elif result.error is not None:
            logger.warning("ssd get of %s failed: %s", key.hex(), result.error)
        else:
            await self._quarantine_bad(key, path, result)
        return None

    async def _forget_missing(self, key: RecordKey) -> None:
        async with self._gate.mutation(), self._locks.hold(key):
            if key in self._index and not await aiofiles.os.path.exists(self._layout.path(key)):
                logger.warning("ssd record %s vanished from the disk; dropped from the index", key.hex())
                self._index_remove(key)

    async def _quarantine_bad(self, key: RecordKey, path: str, result: _ReadResult) -> None:
        """Move the corrupt file aside, unless a newer put already replaced it."""
        async with self._gate.mutation(), self._locks.hold(key):
            inode = None if result.inode < 0 else result.inode
            moved = await self._run(functools.partial(_fs.quarantine, Path(path), self._layout.quarantine_dir,
                                                      inode=inode))
            if moved:
                self._index_remove(key)
                logger.warning("ssd record %s is corrupt (%s): quarantined, reported as a miss",
                               key.hex(), result.problem)

    async def delete(self, key: RecordKey) -> bool:
        """Remove the record. Not fsynced: a delete lost in a crash brings back a valid record.
        The file of an O_DIRECT-sized record becomes a recycled spare while the pool has room
        (`recycle_bytes`), its header zeroed durably first, so that it can never come back."""
        self._check_open()
        async with self._gate.mutation(), self._locks.hold(key):
            entry = self._index_remove(key)
            if entry is None:
                return False
            path = self._layout.path_str(key)
            if self._recyclable(entry.file_bytes) and await self._recycle(path, entry.file_bytes):
                return True
            try:
                await aiofiles.os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("ssd delete of %s failed: %s (the next scan re-indexes it)", key.hex(), exc)
            return True

    def _recyclable(self, file_bytes: int) -> bool:
        limit = self._direct_io_min_bytes
        return limit is not None and file_bytes >= limit and self._recycled.limit_bytes > 0

    async def _recycle(self, path: str, file_bytes: int) -> bool:
        """Make the file at `path` a recycled spare, claimable at once; False: not done
        (unlink it instead). Its name is made durable here, not in the refill's batch: in a
        full cache the next put needs it (store put-evict-put streams on the development VM,
        a directory fsync per recycled file against one per batch later: 1.92 -> 1.69,
        2.42 -> 1.95, 4.83 -> 3.29, 21.6 -> 11.1 ms a put at 256 KiB / 1 / 4 / 32 MiB; the
        batch was never done in time, so the puts dropped the files instead)."""
        if not self._recycled.admit(file_bytes):
            return False
        spare = f"{self._layout.spares_dir}/{self._tmp_tag}{next(self._spare_seq):x}{SPARE_SUFFIX}"
        try:
            size = await self._run(_fs.recycle, path, spare)
        except FileNotFoundError:
            self._recycled.abandon(file_bytes)
            return True  # gone already: nothing left to delete
        except OSError as exc:
            self._recycled.abandon(file_bytes)
            logger.warning("ssd file %s not recycled (%s): unlinked instead", path, exc)
            return False
        if size != file_bytes:  # the index was wrong about it: a spare of its real size
            self._recycled.resize(file_bytes, size)
        self._recycled.promote([(spare, size)])
        return True

    async def contains(self, keys: Sequence[RecordKey]) -> list[bool]:
        index = self._index
        return [k in index for k in keys]

    async def put_many(self, records: Sequence[Record]) -> list[bool]:
        """Concurrent puts: the file system commits their journal entries together.

        The records are dealt into `max_concurrency` shares and each share is written by one
        thread call, one record after another: as many writes in flight as with one call per
        record, but one thread hop per share instead of per record (on a loaded machine each
        hop waits for a CPU twice). A batch with a repeated key or a compressed kind goes
        record by record through `put`.
        """
        self._check_open()
        keys = [r.key for r in records]
        if len(records) < 2 or len(set(keys)) < len(keys) or any(r.header.kind in self._zstd_kinds for r in records):
            return await self._bounded(self.put, records)
        with self._putting():
            return await self._put_many_locked(records, keys)

    async def _put_many_locked(self, records: Sequence[Record], keys: Sequence[RecordKey]) -> list[bool]:
        async with self._gate.mutation(), contextlib.AsyncExitStack() as held:
            for key in sorted(keys):  # one global order: batches sharing keys cannot deadlock
                await held.enter_async_context(self._locks.hold(key))
            return await self._put_shares(records)

    async def _put_shares(self, records: Sequence[Record]) -> list[bool]:
        """put_many's body, every key locked: reserve, write the shares, index what landed."""
        out = [False] * len(records)
        plan = []  # (position, record, reserved bytes, new key, spare)
        for i, record in enumerate(records):
            file_bytes = HEADER_SIZE + len(record.payload)
            need = self._footprint_of(file_bytes)
            new_key = record.key not in self._index
            reserved, spare = self._reserve_put(record.key, new_key, file_bytes, need, refill=False)
            if reserved:
                plan.append((i, record, need, new_key, spare))
        shares = [plan[i:: self._max_concurrency] for i in range(min(self._max_concurrency, len(plan)))]
        writing = asyncio.gather(*(
            self._run(self._write_share, [(record, new_key, spare, self._staged_for(record))
                                          for _, record, _, new_key, spare in share])
            for share in shares))
        cancelled = False
        try:
            results = await wait_through_cancel(writing)
        except asyncio.CancelledError:  # raised once the writes ended: what they wrote whole is indexed below
            cancelled = True
            results = writing.result() if not writing.cancelled() and writing.exception() is None else []
        finally:
            for _, _, need, _, _ in plan:
                self._release(need)
            self._start_refill()
        for share, share_results in zip(shares, results):
            for (i, record, _, _, _), result in zip(share, share_results):
                if isinstance(result, OSError):
                    self._log_write_failure(record.key, result)
                else:
                    self._index_add(record.key, _Entry(result, HEADER_SIZE + len(record.payload)))
                    out[i] = True
        if cancelled:
            raise asyncio.CancelledError
        return out

    def _write_share(self, jobs: Sequence[tuple[Record, bool, str | None, _fs.Staged | None]]
                     ) -> list[RecordHeader | OSError]:
        """Worker thread: `_write_record` for each (uncompressed) record; a failed write is
        returned as its error and the share goes on."""
        results: list[RecordHeader | OSError] = []
        for record, new_key, spare, staged in jobs:
            try:
                results.append(self._write_record(record, None, new_key, spare, staged))
            except OSError as exc:
                results.append(exc)
        return results

    async def _bounded(self, fn: Callable[[Record], Awaitable[bool]], items: Sequence[Record]) -> list[bool]:
        limit = asyncio.Semaphore(self._max_concurrency)

        async def one(item: Record) -> bool:
            async with limit:
                return await fn(item)

        return list(await asyncio.gather(*(one(i) for i in items)))

    def _adopt_recycled(self, files: Sequence[tuple[str, int]]) -> None:
        """The scan's recycled spares (durable names), as many as the limit holds; the rest
        are unlinked."""
        pool = self._recycled
        pool.ready, pool.held_bytes = {}, 0
        extra = []
        for path, size in files:
            if pool.admit(size):
                pool.promote([(path, size)])
            else:
                extra.append(path)
        self._unlink_recycled(extra)

    async def reindex(self) -> ScanResult:
        """The first call after `open()`, while nothing has changed the directory since,
        answers from open's scan (the index it built and what it discarded) instead of walking
        the disk a second time; otherwise it scans."""
        mark, self._scan_mark = self._scan_mark, None
        async with self._gate.exclusive():
            if mark is not None and mark == self._gate.mutations and self.last_scan is not None:
                headers = [entry.header for entry in self._index.values()]
                return ScanResult(headers, list(self.last_scan.discarded))
        return await self.scan()

    async def scan(self, *, snapshot: bool = False) -> ScanResult:
        """Rebuild the index from the record headers on disk; clean up what is not a record.

        `snapshot` (open does): take the index a clean close saved (`tiers.ssd_snapshot`),
        removing it, and scan only the leaf directories changed since; without one, or with one
        that does not verify, scan everything. `snapshot_use` says what happened."""
        self._check_open()
        async with self._gate.exclusive():
            root = self._layout.root
            saved, why = await self._run(ssd_snapshot.take, root) if snapshot else (None, "not asked for")
            if saved is not None and not self._index_snapshot:  # taken all the same: never left to go stale
                saved, why = None, "index snapshots are off (storage.ssd_index_snapshot)"
            spares = await self._run(_scan_spares, self._layout)
            self._spares.ready = collections.deque(spares.ready)
            self._adopt_recycled(spares.recycled)
            for line in spares.recovered:
                logger.info("ssd scan of %s: a whole record under a spare name, moved to its own: %s", root, line)
            tops, discarded = await self._run(_list_root, root)
            discarded = spares.discarded + discarded
            # `_opened_stamps`: the leaves as this scan leaves them (it removes and quarantines),
            # what a clean close compares the leaves it did not change with (`ssd_snapshot.vouched`).
            trusted: list[tuple[RecordHeader, int]] = []
            if saved is None:
                chunks = [tops[i: i + SCAN_CHUNK] for i in range(0, len(tops), SCAN_CHUNK)]
                scans = await asyncio.gather(*(self._run(_scan_top_dirs, self._layout, c) for c in chunks))
                self.snapshot_use = SnapshotUse(0, None, why)
                self._opened_stamps = await self._run(ssd_snapshot.leaf_stamps, root) if self._index_snapshot else None
            else:
                stamps = await self._run(ssd_snapshot.leaf_stamps, root)
                changed, unchanged = ssd_snapshot.trusted_entries(saved, stamps)
                trusted = list(unchanged)
                chunks = [changed[i: i + SCAN_CHUNK * 16] for i in range(0, len(changed), SCAN_CHUNK * 16)]
                scans = await asyncio.gather(*(self._run(_scan_leaves, self._layout, c) for c in chunks))
                self.snapshot_use = SnapshotUse(len(trusted), len(changed), "")
                self._opened_stamps = await self._run(ssd_snapshot.restamped, root, stamps, changed)
            for part in scans:
                discarded.extend(part.discarded)
            self._rebuild_index(itertools.chain(((h.key, h, size) for h, size in trusted),
                                                *(part.entries for part in scans)))
            headers = [entry.header for entry in self._index.values()]
            for line in discarded:
                logger.warning("ssd scan of %s: %s", root, line)
            if snapshot:
                logger.info("ssd tier %s: %s", root, self.snapshot_use.describe(len(headers)))
            self._touched = set()  # leaves changed since this scan (`_index_add`, `_index_remove`)
            return ScanResult(headers, discarded)
