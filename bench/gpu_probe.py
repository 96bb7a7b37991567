"""Short H200 probes that decide what the full report's code does (not a report of its own).

1. The codec sweep of bench.gpu_report (every kernel variant and launch shape, bit-checked).
2. Host->HBM load of a V4.1-shaped checkpoint (1,024 records: 184,320 B global KV and 43,520 B
   index-key pages, 117 MB) split into its parts: one plain pinned copy of the same bytes, the
   two pool-to-pool copies `load_from` issues alone, and `load_from` itself, with a cProfile of
   the latter, at 32 / 256 / 1,024 records. Run: python -m bench.gpu_probe
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import os
import pstats
import statistics

import torch

from bench.gpu_report import ceilings, codec_rows, print_table, wall
from tiers.hbm import HbmTier, PinnedHostTier
from tiers.host import HostTier
from tiers.record import FINGERPRINT_BYTES, KEY_BYTES, TENANT_BYTES, make_record

PAGES = {1: 184_320, 2: 43_520}


async def load_probe(n: int) -> dict:
    host = PinnedHostTier(HostTier(1 << 30, PAGES), PAGES, {1: n // 2 + 4, 2: n // 2 + 4}, pin=True)
    recs = [make_record(1 + i % 2, 0, os.urandom(PAGES[1 + i % 2]), model_fingerprint=b"f" * FINGERPRINT_BYTES,
                        tenant_id=b"t" * TENANT_BYTES, block_key=i.to_bytes(KEY_BYTES, "big")) for i in range(n)]
    for r in recs:
        assert await host.put(r)
    keys = [r.key for r in recs if r.header.kind == 1] + [r.key for r in recs if r.header.kind == 2]
    nbytes = sum(len(r.payload) for r in recs)
    hbm = HbmTier(PAGES, {1: n // 2, 2: n // 2})
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {"records": n, "MB": nbytes / 1e6, "host_pool_pinned": all(p.tensor.is_pinned() for p in host.pinned_pools.values())}

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
    print(s.getvalue()[-2500:], flush=True)
    return out


def main() -> None:
    ceil = ceilings()
    print("ceilings:", ceil, flush=True)
    rows = [asyncio.run(load_probe(n)) for n in (32, 256, 1024)]
    print_table(rows)
    codec, best = codec_rows(ceil["copy_GBps"])
    print_table(codec, ["case", "best_config", "ms", "GBps_read_plus_written", "vs_copy", "all_configs_bit_identical",
                        "bit_identical_to_cpu_codecs"])
    for r in codec:
        print(f"  {r['case']}: {r['sweep_ms']}")


if __name__ == "__main__":
    main()
