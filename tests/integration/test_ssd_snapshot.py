"""The SSD tier's index snapshot (tiers/ssd_snapshot.py): a clean close saves the index, the next
open reads it back and scans only the leaf directories changed since, and the index it builds
is the one a full scan of every header builds, whatever happened to the directory meanwhile."""

from __future__ import annotations

import shutil
from pathlib import Path

import os

import pytest

from tests.integration.test_ssd_tier import as_built, assert_same, rec, record_path
from tiers import ssd_snapshot
from tiers.ssd import SSDTier
from tiers.ssd_snapshot import SNAPSHOT_FILE


@pytest.fixture(autouse=True)
def settled_at_once(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests change leaves and close within a second: without the settling margin (the
    coarse-clock guard, tested on its own below) the counts of leaves scanned are exact."""
    if "keeps_the_margin" not in request.keywords:
        monkeypatch.setattr(ssd_snapshot, "SETTLE_NS", 0)


def index_of(tier: SSDTier) -> dict[bytes, tuple[object, int]]:
    return {key: (as_built(entry.header), entry.file_bytes) for key, entry in tier._index.items()}


async def full_scan_of(root: Path) -> dict[bytes, tuple[object, int]]:
    """The index of a tier that reads every header (and saves no snapshot)."""
    tier = await SSDTier.create(root, index_snapshot=False)
    try:
        return index_of(tier)
    finally:
        await tier.aclose()


async def test_a_clean_close_lets_the_next_open_skip_every_header(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    records = [rec(i, 300 + 997 * i, kind=1 + i % 3) for i in range(40)]  # kinds and sizes: the tallies
    tier = await SSDTier.create(root)
    await tier.put_many(records)
    await tier.delete(records[0].key)
    usage = tier.usage()
    await tier.aclose()
    assert (root / SNAPSHOT_FILE).is_file()

    tier = await SSDTier.create(root)
    try:
        assert not (root / SNAPSHOT_FILE).exists()  # taken before serving: a crash from here scans all
        use = tier.snapshot_use
        assert use is not None and use.leaves_scanned == 0 and use.from_snapshot == 39
        assert sorted(h.key for h in tier.last_scan.headers) == sorted(r.key for r in records[1:])
        assert tier.usage() == usage
        for r in records[1:]:
            assert_same(await tier.get(r.key), r)
        assert await tier.get(records[0].key) is None
        snapshot_index = index_of(tier)
    finally:
        await tier.aclose()
    assert snapshot_index == await full_scan_of(root)
    scanned = await SSDTier.create(root, index_snapshot=False)
    try:
        assert scanned.usage() == usage  # a full scan's tallies: the same
    finally:
        await scanned.aclose()


async def test_changes_while_stopped_are_scanned_and_nothing_else(tmp_path: Path) -> None:
    """Leaves in which a file was removed, added or left stray while no tier had the directory
    are scanned (and cleaned up as a full scan does); the index is a full scan's."""
    root, other = tmp_path / "ssd", tmp_path / "other"
    records, copied = [rec(i) for i in range(30)], rec(99)
    tier = await SSDTier.create(root)
    await tier.put_many(records)
    await tier.aclose()
    elsewhere = await SSDTier.create(other)
    await elsewhere.put(copied)
    await elsewhere.aclose()

    record_path(root, records[3]).unlink()  # removed by hand
    added = record_path(root, copied)
    added.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(record_path(other, copied), added)  # a whole record copied in under its own name
    stray = record_path(root, records[7]).with_name("notes.txt")
    stray.write_text("hello")
    changed = {added.parent, record_path(root, records[3]).parent, stray.parent}

    tier = await SSDTier.create(root)
    try:
        assert tier.snapshot_use is not None and tier.snapshot_use.leaves_scanned == len(changed)
        assert tier.last_scan.discarded == [f"{stray.relative_to(root)}: unexpected file name or directory (quarantined)"]
        assert await tier.contains([records[3].key, copied.key, records[7].key]) == [False, True, True]
        assert_same(await tier.get(copied.key), copied)
        snapshot_index = index_of(tier)
    finally:
        await tier.aclose()
    assert snapshot_index == await full_scan_of(root)


async def test_changes_behind_a_running_tiers_back_are_left_to_the_next_scan(tmp_path: Path) -> None:
    """The close vouches only for leaves whose files are the index's records: a stray file in a
    leaf the tier changed since it opened, or in one it did not, is found by the next open."""
    root = tmp_path / "ssd"
    old, new = rec(1), rec(2)
    tier = await SSDTier.create(root)
    await tier.put(old)
    await tier.aclose()
    tier = await SSDTier.create(root)  # reopened: `old`'s leaf is one this tier has not changed
    await tier.put(new)  # `new`'s leaf: touched
    strays = [record_path(root, r).with_name(f"stray-{i}.txt") for i, r in enumerate((old, new))]
    for stray in strays:
        stray.write_text("not a record")
    temp = record_path(root, new).with_name(rec(9).key.hex() + ".rec.x7.tmp")
    temp.write_bytes(b"half a record")
    await tier.aclose()

    tier = await SSDTier.create(root)
    try:
        assert tier.snapshot_use is not None and tier.snapshot_use.leaves_scanned == 2
        assert sorted(tier.last_scan.discarded) == sorted(
            [f"{s.relative_to(root)}: unexpected file name or directory (quarantined)" for s in strays]
            + [f"{temp.relative_to(root)}: leftover temp file of an unacknowledged put (removed)"])
        assert_same(await tier.get(old.key), old)
        assert_same(await tier.get(new.key), new)
    finally:
        await tier.aclose()


async def test_a_damaged_snapshot_is_ignored_and_everything_scanned(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    records = [rec(i) for i in range(10)]
    tier = await SSDTier.create(root)
    await tier.put_many(records)
    await tier.aclose()
    data = bytearray((root / SNAPSHOT_FILE).read_bytes())
    data[len(data) // 2] ^= 0x40
    (root / SNAPSHOT_FILE).write_bytes(data)

    tier = await SSDTier.create(root)
    try:
        use = tier.snapshot_use
        assert use is not None and use.leaves_scanned is None and "checksum mismatch" in use.why_not
        assert not (root / SNAPSHOT_FILE).exists()
        assert sorted(h.key for h in tier.last_scan.headers) == sorted(r.key for r in records)
    finally:
        await tier.aclose()


async def test_a_record_rewritten_in_place_while_stopped_is_never_served(tmp_path: Path) -> None:
    """What a snapshot cannot see (bytes changed inside a file, not the directory) the first
    get catches: a miss, the file quarantined, as a full scan would have done at open."""
    root = tmp_path / "ssd"
    good, bad = rec(1, 5000), rec(2, 5000)
    tier = await SSDTier.create(root)
    await tier.put_many([good, bad])
    await tier.aclose()
    path = record_path(root, bad)
    data = bytearray(path.read_bytes())
    data[50] ^= 0x01  # in the header
    path.write_bytes(data)

    tier = await SSDTier.create(root)
    try:
        assert tier.snapshot_use is not None and tier.snapshot_use.leaves_scanned == 0
        assert await tier.get(bad.key) is None
        assert await tier.contains([good.key, bad.key]) == [True, False]
        assert len(list((root / "quarantine").iterdir())) == 1
        assert_same(await tier.get(good.key), good)
    finally:
        await tier.aclose()


async def test_an_open_without_snapshots_removes_one_so_it_never_goes_stale(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    first, second = rec(1), rec(2)
    tier = await SSDTier.create(root)
    await tier.put(first)
    await tier.aclose()
    assert (root / SNAPSHOT_FILE).is_file()

    tier = await SSDTier.create(root, index_snapshot=False)  # reads every header, takes the snapshot away
    assert not (root / SNAPSHOT_FILE).exists()
    await tier.put(second)
    await tier.aclose()
    assert not (root / SNAPSHOT_FILE).exists()  # and saves none

    tier = await SSDTier.create(root)
    try:
        assert tier.snapshot_use is not None and tier.snapshot_use.leaves_scanned is None
        assert await tier.contains([first.key, second.key]) == [True, True]
    finally:
        await tier.aclose()


@pytest.mark.keeps_the_margin
async def test_leaves_changed_just_before_the_close_are_left_to_the_next_scan(tmp_path: Path) -> None:
    """A directory's mtime comes from a coarse clock: a change in the same tick as the close's
    stamp would not show. Leaves changed within a second of the close are therefore scanned at
    the next open, the others come from the snapshot."""
    root = tmp_path / "ssd"
    early, late = rec(1), rec(2)
    assert record_path(root, early).parent != record_path(root, late).parent
    tier = await SSDTier.create(root)
    await tier.put(early)
    await tier.aclose()
    leaf = record_path(root, early).parent
    long_ago = leaf.stat().st_mtime_ns - 5 * ssd_snapshot.SETTLE_NS
    os.utime(leaf, ns=(long_ago, long_ago))  # as if `early` had been written long before the close
    tier = await SSDTier.create(root)  # scans `early`'s leaf (left out by the close before); this close vouches for it
    await tier.aclose()
    tier = await SSDTier.create(root)
    await tier.put(late)  # right before the close: `late`'s leaf is left out
    await tier.aclose()

    tier = await SSDTier.create(root)
    try:
        use = tier.snapshot_use
        assert use is not None and use.leaves_scanned == 1  # `late`'s leaf only
        assert await tier.contains([early.key, late.key]) == [True, True]
    finally:
        await tier.aclose()
