"""SSD tier start-up: how long an open of a directory of N records takes from the index
snapshot a clean close saved (`tiers.ssd_snapshot`), against a full scan of every record's
header on the same directory in the same run.

    python -m bench.ssd_open [--quick] [--records N[,N...]] [--dir DIR] [--rounds R] [--no-write]

The directory is filled first with N small durable records of three kinds (puts through the
tier, 32 in flight; `--dir` keeps it between runs and only tops it up); several sizes are
measured in ascending order on the same directory, each topping it up.
Each round, alternately in both orders: a full scan (`index_snapshot=False`), and an open that
reads the snapshot the close before it saved; the closes that save it are timed too. Pages of
the directory are in the page cache for both (a start right after a stop, as a rolling restart
does); a cold start reads more from the device on both sides. Both open with the cyclic garbage
collector paused, as `statestore serve` opens its store. No floor: the issue asks that the
layout scale to millions of records; this says what a restart costs at a given size.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path

from bench.common import print_table, write_results
from statestore.collector import collector_paused
from tiers.record import make_record
from tiers.ssd import SSDTier
from tiers import ssd_snapshot
from tiers.ssd_snapshot import SNAPSHOT_FILE

PAYLOAD_BYTES = 1024


async def fill(root: Path, records: int) -> float:
    """Put `records` records (kinds 1-3) unless the directory holds them; seconds taken."""
    tier = await SSDTier.create(root)
    try:
        have = tier.usage().num_records
        if have >= records:
            return 0.0
        payload, started, in_flight = os.urandom(PAYLOAD_BYTES), time.perf_counter(), asyncio.Semaphore(32)

        async def put(i: int) -> None:
            async with in_flight:
                await tier.put(make_record(1 + i % 3, 1, payload, model_fingerprint=b"b" * 16, tenant_id=bytes(16),
                                           block_key=struct.pack("<Q", i) + os.urandom(24)))

        await asyncio.gather(*(put(i) for i in range(have, records)))
        return time.perf_counter() - started
    finally:
        await tier.aclose()


async def timed_open(root: Path, *, snapshot: bool) -> tuple[float, float, int, int | None]:
    """(open seconds, close seconds, records indexed, leaf directories the open scanned: None
    for all of them)."""
    t0 = time.perf_counter()
    with collector_paused():  # as `statestore serve` opens its store (statestore/collector.py)
        tier = await SSDTier.create(root, index_snapshot=snapshot)
    t1 = time.perf_counter()
    indexed, use = tier.usage().num_records, tier.snapshot_use
    await tier.aclose()
    return t1 - t0, time.perf_counter() - t1, indexed, None if use is None else use.leaves_scanned


async def run(root: Path, records: int, rounds: int) -> dict[str, float | int | str]:
    filled = await fill(root, records)
    # A close leaves out the leaves changed within SETTLE_NS of it (the coarse-clock guard): wait
    # that long, then a clean close saves a snapshot of every leaf to start from.
    await asyncio.sleep(ssd_snapshot.SETTLE_NS / 1e9)
    await timed_open(root, snapshot=True)
    full, snap, closes = [], [], []
    for r in range(rounds):
        order = ("full", "snapshot") if r % 2 == 0 else ("snapshot", "full")
        for side in order:
            if side == "full":
                took, _, n, scanned = await timed_open(root, snapshot=False)  # takes the snapshot away
                assert scanned is None
                full.append(took)
                await timed_open(root, snapshot=True)  # a full scan again, whose close saves one
            else:
                took, closed, n, scanned = await timed_open(root, snapshot=True)
                assert scanned == 0, f"the open from the snapshot scanned {scanned} leaves"
                snap.append(took)
                closes.append(closed)
            assert n >= records, f"{n} records indexed, {records} expected"
    size = (root / SNAPSHOT_FILE).stat().st_size if (root / SNAPSHOT_FILE).exists() else 0
    return {"records": n, "rounds": rounds, "fill_s": round(filled, 1),
            "full_scan_open_s": statistics.median(full), "snapshot_open_s": statistics.median(snap),
            "snapshot_close_s": statistics.median(closes), "speedup": statistics.median(full) / statistics.median(snap),
            "snapshot_bytes": size, "snapshot_bytes_per_record": round(size / max(n, 1), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000 records, 2 rounds")
    parser.add_argument("--records", default="100000", help="record counts, comma-separated (default 100000)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="keep the filled directory here (reused if it holds the records)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results/ssd_open.json alone")
    args = parser.parse_args()
    try:
        counts = [20_000] if args.quick else sorted(int(n) for n in args.records.split(","))
    except ValueError:
        parser.error(f"--records {args.records!r}: record counts, comma-separated")
    rounds = 2 if args.quick else args.rounds
    if min(counts) < 1 or rounds < 1:
        parser.error("--records and --rounds must be at least 1")
    work = args.dir or Path(tempfile.mkdtemp(prefix="bench-ssd-open-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    rows = []
    try:
        for count in counts:
            rows.append(asyncio.run(run(work, count, rounds)))
            print_table(rows[-1:])
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    if not args.no_write:
        path = write_results("ssd_open", device="cpu", params={"records": counts, "rounds": rounds,
                                                               "payload_bytes": PAYLOAD_BYTES}, rows=rows)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
