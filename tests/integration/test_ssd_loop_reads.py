"""SSD tier reads on the event loop (tiers/_aio.py: native AIO, no thread hop): bit-exact,
verified, quarantining what is damaged, safe under cancellation, and falling back to the
worker threads wherever the loop would have to wait or the file system cannot do them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import tiers.ssd as ssd_module
import tiers.ssd_reads as ssd_reads
from tests.integration.test_ssd_tier import assert_same, rec, record_path
from tests.proc import fds_on
from tiers._aio import AioReads, WouldBlock
from tiers._iobuffers import map_io_buffer
from tiers.ssd import SSDTier
from tiers.ssd_reads import LEND_MIN_BYTES, LOOP_READ_MAX_FILE_BYTES

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"),
                                reason="native AIO reads exist on Linux x86_64 / aarch64 only")

# Read on the loop: a small lent buffer; a copied one (huge-page sized); a lent one (huge-page sized)
LOOP_SIZES = [200_000, 700_000, LEND_MIN_BYTES + 4097]
THREAD_SIZES = [LOOP_READ_MAX_FILE_BYTES, 3 * LEND_MIN_BYTES]  # larger: on the threads, which hash in parallel


@pytest.fixture
def thread_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys read on a worker thread (a spy around the tier's thread-side read, which
    `get` and `get_many`'s shares both call)."""
    seen: list[str] = []
    real = ssd_module.read_record

    def spy(path: str, key: bytes, *args: object) -> object:
        seen.append(key.hex())
        return real(path, key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ssd_module, "read_record", spy)  # get's
    monkeypatch.setattr(ssd_reads, "read_record", spy)  # get_many's (`read_records`)
    return seen


async def loop_tier(root: Path, **kwargs: object) -> SSDTier:
    tier = await SSDTier.create(root, **kwargs)  # type: ignore[arg-type]
    assert tier._aio is not None, "native AIO is unavailable on this Linux machine"
    return tier


async def test_gets_and_get_many_read_on_the_loop(tmp_path: Path, thread_reads: list[str]) -> None:
    tier = await loop_tier(tmp_path / "ssd", max_concurrency=2)
    try:
        records = [rec(i, size) for i, size in enumerate(LOOP_SIZES + THREAD_SIZES)]
        assert await tier.put_many(records) == [True] * len(records)
        for r in records:
            assert_same(await tier.get(r.key), r)
        got = await tier.get_many([r.key for r in records] + [rec(99).key])
        for g, r in zip(got, records):
            assert_same(g, r)
        assert got[-1] is None
        large = [r.key.hex() for r in records[len(LOOP_SIZES):]]
        assert sorted(thread_reads) == sorted(large * 2)  # only the large ones, each time
        assert tier._aio.in_flight == 0
    finally:
        await tier.aclose()


