"""The SSD tier's reads (`tiers.ssd`): one record file opened, read into an aligned pooled
buffer and verified there (header, key, payload checksum), on a worker thread or, with native
AIO, on the event loop; and delivering reads, which copy a large payload into a caller's
target piece by piece while the next pieces are read. What a read found is a `ReadResult`;
the tier decides what follows (serve it, forget a missing file, quarantine a bad one)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from tiers import _fs
from tiers._aio import AioReads, WouldBlock
from tiers._iobuffers import ALIGN, IOBuffers, round_up
from tiers.offload import wait_through_cancel
from tiers.record import HEADER_SIZE, Record, RecordError, RecordKey, copy_scattered, decode_header, decode_record

# A get (or get_many) of a record at least this large returns its payload as a view of the
# pooled (huge-page) buffer it was read into, instead of a copy (`tiers._iobuffers.IOBuffers.lend`);
# the buffer is busy until the caller drops the payload (a batch maps one per record held, as
# a copy would allocate one).
LEND_MIN_BYTES = 1 << 20
# Records from this size whose read buffer is a small one (up to `tiers._iobuffers.SMALL_IO_BUFFER_BYTES`:
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
READ_PIECE_BYTES = 2 << 20
# A delivering get on the event loop (`SSDTier._read_into_on_loop`, native AIO) keeps this many
# pieces in flight, each copied into the target on a helper thread as it lands, in order. All
# of a record's pieces at once landed together at the end (the virtio host serves them in
# parallel), leaving nothing for the copies to overlap; one at a time left the disk idle between
# pieces. 32 MiB into /dev/shm, in-process on the development VM: read whole 9.0 ms (no copy);
# pieces one at a time on a thread 11.5; 3 x 2 MiB in flight 9.8 (2 x 2 MiB 10.2, 2 x 4 MiB 10.1,
# all 16 at once 12.0).
READ_WINDOW = 3


@dataclass(frozen=True, slots=True)
class ReadResult:
    """What one worker-thread read found: a verified record, or why not."""

    record: Record | None
    inode: int = -1  # of the file read; -1 when none was read
    problem: str = ""  # why the bytes are not a valid record (-> quarantine)
    missing: bool = False  # the file is gone (-> drop from the index)
    error: OSError | None = None  # the read itself failed (-> a miss, file left alone)


def read_records(jobs: Sequence[tuple[str, RecordKey, int, bool, bool]], buffers: IOBuffers) -> list[ReadResult]:
    """Worker thread: `read_record` for each (path, key, file size, direct, lend); never raises per file."""
    return [read_record(path, key, file_bytes, direct, lend, buffers) for path, key, file_bytes, direct, lend in jobs]


def open_record(path: str, direct: bool) -> int | ReadResult:
    """A record file's fd, or the `ReadResult` of a file that is gone or cannot be opened."""
    try:
        return _fs.open_for_read(path, direct=direct)
    except FileNotFoundError:
        return ReadResult(None, missing=True)
    except OSError as exc:
        return ReadResult(None, error=exc)


def read_record(path: str, key: RecordKey, file_bytes: int, direct: bool, lend: bool,
                 buffers: IOBuffers) -> ReadResult:
    """One open, one read of the indexed size (+1 byte: a grown file shows as too long)
    into an aligned buffer of `buffers`, verified there. The payload is copied out, or with
    `lend` is a read-only view of the buffer, which goes back to the pool once the caller
    drops the payload (`IOBuffers.lend`). The inode is looked up only for a bad file, so that
    the caller quarantines exactly the file it read."""
    fd = open_record(path, direct)
    if isinstance(fd, ReadResult):
        return fd
    try:
        if lend:
            return read_verified(fd, key, file_bytes, buffers.lend(round_up(file_bytes + 1, ALIGN)), True)
        with buffers.lease(round_up(file_bytes + 1, ALIGN)) as buf:
            return read_verified(fd, key, file_bytes, buf, False)
    finally:
        os.close(fd)


def read_verified(fd: int, key: RecordKey, file_bytes: int, buf: memoryview, keep_view: bool) -> ReadResult:
    """Read `fd` into `buf` and verify it there; `keep_view`: the payload is a view of `buf`."""
    try:
        data = _fs.read_upto(fd, file_bytes + 1, buf)
    except OSError as exc:
        return ReadResult(None, error=exc)
    return decoded(fd, key, data, keep_view)


def decoded(fd: int, key: RecordKey, data: memoryview, keep_view: bool) -> ReadResult:
    """The record in `data` (read from `fd`), verified; a bad one names the inode read, so that
    the caller quarantines exactly that file."""
    try:
        return ReadResult(decode_record(data, expect_key=key, keep_view=keep_view))
    except RecordError as exc:
        return ReadResult(None, os.fstat(fd).st_ino, str(exc))


def open_on_loop(aio: AioReads, path: str) -> int | ReadResult | None:
    """A record file opened for a read on the loop (O_DIRECT), the `ReadResult` of one that is
    gone or cannot be opened, or None where the open would wait (the caller reads on a thread)."""
    try:
        return aio.open_cached(path)
    except WouldBlock:
        return None
    except FileNotFoundError:
        return ReadResult(None, missing=True)
    except OSError as exc:
        return ReadResult(None, error=exc)


@dataclass(frozen=True, slots=True)
class PieceRead:
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


async def settle_loop_reads(aio: AioReads, reads: Sequence[PieceRead], copying: Future[None] | None,
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


def read_record_into(path: str, key: RecordKey, file_bytes: int, direct: bool, buffers: IOBuffers,
                      target: ReadTarget, helpers: ThreadPoolExecutor) -> ReadResult:
    """`read_record` (lending the buffer) that also delivers the payload into `target`: the file
    is read in pieces, and each piece is copied into `target.dest` and hashed on a helper thread
    while the next one is read. Anything unusual (a header that does not match, a short or long
    file, a checksum mismatch) leaves the target unfilled and ends as `read_verified` ends."""
    fd = open_record(path, direct)
    if isinstance(fd, ReadResult):
        return fd
    try:
        buf = buffers.lend(round_up(file_bytes + 1, ALIGN))
        try:
            view, checksum = _read_delivering(fd, file_bytes, buf, target, helpers)
        except OSError as exc:
            return ReadResult(None, error=exc)
        if target.filled:
            header, _ = decode_header(view[:HEADER_SIZE])
            return ReadResult(Record(header, view[HEADER_SIZE:].toreadonly(), checksum))
        return decoded(fd, key, view, True)
    finally:
        os.close(fd)


def _read_delivering(fd: int, file_bytes: int, buf: memoryview, target: ReadTarget,
                     helpers: ThreadPoolExecutor) -> tuple[memoryview, int]:
    """Read up to `file_bytes + 1` bytes into `buf` in pieces (aligned offsets, as O_DIRECT
    wants), delivering each into the target once the first showed a matching header; returns
    the bytes read and the header's payload checksum. Sets `target.filled` when the whole
    payload was delivered and its hash is the header's."""
    want = file_bytes + 1
    view = buf[: round_up(want, ALIGN)]
    delivery = Delivery(target, file_bytes)
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


class Delivery:
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
