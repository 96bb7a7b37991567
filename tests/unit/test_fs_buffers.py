"""tiers._iobuffers.map_io_buffer: the SSD tier's O_DIRECT buffers (huge-page backed where possible)."""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import threading
from pathlib import Path

import pytest

from tiers import _fs
from tiers._iobuffers import ALIGN, HUGE_PAGE, SMALL_IO_BUFFER_BYTES, IOBuffers, map_io_buffer, round_up


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@pytest.mark.parametrize("nbytes", [SMALL_IO_BUFFER_BYTES + 1, (2 << 20) + 1, 5 << 20])
def test_buffer_is_huge_page_aligned_and_large_enough(nbytes: int) -> None:
    buf = map_io_buffer(nbytes)
    assert len(buf) >= nbytes and len(buf) % HUGE_PAGE == 0
    assert _address(buf) % HUGE_PAGE == 0
    buf[-1:] = b"\x7f"  # writable to its last byte
    assert buf[-1] == 0x7F


@pytest.mark.parametrize("nbytes", [1, 4096, 4097, (256 << 10) + 193, SMALL_IO_BUFFER_BYTES])
def test_small_buffer_is_page_aligned_and_its_own_size(nbytes: int) -> None:
    """Up to SMALL_IO_BUFFER_BYTES a buffer is a plain map of its size rounded to ALIGN (a lent
    payload pins no more than its copy would), aligned for O_DIRECT."""
    buf = map_io_buffer(nbytes)
    assert len(buf) == round_up(nbytes, ALIGN)
    assert _address(buf) % ALIGN == 0
    buf[-1:] = b"\x7f"
    assert buf[-1] == 0x7F


def test_buffers_are_private(tmp_path: Path) -> None:
    """Two buffers never share memory (a private map, not one shmem object)."""
    a, b = map_io_buffer(4096), map_io_buffer(4096)
    a[:4] = b"aaaa"
    b[:4] = b"bbbb"
    assert bytes(a[:4]) == b"aaaa" and bytes(b[:4]) == b"bbbb"


def test_pool_reuses_the_last_buffer_that_fits() -> None:
    pool = IOBuffers(max_buffers=2)
    small = pool.take(4096)
    pool.give(small)
    assert pool.take(100) is small  # reused: already faulted in
    big = pool.take(len(small) + 1)  # nothing free fits: a new one
    assert big is not small and len(big) > len(small)
    pool.give(small)
    pool.give(big)
    assert pool.take(len(small) + 1) is big
    assert pool.take(1) is small


def test_pool_keeps_at_most_max_buffers_dropping_the_smallest() -> None:
    pool = IOBuffers(max_buffers=2)
    taken = [pool.take(n) for n in (1, 3 << 20, 5 << 20)]
    for buf in taken:
        pool.give(buf)
    large = SMALL_IO_BUFFER_BYTES + 1
    kept = [pool.take(large), pool.take(large)]
    assert sorted(len(b) for b in kept) == [len(taken[1]), len(taken[2])]
    assert all(b is not taken[0] for b in kept)


def test_buffers_in_use_are_never_handed_out_twice() -> None:
    pool = IOBuffers(max_buffers=4)
    with pool.lease(4096) as a, pool.lease(4096) as b:
        assert a is not b
    with pytest.raises(ValueError, match="max_buffers"):
        IOBuffers(0)


def test_direct_round_trip_through_the_buffer(tmp_path: Path) -> None:
    """What the tier does with it: an O_DIRECT write and read of an unaligned length."""
    data = os.urandom(3 * 4096 + 100)
    path = tmp_path / "f"
    pool = IOBuffers(max_buffers=1)
    fd, _ = _fs._create(str(path), True)
    try:
        _fs._write(fd, [data[:10], memoryview(data)[10:]], len(data), True, pool)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    try:
        fd = _fs.open_for_read(str(path), direct=True)
    except OSError as exc:  # pragma: no cover - a file system that refuses even the fallback
        pytest.skip(f"cannot open: {errno.errorcode.get(exc.errno)}")
    try:
        with pool.lease(len(data) + 1) as buf:
            assert bytes(_fs.read_upto(fd, len(data) + 1, buf)) == data
    finally:
        os.close(fd)


def test_pool_keeps_recent_buffers_within_retain_bytes() -> None:
    """Beyond `max_buffers`, recently returned buffers are kept while they fit in `retain_bytes`
    (a batch of lent buffers comes back whole), the most recent first; idle ones are dropped."""
    huge = HUGE_PAGE
    pool = IOBuffers(max_buffers=1, retain_bytes=3 * huge, retain_idle_s=60.0)
    taken = [pool.take(huge) for _ in range(5)]
    for buf in taken:
        pool.give(buf)
    assert pool.free_bytes == 4 * huge  # the one always kept and three within retain_bytes
    kept = [pool.take(huge) for _ in range(4)]
    assert {id(b) for b in kept} == {id(b) for b in taken[1:]}  # the oldest extra was dropped
    for buf in kept:
        pool.give(buf)
    pool._retain_idle_s = 0.0
    pool.give(pool.take(huge))  # a give trims what has been idle since
    assert pool.free_bytes == huge


def test_pool_takes_the_smallest_buffer_that_fits() -> None:
    """Best fit; and a small request is never served from a huge-page buffer (a lent small
    payload would pin 2 MiB), a new small buffer is mapped instead."""
    pool = IOBuffers(max_buffers=4)
    large = SMALL_IO_BUFFER_BYTES + 1
    bigger, big, small = pool.take(3 * HUGE_PAGE), pool.take(large), pool.take(1)
    for buf in (small, big, bigger):
        pool.give(buf)
    assert pool.take(large) is big  # not the most recent, which is larger than needed
    assert pool.take(10) is small
    fresh = pool.take(10)
    assert fresh is not bigger and len(fresh) == ALIGN
    assert pool.take(large) is bigger


class _CollectingFreeList(list):  # type: ignore[type-arg]
    """The pool's free list, running the cyclic collector as it grows: what any allocation the
    pool makes with its lock held may do (a tuple, a sort), made certain instead of rare."""

    def append(self, item: object) -> None:
        gc.collect()
        super().append(item)


def test_a_lent_buffer_collected_while_the_pool_is_locked_comes_back_without_deadlock() -> None:
    """A lent view caught in a reference cycle (a traceback holding a staged record's payload)
    is freed by the collector, which may run inside `give` with the pool's lock held: its
    finalizer must not take the lock again (it did, and the thread hung for good, every later
    caller of the pool behind it). The buffer comes back to the pool at the next call."""
    pool = IOBuffers(max_buffers=4)
    other = pool.take(4096)
    pool._free = _CollectingFreeList()

    class Holder:
        pass

    lent = pool.lend(HUGE_PAGE)
    lent_address = _address(lent)
    holder = Holder()
    holder.view, holder.me = lent, holder  # type: ignore[attr-defined]
    del lent, holder
    done = threading.Event()
    thread = threading.Thread(target=lambda: (pool.give(other), done.set()), daemon=True)
    thread.start()
    assert done.wait(10), "give deadlocked: the lent buffer's finalizer took the pool's lock again"
    assert pool.free_bytes == len(other) + HUGE_PAGE
    assert _address(pool.take(HUGE_PAGE)) == lent_address  # the lent buffer, reused
