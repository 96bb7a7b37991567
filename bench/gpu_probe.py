"""Short H200 probes that decide what the full report's code does (not a report of its own).

1. The codec sweep of bench.gpu_report (every kernel variant and launch shape, bit-checked).
2. Host->HBM load of a V4.1-shaped checkpoint (1,024 records: 184,320 B global KV and 43,520 B
   index-key pages, 117 MB) split into its parts: one plain pinned copy of the same bytes, the
   two pool-to-pool copies `load_from` issues alone, and `load_from` itself, with a cProfile of
   the latter, at 32 / 256 / 1,024 records, for each pipelining shape of `load_from` (its first
   and largest chunk, in records; "one copy per kind" = no pipelining).
   Run: python -m bench.gpu_probe [--load-only]
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import os
import pstats
import statistics
import sys

import torch

from bench.gpu_report import ceilings, codec_rows, print_table, wall
import tiers.hbm
from tiers.hbm import HbmTier, PinnedHostTier
from tiers.host import HostTier
from tiers.record import FINGERPRINT_BYTES, KEY_BYTES, TENANT_BYTES, make_record

PAGES = {1: 184_320, 2: 43_520}


CHUNKINGS = ((1 << 30, 1 << 30), (tiers.hbm.FIRST_CHUNK, tiers.hbm.MAX_CHUNK), (8, 128), (16, 256))


async def load_probe(n: int, first: int, largest: int, driver: bool, profile: bool) -> dict:
    tiers.hbm.FIRST_CHUNK, tiers.hbm.MAX_CHUNK = first, largest
    host = PinnedHostTier(HostTier(1 << 30, PAGES), PAGES, {1: n // 2 + 4, 2: n // 2 + 4}, pin=True)
    recs = [make_record(1 + i % 2, 0, os.urandom(PAGES[1 + i % 2]), model_fingerprint=b"f" * FINGERPRINT_BYTES,
                        tenant_id=b"t" * TENANT_BYTES, block_key=i.to_bytes(KEY_BYTES, "big")) for i in range(n)]
    for r in recs:
        assert await host.put(r)
    keys = [r.key for r in recs if r.header.kind == 1] + [r.key for r in recs if r.header.kind == 2]
    nbytes = sum(len(r.payload) for r in recs)
    hbm = HbmTier(PAGES, {1: n // 2, 2: n // 2})
    if not driver:
        hbm._h2d = None  # torch copies
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {"records": n, "chunks": "one copy per kind" if first >= n else f"{first}..{largest}",
           "copies_by": "driver" if hbm._h2d is not None else "torch", "MB": nbytes / 1e6, "host_pool_pinned": all(p.tensor.is_pinned() for p in host.pinned_pools.values())}

    def pool_copies() -> None:
        for k in (1, 2):
            hbm.pools[k].tensor[: n // 2].copy_(host.pinned_pools[k].tensor[: n // 2], non_blocking=True)

    def load() -> None:
        for e in {id(e): e for e in hbm.load_from(host, keys) if e is not None}.values():
            e.synchronize()

    ref, pools, loads = [], [], []
    for _ in range(15):
        ref.append(wall(lambda: dev.copy_(pinned, non_blocking=True))[0])
        pools.append(wall(pool_copies)[0])
        loads.append(wall(load)[0])
        for k in keys:
            hbm._drop(k)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        load()
        for k in keys:
            hbm._drop(k)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(8)
    med = statistics.median
    out.update({"ref_ms": med(ref) * 1e3, "pool_copies_ms": med(pools) * 1e3, "load_from_ms": med(loads) * 1e3,
                "pool_vs_ref": med(ref) / med(pools), "load_vs_ref": med(ref) / med(loads)})
    if profile:
        print(s.getvalue()[-2500:], flush=True)
    return out


def call_costs(reps: int = 2000) -> dict[str, float]:
    """Host-side µs per call of what a load issues: torch slice copy, driver copy, event record, waits."""
    import time

    src = torch.empty(64, 4096, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(64, 4096, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    h2d = tiers.hbm._DriverH2D.open()
    out = {}

    def per_call(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i)
        t = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
        return t

    with torch.cuda.stream(stream):
        out["torch slice copy_"] = per_call(lambda i: dst[i % 32: i % 32 + 2].copy_(src[i % 32: i % 32 + 2], non_blocking=True))
    out["driver copy"] = per_call(lambda i: h2d(dst.data_ptr() + (i % 32) * 4096, src.data_ptr() + (i % 32) * 4096,
                                                8192, stream.cuda_stream)) if h2d else -1.0
    def enter_exit(i: int) -> None:
        with torch.cuda.stream(stream):
            pass

    out["stream context enter+exit"] = per_call(enter_exit)
    out["Event() + record"] = per_call(lambda i: torch.cuda.Event().record(stream))
    ev = torch.cuda.Event()
    ev.record(stream)
    out["event.synchronize (done)"] = per_call(lambda i: ev.synchronize())
    out["torch.cuda.synchronize (idle)"] = per_call(lambda i: torch.cuda.synchronize())
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    ceil = ceilings()
    print("ceilings:", ceil, flush=True)
    default = (tiers.hbm.FIRST_CHUNK, tiers.hbm.MAX_CHUNK)
    print("per-call costs (µs):", call_costs(), flush=True)
    rows = [asyncio.run(load_probe(n, first, largest, driver, driver and n == 1024 and (first, largest) == default))
            for n in (32, 256, 1024) for first, largest in CHUNKINGS for driver in (True, False)]
    tiers.hbm.FIRST_CHUNK, tiers.hbm.MAX_CHUNK = default
    print_table(rows)
    if "--load-only" in sys.argv:
        return
    codec, best = codec_rows(ceil["copy_GBps"])
    print_table(codec, ["case", "best_config", "ms", "GBps_read_plus_written", "vs_copy", "all_configs_bit_identical",
                        "bit_identical_to_cpu_codecs"])
    for r in codec:
        print(f"  {r['case']}: {r['sweep_ms']}")


if __name__ == "__main__":
    main()
