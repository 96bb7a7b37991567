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
buffer from the tier's pool (`tiers._iobuffers.IOBuffers`: huge pages from 512 KiB, mapped and faulted
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

This module is the tier itself: its index and budget, puts, gets, deletes, and the order in
which they may run. Its parts, each with one job: `tiers.ssd_layout` (where a key's file
lives), `tiers.ssd_reads` (open, read, verify, deliver), `tiers.ssd_scan` (what the start-up
finds on disk), `tiers.ssd_spares` (the pools of durable names), `tiers.ssd_snapshot` (the
index a clean close saves), `tiers._fs` (the durable-write protocols), `tiers._iobuffers` (the
aligned buffers they and the reads use).
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
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aiofiles.os

from tiers import _fs, ssd_snapshot
from tiers._aio import DEFAULT_POLL_S, AioReads, Unsupported, WouldBlock
from tiers._hop import Workers
from tiers._iobuffers import ALIGN, SMALL_IO_BUFFER_BYTES, IOBuffers, round_up
from tiers.base import KindUsage, ScanResult, Tier, TierUsage
from tiers.locks import KeyLocks
from tiers.offload import wait_through_cancel
from tiers.record import (
    HEADER_SIZE,
    Record,
    RecordError,
    RecordHeader,
    RecordKey,
    decode_header,
    decode_record,
    encode_header,
    encode_record,
    make_record,
)
from tiers.ssd_layout import LOCK_FILE, SPARE_SUFFIX, TEMP_SUFFIX, SSDLayout
from tiers.ssd_reads import (
    DELIVER_MIN_BYTES,
    LEND_MIN_BYTES,
    LOOP_READ_MAX_FILE_BYTES,
    READ_PIECE_BYTES,
    READ_WINDOW,
    SMALL_LEND_MIN_BYTES,
    Delivery,
    PieceRead,
    ReadResult,
    ReadTarget,
    decoded,
    open_on_loop,
    read_record,
    read_record_into,
    read_records,
    settle_loop_reads,
)
from tiers.ssd_scan import SCAN_CHUNK, SnapshotUse, list_root, scan_leaves, scan_spares, scan_top_dirs, write_snapshot
from tiers.ssd_spares import DEFAULT_RECYCLE_BYTES, DEFAULT_SPARE_FILES, SPARE_CHUNK, RecyclePool, SparePool

if TYPE_CHECKING:
    from tiers.registry import TierConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Records at least this large are read with O_DIRECT (aligned buffer): on the development
# machine (ext4 on virtio) one device I/O per record beat buffered I/O from 128 KiB up, cold
# reads most of all (bench/tiers.py).
DEFAULT_DIRECT_IO_MIN_BYTES = 128 << 10
# ... and written with O_DIRECT from this size; smaller ones are written through the page cache
# (then fdatasynced, and their pages dropped when they are read with O_DIRECT). 256 KiB records,
# `python -m bench.tiers --only ssd --sizes 256K` alternated with O_DIRECT writes from 128 KiB
# (session 21's VM, ext4 on virtio): the tier's own puts went 0.10-0.12 -> 0.16-0.21 GB/s at
# depth 1 and 0.16-0.18 -> 0.28-0.34 at depth 4. A buffered write into an empty spare leaves the
# allocation to delayed allocation at the fdatasync; an O_DIRECT write allocates its blocks
# before it writes them. From 512 KiB O_DIRECT won: at depth 4, 0.43-0.52 GB/s against 0.34-0.41
# buffered (1 MiB: 0.47-0.51 against 0.37-0.40).
DEFAULT_DIRECT_WRITE_MIN_BYTES = 512 << 10
DEFAULT_MAX_CONCURRENCY = 8  # puts/gets in flight for put_many/get_many (journal group commit)
# New records at least this large fsync their directory on a second thread while the data
# is written (`_fs.write_new(dir_sync=...)`): on ext4 that fsync is a journal commit, hidden
# behind a write this long; below it the extra thread handoff cost about what it saved
# (bench/tiers.py, 256 KiB vs 1 and 4 MiB).
OVERLAP_DIR_SYNC_MIN_BYTES = 1 << 20
# Free I/O buffers the tier keeps beyond one per thread, for a second (`tiers._iobuffers.IOBuffers`):
# a get_many of large records holds one lent buffer per record until its caller drops the
# payloads, and mapping and faulting them in anew for each batch cost 1 MiB gets at queue
# depth 4 about a third of their speed (32 records: 0.53 of the O_DIRECT reference -> 0.80).
RETAIN_BUFFER_BYTES = 128 << 20
# A put of a record at least this large (not staged, written with O_DIRECT) copies its payload
# into the aligned buffer and hashes it piece by piece while the previous pieces are written
# (`tiers._fs.Piecewise`), instead of hashing, copying and then writing it whole; smaller ones
# without a carried checksum are hashed by their copy, one pass, then written whole (4 MiB:
# 4.85 -> 4.58 ms a put, interleaved, distinct payloads; 1 MiB 1.70 -> 1.66 ms). Development
# VM, new keys into spares, interleaved: 17 MiB 11.7 -> 10.8 ms (the write alone 9.8 ms),
# 32 MiB 28 -> 24 ms and 8 MiB 12 -> 8 ms when the disk throttled; 1 and 4 MiB were slower
# in pieces (1.3 -> 1.5 ms, 3.9 -> 4.3 ms): a single write keeps more of the device busy.
PIECEWISE_MIN_BYTES = 8 << 20
# A refill waits until no put has run for this long, unless the pool is down to a quarter
# (then at once: an empty pool costs every new key a directory fsync). Its creates and its
# directory fsync are journal commits of their own; run beside a stream of puts they made
# each put's fdatasync wait behind them: 128 256 KiB puts at qd 1 on the dev VM took ~1.3-2x
# as long with the refill in the middle of the stream as with it after.
REFILL_QUIET_S = 0.005


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
    return round_up(sum(sys.getsizeof(p) for p in parts) + dict_slot, 16)


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


