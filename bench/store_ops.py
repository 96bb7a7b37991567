"""What the store's bookkeeping costs per put (a diagnostic, no floor): `TieredStore.put` of
MEMORY records into its host tier against the host tier's own put of the same records, with
room to spare and with the tier full (every put evicts one record, the steady state of a
cache), in microseconds per put, alternated in the same run.

    python -m bench.store_ops [--size 4K] [--records 2000] [--rounds 7]

The store's put decides placement, marks the record in flight, writes the tier, evicts by
policy when the budget needs room, and indexes the copy; the tier's put only copies bytes
into pages. Their difference is the Python a put pays on the event loop before the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence

from bench.tiers import make_records, parse_size
from statestore.store import TieredStore
from statestore.types import Durability
from tiers.host import HostTier
from tiers.pools import record_overhead_bytes
from tiers.record import Record


async def per_put_us(put: Callable[[Record], Awaitable[object]], records: Sequence[Record]) -> float:
    started = time.perf_counter()
    for r in records:
        await put(r)
    return (time.perf_counter() - started) / len(records) * 1e6


async def run(size: int, count: int, rounds: int) -> dict[str, float]:
    footprint = size + record_overhead_bytes(1)  # one page per record: page size = record size
    records = make_records(size, count, "store-ops")
    fresh = make_records(size, count, "store-ops-fresh")  # new keys for the full store: each put evicts one
    # The full tier's slabs hold one page each, so that its budget holds exactly `count` records
    # (no page is left free in a slab another kind could not use); the roomy ones grow by the
    # default slab (budget / 16), as a server's does.
    roomy_host = HostTier(4 * count * footprint, {1: size})
    full_host = HostTier(count * footprint, {1: size}, slab_bytes=size)
    bare_host = HostTier(4 * count * footprint, {1: size})
    roomy, full = TieredStore(host=roomy_host), TieredStore(host=full_host)
    for r in records:  # warm: pages mapped, keys indexed
        await roomy.put(r, Durability.MEMORY)
        await full.put(r, Durability.MEMORY)
        await bare_host.put(r)
    held = [records]  # what the full store holds: each evicting pass puts the other set

    async def evicting() -> float:
        incoming = fresh if held[0] is records else records
        took = await per_put_us(lambda r: full.put(r, Durability.MEMORY), incoming)
        held[0] = incoming
        return took

    cases: dict[str, Callable[[], Awaitable[float]]] = {
        "host_tier_put": lambda: per_put_us(bare_host.put, records),
        "store_put": lambda: per_put_us(lambda r: roomy.put(r, Durability.MEMORY), records),
        "store_put_evicting": evicting,
    }
    taken: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(rounds):
        for name in (list(cases) if i % 2 == 0 else list(reversed(cases))):
            taken[name].append(await cases[name]())
    await roomy.aclose()
    await full.aclose()
    await bare_host.aclose()
    out = {f"{name}_us": statistics.median(v) for name, v in taken.items()}
    out["store_overhead_us"] = out["store_put_us"] - out["host_tier_put_us"]
    out["eviction_us"] = out["store_put_evicting_us"] - out["store_put_us"]
    return {"record_bytes": size, "records": count, "rounds": rounds, **out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=4096, help="record payload size (default 4K)")
    parser.add_argument("--records", type=int, default=2000, help="records per pass (default 2000)")
    parser.add_argument("--rounds", type=int, default=7, help="alternations of the cases (default 7)")
    args = parser.parse_args()
    if args.records < 1 or args.rounds < 1:
        parser.error("--records and --rounds must be at least 1")
    print(json.dumps(asyncio.run(run(args.size, args.records, args.rounds)), indent=1))


if __name__ == "__main__":
    main()
