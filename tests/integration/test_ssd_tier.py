"""SSD tier: restart, damage detection and quarantine, leftovers, budget, write failures, kill -9."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import logging
import mmap
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.proc import fds_on, freeze
from tiers._fs import read_header
from tiers._iobuffers import ALIGN, round_up
from tiers.record import HEADER_SIZE, Record, RecordError, RecordHeader, decode_record, encode_record, make_record
from tiers import _fs
from tiers.ssd import INDEX_ENTRY_BYTES, SSDTier
from tiers.ssd_reads import LEND_MIN_BYTES, SMALL_LEND_MIN_BYTES

CHILD = Path(__file__).with_name("ssd_writer_child.py")


def rec(i: int, size: int = 64, *, kind: int = 1) -> Record:
    block_key = hashlib.sha256(f"ssd-{i}".encode()).digest()
    return make_record(kind, 1, hashlib.shake_256(block_key + bytes([kind])).digest(size),
                       model_fingerprint=b"F" * 16, tenant_id=b"T" * 16, block_key=block_key,
                       token_start=256 * i, token_end=256 * (i + 1))


def as_built(header: RecordHeader) -> RecordHeader:
    return dataclasses.replace(header, stored_length=0, flags=0)


def assert_same(got: Record | None, want: Record, *, same_time: bool = True) -> None:
    """Bit-exact payload and header (`same_time=False`: a rebuilt record has a new created_at)."""
    assert got is not None
    expected = want.header if same_time else dataclasses.replace(want.header, created_at_ns=got.header.created_at_ns)
    assert got.payload == want.payload and as_built(got.header) == expected


def files_under(root: Path) -> list[str]:
    """Every file below root except the lock and the empty spares, as paths relative to root."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.name != ".lock" and not (p.parent.name == "spares" and p.stat().st_size == 0))


def record_path(root: Path, record: Record) -> Path:
    key = record.key
    return root / f"{key[2]:02x}" / f"{key[3]:02x}" / f"{key.hex()}.rec"


@pytest.fixture
async def tier(tmp_path: Path):
    t = await SSDTier.create(tmp_path / "ssd")
    yield t
    await t.aclose()


async def refilled(tier: SSDTier) -> SSDTier:
    """The tier once the spare refill in flight (from open, or started by a claim) is done."""
    while tier._refill_task is not None and not tier._refill_task.done():
        await asyncio.sleep(0.001)
    return tier


def refuse_o_direct_at_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that refuses O_DIRECT when a file is opened (EINVAL)."""
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, flags, *a, **kw: (_ for _ in ()).throw(
        OSError(errno.EINVAL, "no O_DIRECT")) if flags & os.O_DIRECT else real_open(p, flags, *a, **kw))


def refuse_o_direct_writes_after_the_first(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A file system that accepts O_DIRECT at open but refuses the second and later pwrites
    (EINVAL); returns the offsets of the pwrites tried."""
    real_pwrite, calls = os.pwrite, []

    def pwrite_then_refuse(fd: int, data: object, offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.EINVAL, "O_DIRECT write refused")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", pwrite_then_refuse)
    return calls


async def reopen(t: SSDTier, **kwargs: object) -> SSDTier:
    await t.aclose()
    return await SSDTier.create(t._layout.root, **kwargs)  # type: ignore[arg-type]


async def test_layout_is_two_level_fanout_of_the_block_key(tier: SSDTier) -> None:
    record = rec(1)
    await tier.put(record)
    root = tier._layout.root
    assert files_under(root) == [str(record_path(root, record).relative_to(root))]
    assert record_path(root, record).stat().st_size == HEADER_SIZE + 64
    assert tier.footprint(record) == 4096 + INDEX_ENTRY_BYTES


async def test_restart_serves_everything_acknowledged(tier: SSDTier) -> None:
    records = [rec(i, size, kind=1 + i % 3) for i, size in enumerate([0, 1, 4096, 5000, 300_000, 1 << 20, 3 << 20])]
    assert await tier.put_many(records) == [True] * len(records)
    assert await tier.delete(records[0].key)
    usage_before = tier.usage()
    tier = await reopen(tier)
    try:
        assert tier.last_scan is not None and tier.last_scan.discarded == []
        assert sorted(h.key for h in tier.last_scan.headers) == sorted(r.key for r in records[1:])
        assert tier.usage() == usage_before
        assert await tier.get(records[0].key) is None
        for record in records[1:]:
            assert_same(await tier.get(record.key), record)
    finally:
        await tier.aclose()


async def test_second_tier_on_the_same_directory_is_refused(tier: SSDTier) -> None:
    with pytest.raises(RuntimeError, match="is in use by another SSDTier"):
        await SSDTier.create(tier._layout.root)


async def test_payload_bit_flip_is_caught_at_get_and_quarantined(tier: SSDTier,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    good, bad = rec(1, 10_000), rec(2, 10_000)
    await tier.put_many([good, bad])
    path = record_path(tier._layout.root, bad)
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 1234)
        byte = f.read(1)[0]
        f.seek(HEADER_SIZE + 1234)
        f.write(bytes([byte ^ 0x04]))
    with caplog.at_level(logging.WARNING, logger="tiers.ssd"):
        assert await tier.get(bad.key) is None
    assert "payload checksum mismatch" in caplog.text and "quarantined" in caplog.text
    assert not path.exists()
    assert [p.name.split(".")[0] for p in (tier._layout.root / "quarantine").iterdir()] == [bad.key.hex()]
    assert await tier.contains([good.key, bad.key]) == [True, False]
    assert tier.usage().resident_bytes == tier.footprint(good)
    assert_same(await tier.get(good.key), good)
    tier = await reopen(tier)
    try:
        assert tier.last_scan.discarded == [] and await tier.get(bad.key) is None
    finally:
        await tier.aclose()


@pytest.mark.parametrize(("damage", "reason"), [
    ("header_flip", "header checksum mismatch: the header is corrupt (quarantined)"),
    ("magic", "bad magic b'XSR\\x01': not a statestore record (quarantined)"),
    ("truncate_payload", f"file is {HEADER_SIZE + 4000} bytes but the header says {HEADER_SIZE + 5000} (quarantined)"),
    ("truncate_header", f"truncated header: 100 of {HEADER_SIZE} bytes (quarantined)"),
    ("append", f"file is {HEADER_SIZE + 5001} bytes but the header says {HEADER_SIZE + 5000} (quarantined)"),
])
async def test_damage_is_caught_at_scan_and_quarantined(tier: SSDTier, damage: str, reason: str) -> None:
    good, bad = rec(1, 5000), rec(2, 5000)
    await tier.put_many([good, bad])
    path = record_path(tier._layout.root, bad)
    data = bytearray(path.read_bytes())
    if damage == "header_flip":
        data[50] ^= 0x01
    elif damage == "magic":
        data[0] = ord("X")
    elif damage == "truncate_payload":
        data = data[: HEADER_SIZE + 4000]
    elif damage == "truncate_header":
        data = data[:100]
    else:
        data += b"\0"
    path.write_bytes(data)
    tier = await reopen(tier, index_snapshot=False)  # in place: only a walk of every header sees it at open
    try:
        rel = path.relative_to(tier._layout.root)
        assert tier.last_scan.discarded == [f"{rel}: {reason}"]
        assert await tier.contains([good.key, bad.key]) == [True, False]
        assert await tier.get(bad.key) is None
        assert_same(await tier.get(good.key), good)
        assert len(list((tier._layout.root / "quarantine").iterdir())) == 1
        assert tier.usage().num_records == 1
    finally:
        await tier.aclose()


async def test_truncation_while_open_is_caught_at_get(tier: SSDTier) -> None:
    record = rec(1, 8000)
    await tier.put(record)
    path = record_path(tier._layout.root, record)
    os.truncate(path, HEADER_SIZE + 10)
    assert await tier.get(record.key) is None
    assert not path.exists() and await tier.contains([record.key]) == [False]


async def test_foreign_and_misplaced_files_are_quarantined(tier: SSDTier) -> None:
    a, b = rec(1), rec(2)
    await tier.put(a)
    root = tier._layout.root
    misplaced = record_path(root, b)
    misplaced.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(record_path(root, a), misplaced)  # a's bytes under b's name
    stray = record_path(root, a).with_name("notes.txt")
    stray.write_text("hello")
    tier = await reopen(tier)
    try:
        assert sorted(tier.last_scan.discarded) == sorted([
            f"{misplaced.relative_to(root)}: header key does not match the file name (quarantined)",
            f"{stray.relative_to(root)}: unexpected file name or directory (quarantined)",
        ])
        assert await tier.contains([a.key, b.key]) == [True, False]
    finally:
        await tier.aclose()