_GetJob = tuple[int, str, RecordKey, "_Entry"]  # get_many: (index in the keys, path, key, index entry)


class SSDTier(Tier):
    """Records as files under `root`, durable on put, verified on get.

    Args:
        root: the tier's directory (created if missing); one SSDTier owns it at a time.
        budget_bytes: 0 = unbounded; else `put` refuses what would exceed it.
        zstd_kinds: kind code -> zstd level for the kinds worth compressing. Empty by
            default: FP4 KV payloads measure ~1.00x under zstd (bench/tiers.py), so the
            tier would only pay CPU for nothing.
        direct_io_min_bytes: records this large or larger are read with O_DIRECT, and
            recycled when deleted (None: never O_DIRECT). The SSD tier sits below the host
            RAM tier, so the page cache would only hold a second copy; one device I/O per
            record also beats buffered readahead windows on cold reads (bench/tiers.py).
        direct_write_min_bytes: records this large or larger, and at least
            `direct_io_min_bytes`, are written with O_DIRECT (None: none); smaller ones are
            written through the page cache, whose pages are dropped once the record is
            durable when it is read with O_DIRECT (`DEFAULT_DIRECT_WRITE_MIN_BYTES` says why).
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
                 direct_write_min_bytes: int | None = DEFAULT_DIRECT_WRITE_MIN_BYTES,
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
        for name, value in (("direct_io_min_bytes", direct_io_min_bytes),
                            ("direct_write_min_bytes", direct_write_min_bytes)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        if not 0 <= read_poll_s <= 1:
            raise ValueError(f"read_poll_s must be within [0, 1] seconds, got {read_poll_s}")
        self._recycle_auto = recycle_bytes is None  # decided in open(), once the file system is known
        if recycle_bytes is None:
            recycle_bytes = min(DEFAULT_RECYCLE_BYTES, budget_bytes // 4) if budget_bytes else DEFAULT_RECYCLE_BYTES
        self._layout = SSDLayout(Path(root))
        self._budget_bytes = budget_bytes
        self._zstd_kinds = dict(zstd_kinds or {})
        self._direct_io_min_bytes = direct_io_min_bytes
        self._direct_write_min_bytes = None if direct_io_min_bytes is None or direct_write_min_bytes is None \
            else max(direct_io_min_bytes, direct_write_min_bytes)
        self._max_concurrency = max_concurrency
        self._buffers = IOBuffers(max_concurrency, RETAIN_BUFFER_BYTES)  # aligned I/O buffers (lent ones too)
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
        self._spares = SparePool(spare_files)
        self._recycled = RecyclePool(recycle_bytes)
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
                kept, left_out, nbytes = await self._run(write_snapshot, self._layout.root, entries,
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
        return round_up(file_bytes, self._block_bytes) + INDEX_ENTRY_BYTES

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
        direct, uncache = self.write_mode(total)
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
                _fs.write_spare(spare, final, chunks, direct=direct, buffers=self._buffers, uncache=uncache)
                written = True
            except FileNotFoundError:  # the spare is gone (removed behind the tier's back)
                logger.warning("ssd spare %s vanished; %s written without it", spare, key.hex())
        if not written:
            self._make_dir(top, sub, durable=True)
            dir_sync = self._helpers if total >= OVERLAP_DIR_SYNC_MIN_BYTES else None
            if not (new_key and _fs.write_new(final, chunks, direct=direct, buffers=self._buffers, dir_sync=dir_sync,
                                              uncache=uncache)):
                _fs.write_durable(self._next_tmp(final), final, chunks, direct=direct, buffers=self._buffers,
                                  uncache=uncache)
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
        durable (`tiers.ssd_scan`). A first put into each of the 65,536 directories skips a
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
                await self._run(read_record_into, path, key, entry.file_bytes, self._read_direct(entry.file_bytes),
                                self._buffers, target, self._helpers)
        else:
            result = await self._read_on_loop(path, key, entry) or \
                await self._run(read_record, path, key, entry.file_bytes, *self._read_mode(entry), self._buffers)
        return result.record if result.record is not None else await self._finish_get(key, path, result)

    async def _read_on_loop(self, path: str, key: RecordKey, entry: _Entry) -> ReadResult | None:
        """`read_record` on the event loop (`tiers._aio`: no thread hop), or None where it
        would wait on the loop (a path not in the lookup cache, a read that would block, no
        native AIO) or the record is not one for it: the caller then reads on a worker thread."""
        aio = self._aio
        if aio is None or not self._loop_readable(entry) or not aio.usable():
            return None
        lend = self._read_mode(entry)[1]
        fd = open_on_loop(aio, path)
        if not isinstance(fd, int):
            return fd
        want = entry.file_bytes + 1  # one byte more: a file that grew shows as too long
        size = round_up(want, ALIGN)
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
                return ReadResult(None, error=exc)
            raise
        try:
            got = await fut
        except asyncio.CancelledError:
            aio.after(fut, release)  # the buffer is free once the read has landed
            raise
        except (WouldBlock, OSError) as exc:
            release()
            return ReadResult(None, error=exc) if isinstance(exc, OSError) else None
        if got < entry.file_bytes:  # fewer bytes than the index knows: the thread path reads it
            release()               # again and judges it (a truncated file is quarantined there)
            return None
        try:
            return decoded(fd, key, buf[:min(got, want)], lend)
        finally:
            release()

    async def _read_into_on_loop(self, path: str, key: RecordKey, entry: _Entry, target: ReadTarget
                                 ) -> ReadResult | None:
        """`read_record_into` with its reads on the event loop (`tiers._aio`): READ_WINDOW pieces
        in flight, each copied into the target (and hashed) on a helper thread once it and the
        pieces before it have landed; a piece whose read would wait (RWF_NOWAIT) or finds the AIO
        context full is read on a helper thread instead. None where it cannot start or finish
        this way (no native AIO, a path not in the lookup cache, a file shorter than the index
        says): the caller then reads the record on a thread, as before. Returns only once no read
        and no copy is in flight: nothing writes into the target after the get."""
        aio, helpers = self._aio, self._helpers
        if aio is None or helpers is None or not self._read_direct(entry.file_bytes) or not aio.usable():
            return None
        fd = open_on_loop(aio, path)
        if not isinstance(fd, int):
            return fd
        try:
            inode = os.fstat(fd).st_ino  # a bad record's file is quarantined by the inode read
        except OSError as exc:
            os.close(fd)
            return ReadResult(None, error=exc)
        loop = asyncio.get_running_loop()
        file_bytes = entry.file_bytes
        size = round_up(file_bytes + 1, ALIGN)
        view = self._buffers.lend(size)[:size]
        pieces = iter(range(0, len(view), READ_PIECE_BYTES))
        reads: collections.deque[PieceRead] = collections.deque()
        copying: Future[None] | None = None  # the copy in flight into the target, on a helper thread
        delivery = Delivery(target, file_bytes)
        got = 0

        def on_thread(lo: int, hi: int) -> PieceRead:
            return PieceRead(lo, hi, None, helpers.submit(_fs.read_range, fd, view, lo, hi))

        def read_next() -> None:
            lo = next(pieces, None)
            if lo is not None:
                hi = min(len(view), lo + READ_PIECE_BYTES)
                try:
                    reads.append(PieceRead(lo, hi, aio.submit(fd, view[lo:hi], lo)))
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
            return ReadResult(None, error=exc)
        finally:
            await settle_loop_reads(aio, reads, copying, fd)
        if got < file_bytes:
            return None  # fewer bytes than the index knows: the thread path reads it again and judges it
        data = view[: min(got, file_bytes + 1)]
        delivery.finish(got)
        if target.filled:
            header, _ = decode_header(data[:HEADER_SIZE])
            return ReadResult(Record(header, data[HEADER_SIZE:].toreadonly(), delivery.checksum))
        try:  # not delivered (a header the target does not match, a bad record): verified as a plain get
            return ReadResult(await loop.run_in_executor(
                helpers, functools.partial(decode_record, data, expect_key=key, keep_view=True)))
        except RecordError as exc:
            return ReadResult(None, inode, str(exc))

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

    def write_mode(self, file_bytes: int) -> tuple[bool, bool]:
        """(O_DIRECT, drop the page cache's copy once durable) for a write of a file this large."""
        limit = self._direct_write_min_bytes
        direct = limit is not None and file_bytes >= limit
        return direct, not direct and self._read_direct(file_bytes)

    def _read_direct(self, file_bytes: int) -> bool:
        """Whether a file this large is read with O_DIRECT (and recycled when deleted)."""
        limit = self._direct_io_min_bytes
        return limit is not None and file_bytes >= limit

    def _read_mode(self, entry: _Entry) -> tuple[bool, bool]:
        """(O_DIRECT, lend the read buffer as the payload) for a read of `entry`."""
        size = entry.file_bytes
        return self._read_direct(size), size >= LEND_MIN_BYTES or \
            SMALL_LEND_MIN_BYTES <= size and round_up(size + 1, ALIGN) <= SMALL_IO_BUFFER_BYTES

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
        size = entry.file_bytes
        return not entry.header.flags and size < LOOP_READ_MAX_FILE_BYTES and self._read_direct(size)

    def _shares(self, jobs: list[_GetJob]) -> list[list[_GetJob]]:
        """`jobs` dealt round-robin into at most `max_concurrency` shares, one in flight each."""
        return [jobs[i:: self._max_concurrency] for i in range(min(self._max_concurrency, len(jobs)))]

    async def _get_many_on_threads(self, jobs: list[_GetJob], out: list[Record | None]) -> None:
        shares = self._shares(jobs)
        results = await asyncio.gather(*(
            self._run(read_records, [(p, k, e.file_bytes, *self._read_mode(e)) for _, p, k, e in share], self._buffers)
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

    async def _finish_get(self, key: RecordKey, path: str, result: ReadResult) -> Record | None:
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

    async def _quarantine_bad(self, key: RecordKey, path: str, result: ReadResult) -> None:
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
        return self._read_direct(file_bytes) and self._recycled.limit_bytes > 0

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
            spares = await self._run(scan_spares, self._layout)
            self._spares.ready = collections.deque(spares.ready)
            self._adopt_recycled(spares.recycled)
            for line in spares.recovered:
                logger.info("ssd scan of %s: a whole record under a spare name, moved to its own: %s", root, line)
            tops, discarded = await self._run(list_root, root)
            discarded = spares.discarded + discarded
            # `_opened_stamps`: the leaves as this scan leaves them (it removes and quarantines),
            # what a clean close compares the leaves it did not change with (`ssd_snapshot.vouched`).
            trusted: list[tuple[RecordHeader, int]] = []
            if saved is None:
                chunks = [tops[i: i + SCAN_CHUNK] for i in range(0, len(tops), SCAN_CHUNK)]
                scans = await asyncio.gather(*(self._run(scan_top_dirs, self._layout, c) for c in chunks))
                self.snapshot_use = SnapshotUse(0, None, why)
                self._opened_stamps = await self._run(ssd_snapshot.leaf_stamps, root) if self._index_snapshot else None
            else:
                stamps = await self._run(ssd_snapshot.leaf_stamps, root)
                changed, unchanged = ssd_snapshot.trusted_entries(saved, stamps)
                trusted = list(unchanged)
                chunks = [changed[i: i + SCAN_CHUNK * 16] for i in range(0, len(changed), SCAN_CHUNK * 16)]
                scans = await asyncio.gather(*(self._run(scan_leaves, self._layout, c) for c in chunks))
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