async def test_damaged_records_read_on_the_loop_are_quarantined(tmp_path: Path, thread_reads: list[str]) -> None:
    """A flipped payload byte fails the checksum on the loop; a truncated file (fewer bytes
    than the index knows) goes to the thread path, which judges it as it always has."""
    root = tmp_path / "ssd"
    tier = await loop_tier(root)
    try:
        flipped, truncated, healthy = rec(1, LOOP_SIZES[1]), rec(2, LOOP_SIZES[1]), rec(3, LOOP_SIZES[0])
        assert await tier.put_many([flipped, truncated, healthy]) == [True] * 3
        path = record_path(root, flipped)
        data = bytearray(path.read_bytes())
        data[len(data) - 1000] ^= 0x40
        write_synced(path, bytes(data))  # (unsynced, this read would take a thread)
        with open(record_path(root, truncated), "r+b") as f:
            f.truncate(LOOP_SIZES[1] // 2)
        assert await tier.get(flipped.key) is None
        assert await tier.get(truncated.key) is None
        assert_same(await tier.get(healthy.key), healthy)
        quarantined = sorted(p.name for p in tier._layout.quarantine_dir.iterdir())
        assert [n.split(".")[0] for n in quarantined] == sorted(r.key.hex() for r in (flipped, truncated))
        assert thread_reads == [truncated.key.hex()]  # only the truncated one needed a thread
        assert await tier.get(flipped.key) is None and await tier.get(truncated.key) is None  # gone from the index
    finally:
        await tier.aclose()


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it: an O_DIRECT RWF_NOWAIT read of a file with dirty
    cached pages refuses (EAGAIN)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


async def test_a_cancelled_loop_read_gives_its_buffer_back_once_it_lands(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    tier = await loop_tier(root)
    try:
        records = [rec(1, LOOP_SIZES[1]), rec(2, LOOP_SIZES[0]), rec(3, LOOP_SIZES[2])]  # copied; lent; lent
        assert await tier.put_many(records) == [True] * 3
        for r in records:
            assert_same(await tier.get(r.key), r)  # the buffers exist and are free again
            path, free = record_path(root, r), tier._buffers.free_bytes
            task = asyncio.ensure_future(tier.get(r.key))
            for _ in range(100):  # until submitted: the device owns the buffer now
                if tier._aio.in_flight:
                    break
                await asyncio.sleep(0)
            assert tier._aio.in_flight, "the get did not submit its read on the loop"
            assert tier._buffers.free_bytes < free and fds_on(path) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(1000):  # the read lands; then the fd is closed and the buffer given back
                if tier._aio.in_flight == 0 and fds_on(path) == 0 and tier._buffers.free_bytes == free:
                    break
                await asyncio.sleep(0.001)
            assert (tier._aio.in_flight, fds_on(path), tier._buffers.free_bytes) == (0, 0, free)
            assert_same(await tier.get(r.key), r)
    finally:
        await tier.aclose()


async def test_loop_reads_fall_back_to_threads(tmp_path: Path, thread_reads: list[str]) -> None:
    """A context without room for another read, and a file system without RWF_NOWAIT reads
    (tmpfs), send reads to the worker threads, bit-exact."""
    tier = await loop_tier(tmp_path / "ssd", max_concurrency=2)
    try:
        records = [rec(1, LOOP_SIZES[0]), rec(2, LOOP_SIZES[1])]
        assert await tier.put_many(records) == [True, True]
        tier._aio.close()
        tier._aio = AioReads.create(depth=1)  # room for one read in flight
        got = await tier.get_many([r.key for r in records])  # two shares: the second finds no room
        for g, r in zip(got, records):
            assert_same(g, r)
        assert len(thread_reads) == 1 and tier._aio.in_flight == 0
    finally:
        await tier.aclose()
    if not os.access("/dev/shm", os.W_OK):
        return
    shm = Path("/dev/shm") / f"statestore-test-{os.getpid()}-{tmp_path.name}"
    thread_reads.clear()
    tier = await loop_tier(shm)
    try:
        records = [rec(i, size) for i, size in enumerate(LOOP_SIZES)]
        assert await tier.put_many(records) == [True] * len(records)
        for r in records:
            assert_same(await tier.get(r.key), r)
        assert tier._aio is None  # the first refusal turned loop reads off for this tier
        assert len(thread_reads) == len(records)
    finally:
        await tier.aclose()
        shutil.rmtree(shm, ignore_errors=True)


async def test_open_cached_opens_only_from_the_lookup_cache(tmp_path: Path) -> None:
    aio = AioReads.create()
    assert aio is not None
    try:
        path = tmp_path / "f"
        path.write_bytes(b"x" * 8192)
        os.close(aio.open_cached(str(path)))  # just created: cached
        missing = tmp_path / "missing"
        with pytest.raises(WouldBlock):  # never looked up: finding out would take the file system
            aio.open_cached(str(missing))
        assert not missing.exists()  # now the kernel knows it is not there
        with pytest.raises(FileNotFoundError):
            aio.open_cached(str(missing))
        try:  # as root, drop the dentry and inode caches: the open must refuse rather than wait
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("2\n")
        except OSError:
            return
        with pytest.raises(WouldBlock):
            aio.open_cached(str(path))
    finally:
        aio.close()


@contextlib.contextmanager
def reading(tmp_path: Path, nbytes: int, **create: float) -> Iterator[tuple[AioReads, memoryview, int, bytes]]:
    """A synced file of `nbytes` random bytes, opened for loop reads by a fresh context
    (`AioReads.create(**create)`), and a buffer for them: (context, buffer, fd, the bytes)."""
    path = tmp_path / "f"
    data = os.urandom(nbytes)
    write_synced(path, data)
    aio = AioReads.create(**create)  # type: ignore[arg-type]
    assert aio is not None
    fd = aio.open_cached(str(path))
    try:
        yield aio, map_io_buffer(nbytes), fd, data
    finally:
        os.close(fd)
        aio.close()


async def test_close_waits_for_the_reads_in_flight(tmp_path: Path) -> None:
    """The context (and its eventfd) goes only once the reads in flight have landed: a buffer
    is never free while the device may still write into it."""
    with reading(tmp_path, 1 << 20) as (aio, buf, fd, data):
        fut = aio.submit(fd, buf, 0)
        aio.close()
        assert aio._efd >= 0 and not aio.usable()
        with pytest.raises(WouldBlock):
            aio.submit(fd, buf, 0)
        assert await asyncio.shield(fut) == 1 << 20
        assert aio._efd == -1  # destroyed once the last read was reaped
        assert bytes(buf[: 1 << 20]) == data


@pytest.mark.parametrize("poll_s", [0.0, 0.002])
async def test_reads_land_with_and_without_polling(tmp_path: Path, poll_s: float) -> None:
    """With polling the loop looks for a lone read's completion, and stops once none or
    several are in flight; without it the eventfd alone completes them. Either way every
    byte lands."""
    with reading(tmp_path, 4 << 20, poll_s=poll_s) as (aio, buf, fd, data):
        lone = aio.submit(fd, buf[: 1 << 20], 0)
        assert (aio._polling is not None) == (poll_s > 0)  # a lone read: polled for
        assert await asyncio.shield(lone) == 1 << 20
        await asyncio.sleep(0)
        assert aio._polling is None and aio.in_flight == 0  # nothing in flight: no polling
        futs = [aio.submit(fd, buf[lo: lo + (1 << 20)], lo) for lo in range(0, 4 << 20, 1 << 20)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        if not any(f.done() for f in futs):
            assert aio._polling is None  # several in flight: the eventfd wakes the loop
        assert await asyncio.gather(*(asyncio.shield(f) for f in futs)) == [1 << 20] * 4
        assert bytes(buf[: 4 << 20]) == data
        await asyncio.sleep(0)
        assert aio._polling is None and aio.in_flight == 0


async def test_polling_gives_up_after_poll_s_and_the_eventfd_completes(tmp_path: Path) -> None:
    """A read that takes longer than poll_s: the loop stops polling (no core spent on a
    slow read) and the eventfd still completes it."""
    with reading(tmp_path, 16 << 20, poll_s=1e-6) as (aio, buf, fd, data):  # every read takes longer
        fut = aio.submit(fd, buf[: 16 << 20], 0)
        await asyncio.sleep(0)  # one look, past the deadline: polling stops
        await asyncio.sleep(0)
        assert aio._polling is None and not fut.done()
        assert await asyncio.shield(fut) == 16 << 20
        assert bytes(buf[: 16 << 20]) == data


async def test_after_waits_for_the_read_not_the_cancelled_future(tmp_path: Path) -> None:
    """Cancelling the wait cancels the future at once, but the device still owns the buffer:
    `after`'s clean-up runs when the read lands, once."""
    cleaned: list[int] = []
    with reading(tmp_path, 16 << 20) as (aio, buf, fd, _):
        fut = aio.submit(fd, buf[: 16 << 20], 0)
        fut.cancel()
        aio.after(fut, lambda: cleaned.append(aio.in_flight))
        assert cleaned == [] and aio.in_flight == 1  # a 16 MiB read takes milliseconds
        for _ in range(5000):
            if cleaned:
                break
            await asyncio.sleep(0.001)
        assert cleaned == [0]  # run once, after the read left the context
        aio.after(fut, lambda: cleaned.append(-1))  # landed already: at once
        assert cleaned == [0, -1]


async def test_no_polling_while_the_tiers_threads_have_work(tmp_path: Path) -> None:
    """A loop read beside work on the tier's own threads waits for the eventfd: a spinning
    loop would hold the GIL those threads need back after each system call."""
    import threading

    tier = await loop_tier(tmp_path / "ssd")
    try:
        r = rec(1, LOOP_SIZES[0])
        assert await tier.put(r)
        release = threading.Event()
        job = tier._run(release.wait, 5)  # a worker busy (as with a put's write)
        try:
            got = asyncio.ensure_future(tier.get(r.key))
            for _ in range(100):
                if tier._aio.in_flight:
                    break
                await asyncio.sleep(0)
            assert tier._aio.in_flight == 1 and tier._aio._polling is None
            assert_same(await got, r)
        finally:
            release.set()
            await job
        got = asyncio.ensure_future(tier.get(r.key))  # the threads idle again: polled
        for _ in range(100):
            if tier._aio.in_flight:
                break
            await asyncio.sleep(0)
        assert tier._aio.in_flight == 1 and tier._aio._polling is not None
        assert_same(await got, r)
    finally:
        await tier.aclose()
