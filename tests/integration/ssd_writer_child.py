"""Child process for the SIGKILL tests: streams durable puts and acknowledges each on stdout.

    python ssd_writer_child.py <root> <num_records> <num_workers> [<churn>]

Record i is deterministic (`child_record(i)`), so the parent can check bit-exactly what
survived. A line "<i>" is printed and flushed only after `put` returned True for record i:
every printed index is a write the tier acknowledged at LOCAL durability. Several workers
keep puts in flight, so a SIGKILL lands in the middle of writes. With `churn` = K, the worker
that stored record i then deletes record i - K, as a full cache evicts: "d <j>" is printed
before the delete is issued and "D <j>" once it returned True (large records' files become
recycled spares that later puts write over).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from pathlib import Path

# Sizes cycle so that large (slow, O_DIRECT) writes are in flight most of the time.
SIZES = (4096, 300_000, 1 << 20, 3 << 20, 1)


def child_block_key(i: int) -> bytes:
    return hashlib.sha256(f"sigkill-{i}".encode()).digest()


def child_record(i: int):  # -> tiers.record.Record (imported lazily: the path is set in main)
    from tiers.record import make_record

    block_key = child_block_key(i)
    size = SIZES[i % len(SIZES)]
    # Cheap to build (the loop must keep puts in flight), unique per record, deterministic.
    payload = (block_key * (size // len(block_key) + 1))[:size]
    return make_record(1 + i % 2, 1, payload, model_fingerprint=b"K" * 16, tenant_id=b"T" * 16,
                       block_key=block_key, token_start=256 * i, token_end=256 * (i + 1))


async def stream(root: Path, num_records: int, num_workers: int, churn: int = 0) -> None:
    from tiers.ssd import SSDTier

    tier = await SSDTier.create(root)
    todo = iter(range(num_records))

    async def worker() -> None:
        for i in todo:
            if not await tier.put(child_record(i)):
                print(f"FAILED {i}", flush=True)
                raise SystemExit(1)
            print(i, flush=True)
            if churn and i >= churn:
                print(f"d {i - churn}", flush=True)
                if await tier.delete(child_record(i - churn).key):
                    print(f"D {i - churn}", flush=True)

    await asyncio.gather(*(worker() for _ in range(num_workers)))
    await tier.aclose()


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    root, num_records, num_workers = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    churn = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    asyncio.run(stream(root, num_records, num_workers, churn))


if __name__ == "__main__":
    main()
