"""bench.ssd_open on a small directory: both opens index every record, the one from the
snapshot says so, and the figures are the medians of what was timed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.ssd_open import run


def test_a_small_run_measures_both_opens_of_every_record(tmp_path: Path) -> None:
    row = asyncio.run(run(tmp_path / "ssd", 60, 2))
    assert row["records"] == 60 and row["rounds"] == 2
    assert row["full_scan_open_s"] > 0 and row["snapshot_open_s"] > 0 and row["snapshot_close_s"] > 0
    assert row["speedup"] == row["full_scan_open_s"] / row["snapshot_open_s"]
    assert row["snapshot_bytes"] > 60 * 168  # one encoded header per record, at least
    again = asyncio.run(run(tmp_path / "ssd", 80, 1))  # tops the same directory up
    assert again["records"] == 80