async def test_reindex_right_after_open_answers_from_opens_scan_without_a_second_walk(tier: SSDTier) -> None:
    """A store indexing a freshly opened tier gets open's scan (headers and discards); after
    that, or once anything changed, reindex walks the disk again."""
    kept, gone = rec(1), rec(2)
    await tier.put(kept)
    await tier.put(gone)
    leftover = record_path(tier._layout.root, kept).with_name(rec(9).key.hex() + ".rec.x7.tmp")
    leftover.write_bytes(b"half a record")
    tier = await reopen(tier)
    try:
        assert len(tier.last_scan.discarded) == 1
        record_path(tier._layout.root, gone).unlink()  # behind the tier's back: only a walk sees it
        first = await tier.reindex()
        assert sorted(h.key for h in first.headers) == sorted([kept.key, gone.key])  # no walk
        assert first.discarded == tier.last_scan.discarded  # open's discards, reported to the store
        second = await tier.reindex()
        assert [h.key for h in second.headers] == [kept.key] and second.discarded == []  # walked
        fresh = await reopen(tier)
        tier = fresh
        await tier.put(rec(3))  # a change since open: the snapshot is no longer what a walk would give
        assert sorted(h.key for h in (await tier.reindex()).headers) == sorted([kept.key, rec(3).key])
    finally:
        await tier.aclose()


async def test_leftover_temp_files_are_removed_at_scan(tier: SSDTier) -> None:
    record = rec(1)
    await tier.put(record)
    final = record_path(tier._layout.root, record)
    leftovers = [final.with_name(final.name + ".dead01.tmp"), final.with_name(rec(9).key.hex() + ".rec.x7.tmp")]
    for p in leftovers:
        p.write_bytes(b"half a record")
    tier = await reopen(tier)
    try:
        root = tier._layout.root
        assert sorted(tier.last_scan.discarded) == sorted(
            f"{p.relative_to(root)}: leftover temp file of an unacknowledged put (removed)" for p in leftovers)
        assert files_under(root) == [str(final.relative_to(root))]
        assert_same(await tier.get(record.key), record)
    finally:
        await tier.aclose()


async def test_budget_refusal_writes_nothing(tmp_path: Path) -> None:
    first, second = rec(1, 10_000), rec(2, 10_000)
    probe = SSDTier(tmp_path / "probe")
    budget = probe.footprint(first) + probe.footprint(second) - 1
    tier = await SSDTier.create(tmp_path / "ssd", budget_bytes=budget)
    try:
        assert await tier.put(first) is True
        files, usage = files_under(tier._layout.root), tier.usage()
        assert await tier.put(second) is False
        assert files_under(tier._layout.root) == files and tier.usage() == usage
        assert await tier.contains([second.key]) == [False]
        # Overwriting in place only needs the difference: the old version's bytes are freed.
        assert await tier.put(rec(1, 9_000)) is True
        assert tier.usage().fill == pytest.approx(tier.footprint(rec(1, 9_000)) / budget)
    finally:
        await tier.aclose()


async def test_write_failure_leaves_no_half_file(tier: SSDTier, caplog: pytest.LogCaptureFixture) -> None:
    """A write the file system refuses (EFBIG here; ENOSPC takes the same path) is a clean False."""
    small, big = rec(1, 100), rec(2, 8 << 20)
    await tier.put(small)
    usage = tier.usage()
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, old_limit[1]))
    try:
        with caplog.at_level(logging.WARNING, logger="tiers.ssd"):
            assert await tier.put(big) is False
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert "refused by the file system" in caplog.text
    root = tier._layout.root
    assert files_under(root) == [str(record_path(root, small).relative_to(root))]
    assert tier.usage() == usage and await tier.contains([big.key]) == [False]
    # Replacing an acknowledged record goes through a temp file: a failed overwrite
    # leaves the old version whole and served.
    bigger_small = make_record(1, 1, bytes(8 << 20), model_fingerprint=b"F" * 16, tenant_id=b"T" * 16,
                               block_key=small.header.block_key)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, old_limit[1]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        assert await tier.put(bigger_small) is False
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert files_under(root) == [str(record_path(root, small).relative_to(root))]
    assert_same(await tier.get(small.key), small)
    assert await tier.put(big) is True  # and the tier still works afterwards


async def test_put_many_reports_each_record_and_keeps_going_after_a_failure(tier: SSDTier) -> None:
    """put_many writes shares of the batch per thread call: a record the file system refuses
    is False on its own, the others (new keys and a replacement) are stored and indexed."""
    old = rec(3, 500)
    await tier.put(old)
    batch = [rec(1, 100), rec(2, 8 << 20), make_record(1, 1, b"new" * 300, model_fingerprint=b"F" * 16,
                                                         tenant_id=b"T" * 16, block_key=old.header.block_key),
             rec(4, 300_000), rec(5, 2 << 20)]
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, old_limit[1]))
    try:
        assert await tier.put_many(batch) == [True, False, True, True, True]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    root = tier._layout.root
    stored = [batch[i] for i in (0, 2, 3, 4)]
    assert files_under(root) == sorted(str(record_path(root, r).relative_to(root)) for r in stored)
    assert tier.usage().resident_bytes == sum(tier.footprint(r) for r in stored)
    for r in stored:
        assert_same(await tier.get(r.key), r)
    assert await tier.contains([batch[1].key]) == [False]
    # A batch that repeats a key goes record by record: one consistent record remains.
    again = [rec(6, 1000), make_record(1, 1, b"x" * 10, model_fingerprint=b"F" * 16, tenant_id=b"T" * 16,
                                       block_key=rec(6).header.block_key)]
    assert await tier.put_many(again) == [True, True]
    got = await tier.get(again[0].key)
    assert got is not None and got.payload in {again[0].payload, again[1].payload}


async def test_new_key_over_an_unindexed_file_replaces_it_atomically(tier: SSDTier) -> None:
    """A new key is written in place with O_EXCL; if a file the index does not know already
    holds its name, the put falls back to temp file + rename and replaces it whole."""
    record = rec(1, 300_000)
    stray = record_path(tier._layout.root, record)
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"not a record")
    assert await tier.contains([record.key]) == [False]
    assert await tier.put(record) is True
    root = tier._layout.root
    assert files_under(root) == [str(stray.relative_to(root))]
    assert stray.stat().st_size == HEADER_SIZE + 300_000
    assert_same(await tier.get(record.key), record)


@pytest.mark.parametrize("direct_io_min_bytes", [0, None], ids=["o_direct", "buffered"])
async def test_unaligned_sizes_round_trip_through_both_write_paths(tmp_path: Path,
                                                                   direct_io_min_bytes: int | None) -> None:
    tier = await SSDTier.create(tmp_path / "ssd", direct_io_min_bytes=direct_io_min_bytes,
                                direct_write_min_bytes=direct_io_min_bytes)
    try:
        records = [rec(i, size) for i, size in enumerate([0, 1, 4096 - HEADER_SIZE, 4097, 1_000_003])]
        assert await tier.put_many(records) == [True] * len(records)
        for r in records:
            assert record_path(tier._layout.root, r).stat().st_size == HEADER_SIZE + len(r.payload)
            assert_same(await tier.get(r.key), r)
    finally:
        await tier.aclose()


def resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache: mincore(2) over a read-only map of
    it (mapping touches no page)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(addr, size, pages) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(page & 1 for page in pages)


