"""Aligned I/O buffers for the SSD tier's O_DIRECT reads and writes (`tiers._fs`, `tiers.ssd`):
how one is mapped (huge pages where the kernel gives them, `map_io_buffer`) and the pool the
tier's threads share (`IOBuffers`), whose buffers can also be lent out as a record's payload
and come back by themselves once the payload is dropped."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import threading
import time
import weakref
from collections.abc import Iterator

ALIGN = 4096  # O_DIRECT alignment of buffer, offset and length on every device we target


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) PMD size: what MADV_HUGEPAGE asks for
# Buffers up to this size are plain page-aligned maps of their own size (rounded to ALIGN), not
# huge pages: one O_DIRECT request of up to ~512 KiB is not split even over scattered 4 KiB
# pages (`map_io_buffer`), and a record's read buffer lent as its payload (`IOBuffers.lend`)
# then pins what a copy of the payload would, not a 2 MiB huge page.
SMALL_IO_BUFFER_BYTES = 512 << 10


def map_io_buffer(nbytes: int) -> memoryview:
    """A writable buffer of `nbytes` for O_DIRECT I/O, 2 MiB-aligned and backed by huge pages
    where the kernel gives them (transparent huge pages in `madvise` or `always` mode).

    Why: an O_DIRECT request is split where the buffer's pages are not physically contiguous.
    Scattered 4 KiB pages cap a request at ~512 KiB on the development VM's virtio disk, whose
    host serves requests one at a time, so a 32 MiB read took 60-64 requests and 18-26 ms;
    into huge pages it takes 8 (max_sectors_kb 4096) and ~8.5 ms, and reads of 1-4 MiB gain
    alike. The map is private: a shared anonymous map (`mmap.mmap(-1, n)`'s default) is shmem,
    which `madvise(MADV_HUGEPAGE)` does not turn into huge pages. Where huge pages are not
    available the buffer is an ordinary page-aligned map, as before.
    """
    if nbytes <= SMALL_IO_BUFFER_BYTES:
        return memoryview(private_map(round_up(max(nbytes, 1), ALIGN)))
    size = round_up(nbytes, HUGE_PAGE)
    whole = private_map(size + HUGE_PAGE)
    start = -address_of(whole) % HUGE_PAGE
    advise_huge_pages(whole, start, size)
    return memoryview(whole)[start: start + size]


def private_map(nbytes: int) -> mmap.mmap:
    """A private anonymous map of `nbytes`: one that transparent huge pages can back (a shared
    anonymous map, `mmap.mmap(-1, n)`'s default, is shmem)."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)


def advise_huge_pages(buf: mmap.mmap, start: int = 0, length: int = 0) -> None:
    """Ask for transparent huge pages behind `buf[start:start + length]` (0: to the end); a
    kernel without them keeps ordinary pages."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, start, length or len(buf) - start)
        except OSError:
            pass


def address_of(buf: mmap.mmap | memoryview) -> int:
    """The address of a writable buffer's first byte (the export is released before returning)."""
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


class IOBuffers:
    """Aligned I/O buffers (`map_io_buffer`) shared by the threads of one SSD tier.

    A thread takes a buffer for one operation and gives it back: the smallest free buffer that
    is large enough is reused (its pages are already faulted in), the most recently returned
    of equals. Shared rather than one per thread: each first touch of a 32 MiB huge-page buffer
    costs ~40 ms of page zeroing, and with a buffer per thread a tier of 8 threads paid it 8
    times over its first operations (a 32 MiB chunk put through the server took ~100 ms
    instead of ~20 ms until every thread had its own).

    How many free buffers are kept: always the `max_buffers` largest, and beyond them, while
    their bytes stay within `retain_bytes`, those returned within the last `retain_idle_s`
    seconds (trimmed at a `give`: after a burst the pool holds its extra buffers until the
    next operation returns one). Why the second allowance: a lent
    buffer (`lend`) stays out for as long as its caller holds the payload, so a batch of gets
    holds one per record, and a pool of `max_buffers` mapped and faulted in most of them anew
    for every batch (32 x 1 MiB records at queue depth 4 on the development VM: 0.53 of the
    O_DIRECT reference with 4 kept, 0.80 with all of them kept).
    """

    def __init__(self, max_buffers: int, retain_bytes: int = 0, retain_idle_s: float = 1.0) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        if retain_bytes < 0:
            raise ValueError(f"retain_bytes must be >= 0, got {retain_bytes}")
        self._max_buffers = max_buffers
        self._retain_bytes = retain_bytes
        self._retain_idle_s = retain_idle_s
        self._free: list[tuple[memoryview, float]] = []  # (buffer, when returned), most recent last
        self._free_bytes = 0
        self._lock = threading.Lock()
        # Lent buffers come back here, without the lock (`_returned_by_finalizer`).
        self._returned: collections.deque[tuple[memoryview, float]] = collections.deque()

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers kept free (mapped, faulted in, not in use)."""
        with self._lock:
            self._admit_returned()
            return self._free_bytes

    def take(self, nbytes: int) -> memoryview:
        """A buffer of at least `nbytes` for this caller alone, until `give`; a small one
        (`SMALL_IO_BUFFER_BYTES`) is never served from a huge-page buffer (it may be lent)."""
        limit = SMALL_IO_BUFFER_BYTES if nbytes <= SMALL_IO_BUFFER_BYTES else 1 << 62  # small: its own kind
        with self._lock:
            self._admit_returned()
            free = self._free
            best = -1
            for i in range(len(free) - 1, -1, -1):
                size = len(free[i][0])
                if nbytes <= size <= limit and (best < 0 or size < len(free[best][0])):
                    best = i
                    if size - nbytes < HUGE_PAGE:  # no smaller one can fit
                        break
            if best >= 0:
                buf = free.pop(best)[0]
                self._free_bytes -= len(buf)
                return buf
        return map_io_buffer(nbytes)

    def give(self, buf: memoryview) -> None:
        """Return a buffer from `take`; those beyond what the pool keeps (class docstring)
        are dropped, the smallest first (unmapped once no view of them is left)."""
        now = time.monotonic()
        with self._lock:
            self._admit_returned()
            free = self._free
            free.append((buf, now))
            self._free_bytes += len(buf)
            if len(free) > self._max_buffers and (self._free_bytes > self._retain_bytes
                                                  or now - free[0][1] > self._retain_idle_s):
                self._trim(now)  # (else all of them are kept: skip the sort)

    def _returned_by_finalizer(self, buf: memoryview) -> None:
        """A lent buffer's finalizer: queue it for the next `take`/`give` to admit. Never the
        lock: the collector runs finalizers at any allocation, also one made while this very
        thread holds the lock inside `give` or `take`, where acquiring it again would deadlock
        the thread (and with it every later caller of the pool)."""
        self._returned.append((buf, time.monotonic()))

    def _admit_returned(self) -> None:
        """With the lock held: move the buffers lent ones' finalizers queued into the free
        list (a finalizer running meanwhile only appends; popleft takes each once)."""
        returned = self._returned
        while returned:
            item = returned.popleft()
            self._free.append(item)
            self._free_bytes += len(item[0])

    def _trim(self, now: float) -> None:
        """With the lock held, more than `max_buffers` free: keep the `max_buffers` largest
        (the most recent of equals), and of the others those returned within `retain_idle_s`, the most recent first, while
        their bytes fit in `retain_bytes`."""
        free = self._free
        core = set(sorted(range(len(free)), key=lambda i: (len(free[i][0]), i), reverse=True)[: self._max_buffers])
        room = self._retain_bytes
        keep = []
        for i in range(len(free) - 1, -1, -1):
            buf, returned = free[i]
            if i in core:
                keep.append(free[i])
            elif now - returned <= self._retain_idle_s and len(buf) <= room:
                room -= len(buf)
                keep.append(free[i])
        keep.reverse()
        self._free = keep
        self._free_bytes = sum(len(buf) for buf, _ in keep)

    @contextlib.contextmanager
    def lease(self, nbytes: int) -> Iterator[memoryview]:
        buf = self.take(nbytes)
        try:
            yield buf
        finally:
            self.give(buf)

    def lend(self, nbytes: int) -> memoryview:
        """A buffer of at least `nbytes` that comes back to the pool by itself, once the
        returned view and every view derived from it (slices, `toreadonly()`) are gone.

        For a record read whose payload is handed out as a view of the buffer (no copy out,
        no allocation per read: a fresh 32 MiB allocation on a worker thread's malloc arena
        is a new map, and faulting it in cost ~90 ms per get on the development VM). The
        views hold a ctypes array over the buffer; its finalizer gives the buffer back.
        """
        buf = self.take(nbytes)
        anchor = (ctypes.c_char * len(buf)).from_buffer(buf)  # sizes are 2 MiB multiples: few ctypes types
        weakref.finalize(anchor, self._returned_by_finalizer, buf)
        return memoryview(anchor).cast("B")