def test_write_mode_by_size() -> None:
    """Below `direct_write_min_bytes` a record is written through the page cache, and from
    `direct_io_min_bytes` (read with O_DIRECT) its pages are dropped once it is durable."""
    tier = SSDTier("/nonexistent", direct_io_min_bytes=128 << 10, direct_write_min_bytes=512 << 10)
    assert [tier.write_mode(n) for n in (4096, (128 << 10) - 1, 128 << 10, (512 << 10) - 1, 512 << 10, 32 << 20)] == [
        (False, False), (False, False), (False, True), (False, True), (True, False), (True, False)]
    never = SSDTier("/nonexistent", direct_io_min_bytes=None)
    assert {never.write_mode(n) for n in (4096, 1 << 20, 32 << 20)} == {(False, False)}
    buffered = SSDTier("/nonexistent", direct_write_min_bytes=None)
    assert [buffered.write_mode(n) for n in (4096, 1 << 20)] == [(False, False), (False, True)]
    low = SSDTier("/nonexistent", direct_io_min_bytes=1 << 20, direct_write_min_bytes=0)  # writes: never below reads
    assert [low.write_mode(n) for n in (4096, 1 << 20)] == [(False, False), (True, False)]
    for bad in ({"direct_io_min_bytes": -1}, {"direct_write_min_bytes": -4096}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SSDTier("/nonexistent", **bad)  # type: ignore[arg-type]


async def test_buffered_writes_of_records_read_with_o_direct_leave_no_pages_cached(tmp_path: Path) -> None:
    """A 256 KiB record is written through the page cache and fdatasynced; its pages are then
    dropped (the tier reads it with O_DIRECT: they would only be a second copy). A small record,
    read through the page cache, keeps them. Both read back whole, also after a reopen."""
    tier = await SSDTier.create(tmp_path / "ssd")
    try:
        small, mid, new_key_in_place = rec(1, 16 << 10), rec(2, 256 << 10), rec(3, 200 << 10)
        assert tier.write_mode(HEADER_SIZE + len(mid.payload)) == (False, True)
        assert await tier.put(small) and await tier.put(mid)
        assert resident_pages(record_path(tier._layout.root, mid)) == 0
        assert resident_pages(record_path(tier._layout.root, small)) > 0
        replaced = rec(2, 256 << 10)  # the same key again: temp file, rename (`write_durable`)
        replaced = dataclasses.replace(replaced, payload=bytes(reversed(bytes(replaced.payload))), checksum=None)
        assert await tier.put(replaced)
        assert resident_pages(record_path(tier._layout.root, replaced)) == 0
        tier._spares.ready.clear()  # no spare left: a new key is written in place (`write_new`)
        assert await tier.put(new_key_in_place)
        assert resident_pages(record_path(tier._layout.root, new_key_in_place)) == 0
        for r in (small, replaced, new_key_in_place):
            assert_same(await tier.get(r.key), r)
        tier = await reopen(tier)
        for r in (small, replaced, new_key_in_place):
            assert_same(await tier.get(r.key), r)
    finally:
        await tier.aclose()


async def test_zstd_kinds_compress_only_what_pays(tmp_path: Path) -> None:
    tier = await SSDTier.create(tmp_path / "ssd", zstd_kinds={1: 3})
    try:
        zeros = make_record(1, 0, bytes(100_000), model_fingerprint=b"F" * 16, tenant_id=b"T" * 16,
                            block_key=b"z" * 32)
        noise, other_kind = rec(1, 100_000), rec(2, 100_000, kind=2)
        for r in (zeros, noise, other_kind):
            before = tier.usage().resident_bytes
            assert await tier.put(r)
            assert tier.usage().resident_bytes - before == tier.footprint(r)
            assert_same(await tier.get(r.key), r)
        root = tier._layout.root
        assert record_path(root, zeros).stat().st_size < 1000
        assert record_path(root, noise).stat().st_size == HEADER_SIZE + 100_000
    finally:
        await tier.aclose()
    assert SSDTier(tmp_path / "x")._zstd_kinds == {}  # default: nothing is compressed


async def test_concurrent_puts_of_one_key_leave_one_consistent_record(tier: SSDTier) -> None:
    versions = [make_record(1, 0, bytes([v]) * (1000 * (v + 1)), model_fingerprint=b"F" * 16,
                            tenant_id=b"T" * 16, block_key=b"k" * 32) for v in range(6)]
    assert await asyncio.gather(*(tier.put(v) for v in versions)) == [True] * 6
    got = await tier.get(versions[0].key)
    assert got is not None and got.payload in {v.payload for v in versions}
    assert tier.usage().num_records == 1
    assert tier.usage().resident_bytes == tier.footprint(got)
    assert len(files_under(tier._layout.root)) == 1


async def test_scan_waits_for_puts_in_flight(tier: SSDTier) -> None:
    records = [rec(i, 200_000) for i in range(6)]
    puts = asyncio.gather(*(tier.put(r) for r in records))
    await asyncio.sleep(0)
    result = await tier.scan()
    assert await puts == [True] * 6
    assert result.discarded == []  # no in-flight temp file was mistaken for a leftover
    assert await tier.contains([r.key for r in records]) == [True] * 6


async def test_spare_refill_waits_for_the_puts_to_pause(tmp_path: Path) -> None:
    """Below half the pool a refill is due, but it runs once puts pause (its creates and
    directory fsync would otherwise slow the puts' fdatasyncs); at a quarter it runs at once."""
    tier = await refilled(await SSDTier.create(tmp_path / "ssd", spare_files=32))
    try:
        assert tier.spare_files == 32
        # 32 -> 12: below half (refill due), above a quarter (not urgent).
        assert await tier.put_many([rec(i, 100) for i in range(20)]) == [True] * 20
        assert tier._spares.refilling and tier.spare_files == 12
        tier._puts_in_flight = 1  # as if another put were running: the refill keeps waiting
        await asyncio.sleep(0.05)
        assert tier._spares.refilling and tier.spare_files == 12
        tier._puts_in_flight = 0
        await refilled(tier)
        assert tier.spare_files == 32
        tier._spares.ready.clear()  # a burst that emptied it: urgent, no wait
        tier._puts_in_flight = 1  # as if a put were still running
        tier._start_refill()
        await refilled(tier)
        assert tier.spare_files == 32
        tier._puts_in_flight = 0
    finally:
        await tier.aclose()


async def test_use_before_open_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not open"):
        await SSDTier(tmp_path / "ssd").put(rec(1))


async def test_new_keys_claim_spares_and_the_pool_refills_in_the_background(tmp_path: Path) -> None:
    """A new key's put takes a spare (its name already durable) and renames it to the
    record's name; once half the pool is claimed a refill tops it up; spares cost 0 bytes."""
    tier = await refilled(await SSDTier.create(tmp_path / "ssd", spare_files=8))
    try:
        spares = tier._layout.root / "spares"
        assert tier.spare_files == 8 and len(list(spares.iterdir())) == 8
        assert tier.usage().resident_bytes == 0 and tier.usage().num_records == 0
        made = sorted(spares.iterdir())
        records = [rec(i, size) for i, size in enumerate([10, 5000, 300_000])]
        for r in records:
            assert await tier.put(r)
        assert tier.spare_files == 5  # three claimed, above half the pool: no refill yet
        assert sorted(spares.iterdir()) == made[3:]  # claimed in creation order, renamed away
        fourth, batch = rec(3, 1 << 20), [rec(i, 100) for i in range(4, 10)]
        await tier.put(fourth)  # the fourth leaves half: refill in the background
        assert await tier.put_many(batch) == [True] * 6
        await refilled(tier)
        assert tier.spare_files == len(list(spares.iterdir())) <= 8
        assert all(p.stat().st_size == 0 for p in spares.iterdir())
        stored = records + [fourth] + batch
        root = tier._layout.root
        assert files_under(root) == sorted(str(record_path(root, r).relative_to(root)) for r in stored)
        assert tier.usage().resident_bytes == sum(tier.footprint(r) for r in stored)
        for r in stored:
            assert_same(await tier.get(r.key), r)
        # A key the index holds keeps the temp + rename protocol: no spare is taken.
        before, newer = tier.spare_files, rec(1, 7000)
        await tier.put(newer)
        assert tier.spare_files == before
        assert_same(await tier.get(newer.key), newer)
    finally:
        await tier.aclose()


async def test_a_spare_put_makes_its_directory_without_syncing_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A new key written through a spare creates its directory with no directory fsync (the
    record is durable in the spare; the scan moves it back if the rename is lost); a put that
    writes under the final name in that directory later fsyncs it into its top first. Both
    records are served again after a restart."""
    tier = await refilled(await SSDTier.create(tmp_path / "ssd", spare_files=8))
    root = tier._layout.root
    synced: list[Path] = []
    real = _fs.fsync_dir

    def spy(path: Path | str) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(_fs, "fsync_dir", spy)
    first = rec(0, 5000)
    newer = make_record(1, 1, b"v2" * 3000, model_fingerprint=b"F" * 16, tenant_id=b"T" * 16,
                        block_key=first.header.block_key)
    try:
        assert await tier.put(first)
        directory = record_path(root, first).parent
        assert directory.is_dir() and synced == []  # one claim of eight: no refill either
        assert await tier.put(newer)  # the key is held: temp file, rename, directory fsync
        assert synced.index(directory.parent) < synced.index(directory)
    finally:
        await tier.aclose()
    tier = await SSDTier.create(root, spare_files=8)
    try:
        assert_same(await tier.get(first.key), newer)
    finally:
        await tier.aclose()


async def test_the_pool_grows_while_bursts_drain_it(tmp_path: Path) -> None:
    """It starts small (a tier that sees few new keys keeps few spares) and doubles, up to
    spare_files, each time claims bring it down to a quarter; a put that finds it empty
    writes in place; every put is stored either way."""
    tier = await refilled(await SSDTier.create(tmp_path / "ssd", spare_files=128))
    try:
        assert tier.spare_files == 32
        burst = [rec(i, 100) for i in range(40)]
        assert await tier.put_many(burst) == [True] * 40  # 32 through spares, 8 in place
        await refilled(tier)
        assert tier._spares.target == 64
        while tier.spare_files < 64:  # the refill started before the growth tops up the rest
            await asyncio.sleep(0.001)
            tier._start_refill() if not tier._spares.refilling else None
        more = [rec(i, 100) for i in range(40, 200)]
        assert await tier.put_many(more) == [True] * 160
        await refilled(tier)
        assert tier._spares.target == 128  # and no further: spare_files is the limit
        for r in burst + more:
            assert_same(await tier.get(r.key), r)
    finally:
        await tier.aclose()


async def test_without_spares_new_keys_are_written_in_place(tmp_path: Path) -> None:
    """spare_files=0 (or an empty pool): a new key is written under its name with O_EXCL
    and its directory fsynced; the same records, the same files."""
    tier = await SSDTier.create(tmp_path / "ssd", spare_files=0)
    try:
        records = [rec(i, size) for i, size in enumerate([10, 300_000, 1 << 20])]
        assert await tier.put_many(records) == [True] * 3
        one = rec(5, 100)
        assert await tier.put(one)
        root = tier._layout.root
        assert tier.spare_files == 0 and list((root / "spares").iterdir()) == []
        stored = records + [one]
        assert files_under(root) == sorted(str(record_path(root, r).relative_to(root)) for r in stored)
        for r in stored:
            assert_same(await tier.get(r.key), r)
    finally:
        await tier.aclose()
    with pytest.raises(ValueError, match="spare_files"):
        SSDTier(tmp_path / "x", spare_files=-1)


async def test_spares_left_by_a_crash_are_reused_recovered_or_quarantined(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """What a crash can leave in spares/, one of each, then a restart:
    - claimed but unwritten (empty): a spare again, reused, never reported;
    - a whole record (fdatasynced, the rename not on disk): moved to its name and served,
      over an older version under that name (the spare's is the newer put);
    - a torn record (killed mid-write, never acknowledged): quarantined and reported;
    and the pool is topped up to its target, not past it."""
    tier = await refilled(await SSDTier.create(tmp_path / "ssd", spare_files=4))
    root = tier._layout.root
    old, kept = rec(1, 5000), rec(2, 300)
    assert await tier.put(old) and await tier.put(kept)
    await tier.aclose()
    spares = root / "spares"
    for p in spares.iterdir():
        p.unlink()
    (spares / "a1.spare").write_bytes(b"")  # claimed, nothing written
    whole_new, whole_newer = rec(3, 300_000), make_record(1, 1, b"v2" * 4000, model_fingerprint=b"F" * 16,
                                                          tenant_id=b"T" * 16, block_key=old.header.block_key)
    from tiers.record import encode_record
    (spares / "a2.spare").write_bytes(encode_record(whole_new))
    (spares / "a3.spare").write_bytes(encode_record(whole_newer))
    torn = encode_record(rec(4, 300_000))
    (spares / "a4.spare").write_bytes(torn[: 8192])
    (spares / "stray").write_bytes(b"?")
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    (spares / "a5.spare").symlink_to(outside)  # never written through
    with caplog.at_level(logging.INFO, logger="tiers.ssd"):
        tier = await refilled(await SSDTier.create(root, spare_files=4))
    try:
        assert sorted(tier.last_scan.discarded) == [
            f"spares/a4.spare: file is 8192 bytes but the header says {len(torn)} (quarantined)",
            "spares/a5.spare: unexpected file in the spares directory (quarantined)",
            "spares/stray: unexpected file in the spares directory (quarantined)"]
        assert "a2.spare ->" in caplog.text and "a3.spare ->" in caplog.text
        assert sorted(h.key for h in tier.last_scan.headers) == sorted([old.key, kept.key, whole_new.key])
        assert_same(await tier.get(whole_new.key), whole_new)
        assert_same(await tier.get(old.key), whole_newer)
        assert_same(await tier.get(kept.key), kept)
        assert files_under(root) == sorted(
            [str(record_path(root, r).relative_to(root)) for r in (old, kept, whole_new)]
            + [f"quarantine/{p.name}" for p in (root / "quarantine").iterdir()])
        assert (spares / "a1.spare").exists()  # reused, not replaced
        assert tier.spare_files == len(list(spares.iterdir())) == 4
        assert tier.usage().resident_bytes == sum(tier.footprint(r) for r in (whole_newer, kept, whole_new))
        await tier.put(rec(5, 100))
        assert not (spares / "a1.spare").exists()  # the oldest spare is claimed first
        # A spare removed behind the tier's back: the put writes in place instead.
        next_spare = Path(tier._spares.ready[0])
        next_spare.unlink()
        late = rec(6, 300_000)
        assert await tier.put(late)
        assert_same(await tier.get(late.key), late)
        assert outside.read_bytes() == b""
    finally:
        await tier.aclose()


def _stop_while_writing(pid: int, root: Path, attempts: int = 200) -> list[str]:
    """SIGSTOP the child; keep it stopped only if a put is caught half-done on disk.

    The child counts as stopped once every thread is in the stopped state (T), none still
    inside a system call (D): a stopped thread issues no further system call, so what is
    on disk then is exactly what a SIGKILL at that instant leaves behind. Returns the torn
    files seen then (`_torn_files`), or [] if no attempt caught one.
    """
    for _ in range(attempts):
        stopped = freeze(pid, timeout_s=5, poll_s=0.001, allow_disk_wait=False)
        if stopped and (torn := _torn_files(root, headers_only=True)):
            return torn
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.002)
    return []


def _torn_files(root: Path, *, headers_only: bool = False) -> list[str]:
    """Temp files, and record files and non-empty spares that do not hold a whole valid
    record, relative to root.

    `headers_only`: judge a record file by its header and size alone (cheap enough to run
    while the child is stopped; with no write in progress, a file of the size its valid
    header announces holds every byte that was written). Else decode it whole."""
    torn = []
    for path in root.rglob("*"):
        if path.parent.name == "quarantine" or not path.is_file():
            continue
        if path.name.endswith(".tmp"):
            torn.append(str(path.relative_to(root)))
        elif path.name.endswith(".rec") or path.name.endswith(".spare") and path.stat().st_size:
            try:
                if headers_only:
                    read_header(path)
                else:
                    decode_record(path.read_bytes())
            except RecordError:
                torn.append(str(path.relative_to(root)))
    return sorted(torn)


@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_sigkill_mid_stream_loses_no_acknowledged_record(tmp_path: Path) -> None:
    """A SIGKILL that lands while puts are half-done on disk: every acknowledged record is
    served bit-exactly after a restart, and nothing torn is ever indexed or served.

    Every key the child writes is new, so its puts write into spares (`tiers._fs.write_spare`)
    or, while the pool is being refilled, in place under the final name (`write_new`): the
    torn files are spares or `.rec` files, which the scan quarantines (a temp file, from a
    put replacing a key, would be removed instead). A spare caught holding a whole record
    (written, not yet renamed) is not torn: the scan moves it to its name and serves it."""
    sys.path.insert(0, str(CHILD.parent))
    from ssd_writer_child import child_block_key, child_record

    root, num_records, kill_after = tmp_path / "ssd", 1000, 24
    proc = subprocess.Popen([sys.executable, str(CHILD), str(root), str(num_records), "4"],
                            stdout=subprocess.PIPE, text=True)
    acked: list[int] = []
    try:
        assert proc.stdout is not None
        while len(acked) < kill_after:
            line = proc.stdout.readline()
            assert line, f"child exited early with {proc.wait()} after {acked}"
            acked.append(int(line))
        torn_at_stop = _stop_while_writing(proc.pid, root)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        acked += [int(x) for x in proc.stdout.read().split()]  # acks already in the pipe
    finally:
        proc.kill()
        proc.wait()
    assert torn_at_stop, "never caught the child with a put half-done on disk"
    assert len(acked) < num_records, "the child finished before the kill"
    torn = _torn_files(root)
    assert torn == torn_at_stop  # the stopped child changed nothing more before it died
    assert all(t.endswith(".rec") or t.startswith("spares/") for t in torn)  # new keys: no temp files

    async def check() -> None:
        tier = await SSDTier.create(root)
        try:
            scan = tier.last_scan
            assert scan is not None
            # Exactly the torn files are discarded: temp files removed, torn records quarantined.
            assert sorted(line.split(": ", 1)[0] for line in scan.discarded) == torn
            for line in scan.discarded:
                assert line.endswith(" (removed)" if line.split(": ", 1)[0].endswith(".tmp") else " (quarantined)")
            assert _torn_files(root) == []
            assert len(list((root / "quarantine").iterdir())) == len(torn)
            assert all(p.stat().st_size == 0 for p in (root / "spares").iterdir())  # whole ones were moved
            for i in acked:
                assert_same(await tier.get(child_record(i).key), child_record(i), same_time=False)
            index_of = {child_block_key(i): i for i in range(num_records)}
            assert len(scan.headers) >= len(acked)
            for header in scan.headers:  # whatever else completed is whole, never torn
                assert_same(await tier.get(header.key), child_record(index_of[header.block_key]), same_time=False)
        finally:
            await tier.aclose()

    asyncio.run(check())


@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_sigkill_while_records_are_deleted_and_recycled(tmp_path: Path) -> None:
    """A SIGKILL in a stream of puts and deletes (a full cache: each put followed by the delete
    of the record put 8 before, whose file, when large, becomes a recycled spare that a later put
    writes over). After a restart: every acknowledged put not deleted is served bit-exactly; a
    large record whose delete was acknowledged never comes back (its header was zeroed durably
    before its file could be reused); whatever is indexed is whole."""
    sys.path.insert(0, str(CHILD.parent))
    from ssd_writer_child import child_block_key, child_record

    root, num_records, kill_after, churn = tmp_path / "ssd", 2000, 80, 8
    proc = subprocess.Popen([sys.executable, str(CHILD), str(root), str(num_records), "4", str(churn)],
                            stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        while sum(1 for line in lines if line.startswith("D ")) < kill_after:
            line = proc.stdout.readline()
            assert line, f"child exited early with {proc.wait()}"
            lines.append(line.strip())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        lines += proc.stdout.read().splitlines()  # acks already in the pipe
    finally:
        proc.kill()
        proc.wait()
    acked = {int(x) for x in lines if x.isdigit()}
    asked_deleted = {int(x[2:]) for x in lines if x.startswith("d ")}
    deleted = {int(x[2:]) for x in lines if x.startswith("D ")}
    large = {i for i in deleted if len(child_record(i).payload) >= 128 << 10}
    assert len(acked) < num_records and large

    async def check() -> None:
        tier = await SSDTier.create(root)
        try:
            scan = tier.last_scan
            assert scan is not None
            for i in acked - asked_deleted:
                assert_same(await tier.get(child_record(i).key), child_record(i), same_time=False)
            for i in large:
                assert await tier.get(child_record(i).key) is None, f"deleted record {i} came back"
            index_of = {child_block_key(i): i for i in range(num_records)}
            for header in scan.headers:  # anything else indexed (a small delete lost, a put not acked) is whole
                assert_same(await tier.get(header.key), child_record(index_of[header.block_key]), same_time=False)
            assert all(line.endswith("(quarantined)") or line.endswith("(removed)") for line in scan.discarded)
            assert tier.usage().reserve_bytes > 0  # recycled spares survived as such
        finally:
            await tier.aclose()

    asyncio.run(check())


@pytest.fixture
def fs_dirs(tmp_path: Path) -> Iterator[list[Path]]:
    """The test's own directory, and a tmpfs one where the machine has /dev/shm (O_DIRECT is
    refused there by older kernels: the buffered fallback), removed afterwards (it is RAM)."""
    dirs = [tmp_path]
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        dirs.append(Path(tempfile.mkdtemp(dir="/dev/shm", prefix="ssd-test-")))
    yield dirs
    for extra in dirs[1:]:
        shutil.rmtree(extra, ignore_errors=True)


@pytest.mark.parametrize("where", ["tmp_path", "tmpfs"])
async def test_large_get_lends_its_read_buffer_and_takes_it_back(fs_dirs: list[Path], where: str) -> None:
    """A get of a record >= LEND_MIN_BYTES, or of one from SMALL_LEND_MIN_BYTES whose buffer is a
    small one, returns the payload as a read-only view of the pooled buffer it was read into; the
    buffer serves the next get only once that view is gone. Records between (their buffer would be
    a 2 MiB huge page) and below are copied."""
    dirs = fs_dirs
    if where == "tmpfs" and len(dirs) < 2:
        pytest.skip("no writable /dev/shm")
    root = dirs[-1] if where == "tmpfs" else dirs[0]
    tier = await SSDTier.create(root / "ssd", max_concurrency=1)
    try:
        big = [rec(i, LEND_MIN_BYTES + 4097 * i) for i in range(3)]
        small = rec(9, 300_000)  # a small buffer of its own size: lent too
        middle = rec(10, 700_000)  # its buffer would be a huge page: a copy
        tiny = rec(11, SMALL_LEND_MIN_BYTES - HEADER_SIZE - 1)  # below the lending size: a copy
        assert await tier.put_many([*big, small, middle, tiny]) == [True] * 6
        got = await tier.get(big[0].key)
        assert isinstance(got.payload, memoryview) and got.payload.readonly
        assert_same(got, big[0])
        assert got.checksum is not None
        in_use = ctypes.addressof(got.payload.obj)  # the buffer it was read into
        other = await tier.get(big[1].key)  # the first one is still held: another buffer
        other_buffer = ctypes.addressof(other.payload.obj)
        assert other_buffer != in_use
        assert_same(other, big[1])
        assert bytes(got.payload) == big[0].payload  # not overwritten by the second read
        del got, other
        again = await tier.get(big[2].key)  # both buffers are back: the last one given back serves
        assert ctypes.addressof(again.payload.obj) in (in_use, other_buffer)  # reused, not a new map
        assert_same(again, big[2])
        got_small = await tier.get(small.key)
        assert isinstance(got_small.payload, memoryview) and got_small.payload.readonly
        assert len(got_small.payload.obj) == round_up(HEADER_SIZE + 300_000 + 1, ALIGN)  # not 2 MiB
        assert_same(got_small, small)
        assert isinstance((await tier.get(middle.key)).payload, bytes)
        assert isinstance((await tier.get(tiny.key)).payload, bytes)
        del again, got_small
        many = await tier.get_many([r.key for r in big] + [small.key, middle.key, tiny.key])  # one buffer per lent record
        assert [isinstance(g.payload, memoryview) for g in many] == [True, True, True, True, False, False]
        assert len({ctypes.addressof(g.payload.obj) for g in many[:4]}) == 4
        for g, want in zip(many, [*big, small, middle, tiny]):
            assert_same(g, want)
    finally:
        await tier.aclose()
        if where == "tmpfs":
            shutil.rmtree(root, ignore_errors=True)


async def test_large_get_of_a_corrupt_record_is_a_miss_and_quarantined(tmp_path: Path) -> None:
    tier = await SSDTier.create(tmp_path / "ssd")
    try:
        bad = rec(1, 2 * LEND_MIN_BYTES)
        await tier.put(bad)
        path = record_path(tier._layout.root, bad)
        with open(path, "r+b") as f:
            f.seek(HEADER_SIZE + LEND_MIN_BYTES + 77)
            byte = f.read(1)[0]
            f.seek(HEADER_SIZE + LEND_MIN_BYTES + 77)
            f.write(bytes([byte ^ 0x10]))
            f.flush()
            os.fsync(f.fileno())
        assert await tier.get(bad.key) is None
        assert not path.exists() and await tier.contains([bad.key]) == [False]
    finally:
        await tier.aclose()


async def test_a_file_system_refusing_o_direct_gets_buffered_io(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where open(O_DIRECT) fails with EINVAL (tmpfs before Linux 6.6, some overlays), puts and
    gets of large records go buffered, through the same pooled buffers, bit-exact."""
    real_open = os.open
    refused: list[str] = []

    def open_without_direct(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_DIRECT:
            refused.append(str(path))
            raise OSError(errno.EINVAL, "O_DIRECT refused", str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", open_without_direct)
    # (loop_reads=False: reads on the event loop open through openat2, which the patch misses;
    # test_loop_reads_fall_back_to_threads covers their own refusals)
    tier = await SSDTier.create(tmp_path / "ssd", loop_reads=False)
    try:
        records = [rec(1, 600_000), rec(2, 2 * LEND_MIN_BYTES + 5)]  # both written with O_DIRECT by default
        assert await tier.put_many(records) == [True, True]
        for r in records:
            assert_same(await tier.get(r.key), r)
        assert len(refused) >= 4  # two writes and two reads asked for O_DIRECT
        # A buffered write into a recycled spare a few bytes longer: truncated to the record.
        assert await tier.delete(records[0].key)
        shorter = rec(3, 600_000 - 100)
        assert await tier.put(shorter) and tier.usage().reserve_bytes == 0
        assert_same(await tier.get(shorter.key), shorter)
        tier = await reopen(tier)
        assert tier.last_scan.discarded == []
        assert_same(await tier.get(shorter.key), shorter)
    finally:
        await tier.aclose()


@pytest.mark.parametrize("size", [300_000, 2 * LEND_MIN_BYTES + 5, 4 * LEND_MIN_BYTES])
async def test_a_staged_record_is_written_from_its_buffer_bit_exactly(tmp_path: Path, size: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A record assembled in `SSDTier.staging` is written from that buffer as it lies (no lease
    of another aligned buffer, no copy of the payload): the file is the record's encoding, the
    stale bytes past it in the buffer never reach the disk, a restart and a get read it back;
    once the context closes the same payload is an ordinary view and is copied as any other."""
    tier = await SSDTier.create(tmp_path / "ssd", max_concurrency=1)
    leases: list[int] = []
    real_lease = tier._buffers.lease

    def counting_lease(nbytes: int):  # type: ignore[no-untyped-def]
        leases.append(nbytes)
        return real_lease(nbytes)

    monkeypatch.setattr(tier._buffers, "lease", counting_lease)
    want = rec(1, size)
    try:
        with tier.staging(size) as staged:
            staged.buf[:] = b"\xee" * len(staged.buf)  # stale bytes from an earlier use of the buffer
            staged.dest[:] = want.payload
            record = Record(want.header, staged.payload, want.checksum)
            assert tier._staged_for(record) is staged
            assert tier._staged_for(Record(want.header, want.payload)) is None  # equal bytes, not staged
            assert await tier.put(record)
            assert leases == []  # written from the staged buffer
        assert tier._staged_for(record) is None and not tier._staged
        assert record_path(tier._layout.root, want).read_bytes() == encode_record(want)
        assert_same(await tier.get(want.key), want)
        leases.clear()
        assert await tier.put(Record(want.header, staged.payload, want.checksum))  # after the context: a copy
        direct, _ = tier.write_mode(HEADER_SIZE + size)  # (a buffered write takes the payload as it is)
        assert len(leases) == (1 if direct else 0)
        tier = await reopen(tier)
        assert_same(await tier.get(want.key), want)
    finally:
        await tier.aclose()


async def test_a_failed_staged_write_leaves_nothing(tier: SSDTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged put whose O_DIRECT write fails is refused (False), leaves no file and no index
    entry, and the buffer is released with the context."""
    want = rec(2, 2 * LEND_MIN_BYTES)
    real_write = os.write

    def failing_write(fd: int, data: object) -> int:
        raise OSError(errno.EIO, "injected write error")

    with tier.staging(len(want.payload)) as staged:
        staged.dest[:] = want.payload
        monkeypatch.setattr(os, "write", failing_write)
        assert not await tier.put(Record(want.header, staged.payload, want.checksum))
        monkeypatch.setattr(os, "write", real_write)
    assert not tier._staged and await tier.contains([want.key]) == [False]
    assert files_under(tier._layout.root) == []


@pytest.mark.parametrize("loop_reads", [True, False], ids=["on-the-loop", "on-threads"])
async def test_a_get_delivers_into_a_registered_target_while_it_reads(tmp_path: Path, loop_reads: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`reading_into`: a get of a large record copies its payload into the target as it reads
    (filled, bit-exact, the record returned as usual); a record of another tenant is not
    copied at all; a corrupt one leaves the target unfilled and is quarantined; small records,
    a second target for a key already targeted and gets after the context are not delivered.
    Both ways of reading: native AIO on the event loop (`_read_into_on_loop`, where the kernel
    has it) and pieces on a thread (`tiers.ssd_reads.read_record_into`)."""
    from tiers.ssd_reads import DELIVER_MIN_BYTES, READ_PIECE_BYTES, READ_WINDOW

    import tiers.ssd as ssd_module

    on_threads: list[bytes] = []  # keys the thread path read (a spy: it still reads them)

    def read_record_into(path: str, key: bytes, *args: object) -> object:
        on_threads.append(key)
        return real(path, key, *args)

    real = ssd_module.read_record_into
    monkeypatch.setattr(ssd_module, "read_record_into", read_record_into)
    tier = await SSDTier.create(tmp_path / "ssd", loop_reads=loop_reads)
    try:
        big = rec(1, (READ_WINDOW + 2) * READ_PIECE_BYTES + 12345)
        await _deliveries(tier, big, DELIVER_MIN_BYTES, READ_PIECE_BYTES)
        if tier._aio is not None:  # every delivering get was read on the loop
            assert on_threads == []
        elif not loop_reads:
            assert big.key in on_threads
    finally:
        await tier.aclose()


async def _deliveries(tier: SSDTier, big: Record, deliver_min_bytes: int, piece_bytes: int) -> None:
    small = rec(2, deliver_min_bytes // 2)
    assert await tier.put_many([big, small]) == [True, True]
    dest = bytearray(len(big.payload))
    with tier.reading_into(big.key, memoryview(dest), b"T" * 16) as target:
        with tier.reading_into(big.key, memoryview(bytearray(len(big.payload)))) as second:
            assert_same(await tier.get(big.key), big)
    assert target.filled and bytes(dest) == big.payload and not second.filled and not tier._targets
    other = bytearray(len(big.payload))
    with tier.reading_into(big.key, memoryview(other), b"U" * 16) as target:  # another tenant asks
        assert_same(await tier.get(big.key), big)  # the tier serves the record; the store checks the tenant
    assert not target.filled and other == bytearray(len(big.payload))  # nothing of it was copied
    with tier.reading_into(small.key, memoryview(bytearray(len(small.payload)))) as target:
        assert_same(await tier.get(small.key), small)
    assert not target.filled
    path = record_path(tier._layout.root, big)
    last_piece = len(big.payload) // piece_bytes * piece_bytes
    with open(path, "r+b") as f:  # a flipped bit in the last piece
        f.seek(last_piece + 100)
        byte = f.read(1)[0]
        f.seek(last_piece + 100)
        f.write(bytes([byte ^ 0x04]))
    with tier.reading_into(big.key, memoryview(bytearray(len(big.payload)))) as target:
        assert await tier.get(big.key) is None
    assert not target.filled and not path.exists() and await tier.contains([big.key]) == [False]


async def test_a_delivering_get_on_the_loop_falls_back_or_stops_cleanly(tmp_path: Path) -> None:
    """The loop's delivering read (`_read_into_on_loop`): a file shorter than the index says is
    left to the thread path, which quarantines it; a get cancelled while its pieces are in flight
    writes nothing into the target once the cancellation has returned, and leaves no descriptor
    open; the next get of the record is delivered whole."""
    from tiers.ssd_reads import READ_PIECE_BYTES, READ_WINDOW

    tier = await SSDTier.create(tmp_path / "ssd")
    try:
        if tier._aio is None:
            pytest.skip("no native AIO on this kernel: the thread path is the only one")
        short, big = rec(1, 3 * READ_PIECE_BYTES), rec(2, (2 * READ_WINDOW + 1) * READ_PIECE_BYTES)
        assert await tier.put_many([short, big]) == [True, True]
        os.truncate(record_path(tier._layout.root, short), HEADER_SIZE + READ_PIECE_BYTES + 4096)
        with tier.reading_into(short.key, memoryview(bytearray(len(short.payload)))) as target:
            assert await tier.get(short.key) is None
        assert not target.filled and await tier.contains([short.key]) == [False]

        dest = bytearray(len(big.payload))
        for delay in (0.0, 0.001, 0.003):
            with tier.reading_into(big.key, memoryview(dest)) as target:
                task = asyncio.create_task(tier.get(big.key))
                await asyncio.sleep(delay)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            snapshot = bytes(dest)
            await asyncio.sleep(0.05)  # anything still copying would show here
            assert bytes(dest) == snapshot
        await asyncio.sleep(0.05)
        assert fds_on(record_path(tier._layout.root, big)) == 0  # (not a count of all: spare refills open files)
        dest[:] = bytes(len(dest))
        with tier.reading_into(big.key, memoryview(dest)) as target:
            assert_same(await tier.get(big.key), big)
        assert target.filled and bytes(dest) == big.payload
    finally:
        await tier.aclose()


@pytest.mark.parametrize("batch", [False, True])
async def test_a_put_cancelled_during_its_write_leaves_the_index_saying_what_the_disk_holds(
        tmp_path: Path, batch: bool) -> None:
    """A caller that gives up (a client gone, a timeout) while its put's write is on a worker
    thread: the write cannot be stopped, so the cancellation is raised once it has ended, with
    what it wrote whole indexed. Before, the put returned at once and the thread went on: the
    file landed unindexed (invisible, outside the budget, a record that came back at the next
    restart even after the key was deleted), its key's lock already released to the next put."""
    tier = await SSDTier.create(tmp_path / "ssd")
    records = [rec(40, 6 << 20), rec(41, 3 << 20)] if batch else [rec(40, 6 << 20)]
    try:
        task = asyncio.create_task(tier.put_many(records) if batch else tier.put(records[0]))
        while tier._workers.in_flight == 0:  # the write is on its thread
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await tier.contains([r.key for r in records]) == [True] * len(records)
        for r in records:
            assert record_path(tier._layout.root, r).exists()
            assert_same(await tier.get(r.key), r)
        assert tier.usage().resident_bytes == sum(tier.footprint(r) for r in records)
        for r in records:
            await tier.delete(r.key)
        tier = await reopen(tier)
        assert await tier.contains([r.key for r in records]) == [False] * len(records)
    finally:
        await tier.aclose()


@pytest.mark.parametrize("path", ["direct", "buffered", "zstd"])
async def test_a_deferred_fill_is_copied_by_the_write_and_verified_before_it_is_visible(
        tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Staged.defer_fill`: the put copies the payload from its source while it writes (O_DIRECT
    in pieces, the header piece last), or whole before a buffered or compressed write; a source
    that does not match the checksum fails the put with RecordError and leaves no file, no index
    entry; an intact one is stored bit-exactly and survives a restart."""
    from tiers._fs import WRITE_PIECE_BYTES

    if path == "buffered":  # a file system refusing O_DIRECT at open
        refuse_o_direct_at_open(monkeypatch)
    kind = 5 if path == "zstd" else 1
    tier = await SSDTier.create(tmp_path / "ssd", zstd_kinds={5: 1} if path == "zstd" else None)
    want = rec(1, 2 * WRITE_PIECE_BYTES + 4321, kind=kind)
    try:
        source = bytearray(want.payload)
        source[WRITE_PIECE_BYTES + 99] ^= 0x20  # corrupt in the second piece
        with tier.staging(len(want.payload)) as staged:
            staged.defer_fill([memoryview(source)], want.payload_sum())
            assert staged.pending
            with pytest.raises(RecordError, match="payload checksum mismatch"):
                await tier.put(Record(want.header, staged.payload, want.payload_sum()))
        assert await tier.contains([want.key]) == [False] and files_under(tier._layout.root) == []
        with tier.staging(len(want.payload)) as staged:
            staged.defer_fill([memoryview(bytearray(want.payload))], want.payload_sum())
            assert await tier.put(Record(want.header, staged.payload, want.payload_sum()))
            assert not staged.pending and bytes(staged.payload) == want.payload
        assert_same(await tier.get(want.key), want)
        if path != "zstd":
            assert record_path(tier._layout.root, want).read_bytes() == encode_record(want)
        tier = await reopen(tier, zstd_kinds={5: 1} if path == "zstd" else None)
        assert_same(await tier.get(want.key), want)
    finally:
        await tier.aclose()


@pytest.mark.parametrize("path", ["direct", "buffered", "zstd", "refused-midway"])
async def test_a_deferred_fill_can_take_the_checksum_itself(tmp_path: Path, path: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A deferred fill given no checksum (a client left it to the server): the fill takes it over
    the bytes it copies from its sources (here a head and a body apart, as a slot and lent
    memory), and the header written last carries it, on every write path (O_DIRECT pieces,
    buffered, compressed, O_DIRECT refused midway); the record verifies on reads, after a
    restart too, and the file is the record encoded."""
    from tiers._fs import WRITE_PIECE_BYTES

    if path == "buffered":
        refuse_o_direct_at_open(monkeypatch)
    if path == "refused-midway":
        refuse_o_direct_writes_after_the_first(monkeypatch)
    kind = 5 if path == "zstd" else 1
    zstd = {5: 1} if path == "zstd" else None
    tier = await SSDTier.create(tmp_path / "ssd", zstd_kinds=zstd)
    want = rec(4, 2 * WRITE_PIECE_BYTES + 999, kind=kind)
    try:
        payload = memoryview(bytearray(want.payload))
        with tier.staging(len(want.payload)) as staged:
            staged.defer_fill([payload[:777], payload[777:]], None)
            assert staged.pending and staged.checksum is None
            assert await tier.put(Record(want.header, staged.payload, None))
            assert not staged.pending and staged.checksum == want.payload_sum()
        assert_same(await tier.get(want.key), want)
        if path != "zstd":
            assert record_path(tier._layout.root, want).read_bytes() == encode_record(want)
        monkeypatch.undo()
        tier = await reopen(tier, zstd_kinds=zstd)
        assert_same(await tier.get(want.key), want)
    finally:
        await tier.aclose()


async def test_a_deferred_fill_survives_o_direct_refused_at_write_time(tier: SSDTier,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that accepts O_DIRECT at open but refuses the writes (EINVAL) midway
    through a deferred fill: the write starts again buffered with the whole payload copied and
    verified first, and the record is stored bit-exactly."""
    from tiers._fs import WRITE_PIECE_BYTES

    want = rec(3, 3 * WRITE_PIECE_BYTES + 777)
    calls = refuse_o_direct_writes_after_the_first(monkeypatch)
    with tier.staging(len(want.payload)) as staged:
        staged.defer_fill([memoryview(bytearray(want.payload))], want.payload_sum())
        assert await tier.put(Record(want.header, staged.payload, want.payload_sum()))
        assert not staged.pending
    monkeypatch.undo()
    assert len(calls) >= 2
    assert record_path(tier._layout.root, want).read_bytes() == encode_record(want)
    assert_same(await tier.get(want.key), want)


@pytest.mark.parametrize("carried", [False, True], ids=["hashed-by-the-write", "checksum-carried"])
@pytest.mark.parametrize("pieces", [True, False], ids=["in-pieces", "one-pass"])
async def test_a_large_put_is_written_in_pieces_and_stored_bit_exactly(tier: SSDTier, carried: bool,
                                                                       pieces: bool) -> None:
    """A record of PIECEWISE_MIN_BYTES or more (not staged) is copied into the aligned buffer and
    written piece by piece (`tiers._fs.Piecewise`), hashed by that copy when the record carries
    no checksum (its header block written last, once the checksum is known); a smaller O_DIRECT
    one without a checksum is hashed by its copy and written whole: the file is the record's
    encoding, byte for byte, and it reads back and survives a restart."""
    from tiers.ssd import PIECEWISE_MIN_BYTES

    built = rec(7, PIECEWISE_MIN_BYTES + 3 * 4096 + 55 if pieces else (1 << 20) + 55)
    want = Record(built.header, built.payload, built.payload_sum()) if carried else built
    assert await tier.put(want)
    assert record_path(tier._layout.root, want).read_bytes() == encode_record(want)
    assert_same(await tier.get(want.key), want)
    tier = await reopen(tier)
    try:
        assert_same(await tier.get(want.key), want)
        newer = Record(want.header, bytes(b ^ 0x5A for b in want.payload[:4096]) + want.payload[4096:])
        assert await tier.put(newer)  # a key the index holds: a temp file, written in pieces too
        assert record_path(tier._layout.root, newer).read_bytes() == encode_record(newer)
        assert_same(await tier.get(want.key), newer)
    finally:
        await tier.aclose()


async def test_a_large_put_refused_o_direct_midway_is_written_buffered(tier: SSDTier,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT refused (EINVAL) after the first piece of a piecewise put: the write starts
    again buffered, the header made from a hash of the whole payload, and the record is stored
    bit-exactly; a piece that fails otherwise (EIO) fails the put and leaves nothing."""
    from tiers.ssd import PIECEWISE_MIN_BYTES

    want, failing = rec(8, PIECEWISE_MIN_BYTES + 4097), rec(9, PIECEWISE_MIN_BYTES + 1)
    real_pwrite = os.pwrite
    calls: list[int] = []

    def pwrite_then_refuse(fd: int, data: object, offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.EINVAL if calls[0] != -1 else errno.EIO, "O_DIRECT write refused")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", pwrite_then_refuse)
    assert await tier.put(want)
    assert len(calls) >= 2
    calls[:] = [-1]
    assert not await tier.put(failing)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert record_path(tier._layout.root, want).read_bytes() == encode_record(want)
    assert_same(await tier.get(want.key), want)
    assert await tier.contains([failing.key]) == [False]
    assert files_under(tier._layout.root) == [str(record_path(tier._layout.root, want).relative_to(tier._layout.root))]


# ----- recycled spares ---------------------------------------------------------------------------


def assert_recycled(tier: SSDTier, count: int) -> None:
    """`count` recycled spares are claimable as soon as the deletes return."""
    assert sum(len(p) for p in tier._recycled.ready.values()) == count, tier._recycled


async def test_a_deleted_records_file_is_overwritten_by_the_next_record_of_its_size(tier: SSDTier) -> None:
    """The file (inode, blocks) of a deleted O_DIRECT-sized record is kept as a recycled
    spare and taken by the next new record whose file takes as many blocks; other sizes never
    get it."""
    first, other_size = rec(1, 300_000), rec(2, 200_000)
    assert await tier.put(first)
    inode = record_path(tier._layout.root, first).stat().st_ino
    assert await tier.delete(first.key)
    assert_recycled(tier, 1)
    assert tier.usage().reserve_bytes == round_up(HEADER_SIZE + 300_000, 4096)
    assert await tier.get(first.key) is None
    assert await tier.put(other_size)
    assert record_path(tier._layout.root, other_size).stat().st_ino != inode
    same_size = rec(3, 300_000 - 100)  # a few bytes shorter: the same blocks, truncated to its size
    assert await tier.put(same_size)
    assert record_path(tier._layout.root, same_size).stat().st_ino == inode
    assert tier.usage().reserve_bytes == 0
    assert_same(await tier.get(same_size.key), same_size)
    assert_same(await tier.get(other_size.key), other_size)
    tier = await reopen(tier)  # what was written over the old blocks is durable and whole
    try:
        assert_same(await tier.get(same_size.key), same_size)
        assert tier.last_scan.discarded == []
    finally:
        await tier.aclose()


async def test_a_recycled_spare_never_brings_its_record_back_and_is_reused_after_a_restart(tmp_path: Path) -> None:
    """Restart with two recycled spares: neither record comes back, nothing is reported as
    damaged, both are recycled spares again."""
    tier = await SSDTier.create(tmp_path / "ssd")
    records = [rec(i, 150_000) for i in range(2)]
    assert all([await tier.put(r) for r in records])
    for r in records:
        assert await tier.delete(r.key)
    tier = await reopen(tier)
    try:
        assert tier.last_scan.headers == [] and tier.last_scan.discarded == []
        assert [await tier.get(r.key) for r in records] == [None, None]
        assert tier.usage().reserve_bytes == 2 * round_up(HEADER_SIZE + 150_000, 4096)
        again = rec(7, 150_000)
        assert await tier.put(again)
        assert tier.usage().reserve_bytes == round_up(HEADER_SIZE + 150_000, 4096)
        assert_same(await tier.get(again.key), again)
    finally:
        await tier.aclose()


async def test_a_whole_record_in_a_recycled_spare_is_recovered_at_scan(tmp_path: Path) -> None:
    """A put into a recycled spare that was fdatasynced but whose rename did not reach the
    disk (acknowledged): the scan moves it to its name. One torn before its header block was
    written stays a recycled spare; one torn after it (a new header over old payload bytes, at
    the old file's size) fails its payload checksum at the scan and is quarantined."""
    tier = await SSDTier.create(tmp_path / "ssd")
    size = 300_000
    victims = [rec(i, size) for i in range(3)]
    assert all([await tier.put(r) for r in victims])
    for r in victims:
        assert await tier.delete(r.key)
    assert_recycled(tier, 3)
    spares = sorted(p for paths in tier._recycled.ready.values() for p in paths)
    await tier.aclose()
    acknowledged, torn_late = rec(10, size), rec(11, size)
    encoded = encode_record(acknowledged)
    with open(spares[0], "r+b") as f:  # the whole new record, as a write_spare before its rename
        f.write(encoded)
    with open(spares[1], "r+b") as f:  # torn before the header block: payload only
        f.seek(4096)
        f.write(encode_record(torn_late)[4096:100_000])
    with open(spares[2], "r+b") as f:  # torn after it: header and the start of the payload
        f.write(encode_record(torn_late)[:100_000])
    tier = await SSDTier.create(tmp_path / "ssd")
    try:
        assert [line.split(": ", 1)[0] for line in tier.last_scan.discarded] == [
            str(Path(spares[2]).relative_to(tier._layout.root))]
        assert "checksum" in tier.last_scan.discarded[0] and tier.last_scan.discarded[0].endswith("(quarantined)")
        assert [h.key for h in tier.last_scan.headers] == [acknowledged.key]
        assert_same(await tier.get(acknowledged.key), acknowledged)
        assert await tier.get(torn_late.key) is None
        assert len(list((tier._layout.root / "quarantine").iterdir())) == 1
        assert tier.usage().reserve_bytes == round_up(HEADER_SIZE + size, 4096)
    finally:
        await tier.aclose()


async def test_recycled_spares_count_against_the_budget_and_give_way_to_a_put(tmp_path: Path) -> None:
    """Records plus recycled spares stay within the budget; a put of another size that needs
    their room gets it (they are unlinked), where it would otherwise be refused."""
    size = 150_000
    footprint = round_up(HEADER_SIZE + size, 4096) + INDEX_ENTRY_BYTES
    tier = await SSDTier.create(tmp_path / "ssd", budget_bytes=3 * footprint + 4096, recycle_bytes=2 * footprint)
    try:
        kept = [rec(i, size) for i in range(3)]
        assert all([await tier.put(r) for r in kept])
        for r in kept[:2]:
            assert await tier.delete(r.key)
        assert_recycled(tier, 2)
        usage = tier.usage()
        assert usage.reserve_bytes == 2 * round_up(HEADER_SIZE + size, 4096)
        assert usage.resident_bytes + usage.reserve_bytes <= 3 * footprint + 4096
        bigger = rec(20, 2 * size)  # needs the room of both
        assert await tier.put(bigger)
        assert tier.usage().reserve_bytes == 0
        deadline = time.monotonic() + 5
        while any(p.stat().st_size for p in (tier._layout.root / "spares").iterdir()):
            assert time.monotonic() < deadline, "the recycled spares given up were never unlinked"
            await asyncio.sleep(0.005)
        assert tier.usage().resident_bytes <= 3 * footprint + 4096
        assert_same(await tier.get(bigger.key), bigger)
    finally:
        await tier.aclose()


@pytest.mark.parametrize("recycle_bytes, size", [(0, 300_000), (None, 4_000), (300_000, 300_000)])
async def test_what_is_not_recycled_is_unlinked(tmp_path: Path, recycle_bytes: int | None, size: int) -> None:
    """Recycling off, a record below the O_DIRECT size, or a file over the pool's limit:
    deleting it unlinks it, as without recycling."""
    tier = await SSDTier.create(tmp_path / "ssd", recycle_bytes=recycle_bytes)
    try:
        r = rec(1, size)
        assert await tier.put(r) and await tier.delete(r.key)
        await refilled(tier)
        assert tier.usage().reserve_bytes == 0
        assert files_under(tier._layout.root) == []
    finally:
        await tier.aclose()


def test_file_system_type_is_the_longest_mount_point_above_the_path(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\n"
                      "none /data btrfs rw 0 0\n"
                      "none /data/my\\040disk xfs rw 0 0\n"
                      "short\n")
    assert _fs.file_system_type("/data/x", str(mounts)) == "btrfs"
    assert _fs.file_system_type("/data/my disk/y", str(mounts)) == "xfs"
    assert _fs.file_system_type("/database", str(mounts)) == "ext4"  # /data is not a prefix of it
    assert _fs.file_system_type("/data", str(mounts)) == "btrfs"
    assert _fs.file_system_type("/x", str(tmp_path / "missing")) == ""
    assert _fs.file_system_type(tmp_path) != ""  # this machine's /proc/self/mounts


@pytest.mark.parametrize("recycle_bytes, kept", [(None, False), (1 << 20, True)])
async def test_no_recycling_by_default_on_a_copy_on_write_file_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recycle_bytes: int | None, kept: bool) -> None:
    """On btrfs, ZFS or bcachefs an overwrite allocates new blocks anyway: by default a deleted
    record's file is unlinked there; a recycle_bytes given explicitly is honoured."""
    monkeypatch.setattr(_fs, "file_system_type", lambda path, mounts="/proc/self/mounts": "btrfs")
    tier = await SSDTier.create(tmp_path / "ssd", recycle_bytes=recycle_bytes)
    try:
        r = rec(1, 300_000)
        assert await tier.put(r) and await tier.delete(r.key)
        assert (tier.usage().reserve_bytes > 0) is kept
        assert (files_under(tier._layout.root) != []) is kept
    finally:
        await tier.aclose()
