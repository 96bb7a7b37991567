"""Where a PutRecords call's time goes in the sidecar shape (a diagnostic beside `bench.server`,
no floor): the wall time of each call of ours and of the raw gRPC echo moving the same records,
alternated, and the CPU seconds the client, `statestore serve` and the echo spent meanwhile.
On a host with cores to spare it says which side is the bottleneck (bench/NOTES.md, Service: on the
H200's host our server's event loop is, not the client).

Per record, each side's CPU is also split by thread: the main thread of the client and of the
server (the event loop, where every Python step of a handler runs) against the whole server
process (gRPC's own threads move the bytes). The main threads are what the two sides differ in.

    python -m bench.server_calls [--size 256K[,4M...]] [--rounds 10] [--save]

`--save` writes the rows to bench/results/server_calls.json (no floors: a diagnostic).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import write_results
from bench.server import (CHUNK_BYTES, MAX_MESSAGE_BYTES, channel, echo_put_calls, make_records, put_calls,
                          records_for, sidecar_servers)
from bench.tiers import parse_size
from statestore.client import ClientOptions, StateStoreClient

TOTAL_BYTES = 64 << 20  # as bench.server: records of one size, 32 MiB per call


def cpu_seconds(pid: int, *, main_thread: bool = False) -> float:
    """User + system CPU seconds of process `pid` so far, or of its main thread only (Linux /proc)."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class SideCpu:
    """CPU seconds one side's calls took, summed over its calls: this client's main thread (the
    loop that frames and sends), the server's process and the server's main thread."""

    client_main: float = 0.0
    server: float = 0.0
    server_main: float = 0.0

    def per_record_us(self, records: int) -> dict[str, float]:
        return {f"{name}_us_per_record": round(value / records * 1e6, 1) for name, value in vars(self).items()}


def record_sizes(text: str) -> list[int]:
    """`--size`: sizes as `bench.tiers` reads them ("256K", "1M"), comma-separated, each at
    most one 32 MiB call."""
    sizes = []
    for part in text.split(","):
        try:
            size = parse_size(part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if size > 32 << 20:
            raise argparse.ArgumentTypeError(f"record size {part!r} above 32M")
        sizes.append(size)
    return sizes


async def run(size: int, rounds: int) -> dict[str, float | int]:
    count = records_for(size, TOTAL_BYTES)
    batch = max(1, min(count, (32 << 20) // size))
    with tempfile.TemporaryDirectory(prefix="bench-calls-") as tmp:
        async with sidecar_servers([size], TOTAL_BYTES, Path(tmp)) as servers:
            records = make_records(servers.fingerprint, size, count, size)
            ch = channel(servers.echo_port)
            options = ClientOptions(chunk_bytes=CHUNK_BYTES, max_message_bytes=MAX_MESSAGE_BYTES)
            calls: dict[str, list[float]] = {"ours": [], "echo": []}
            async with StateStoreClient(f"127.0.0.1:{servers.ours_port}", options=options) as c:
                async def ours() -> None:
                    calls["ours"] += await put_calls(c, records, batch)

                async def echo() -> None:
                    calls["echo"] += await echo_put_calls(ch, records[0].payload, count, batch)

                await put_calls(c, records, batch)  # warm-up (the host tier maps its slabs), as bench.server does
                await echo_put_calls(ch, records[0].payload, count, batch)
                pids = {"client": os.getpid(), "server": servers.ours_pid, "echo": servers.echo_pid}
                server_of = {"ours": servers.ours_pid, "echo": servers.echo_pid}
                split = {"ours": SideCpu(), "echo": SideCpu()}
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                started = time.perf_counter()
                order = (("ours", ours), ("echo", echo))
                for r in range(rounds):
                    for name, side in order if r % 2 == 0 else order[::-1]:
                        pid = server_of[name]
                        t0, s0, m0 = time.thread_time(), cpu_seconds(pid), cpu_seconds(pid, main_thread=True)
                        await side()
                        split[name].client_main += time.thread_time() - t0
                        split[name].server += cpu_seconds(pid) - s0
                        split[name].server_main += cpu_seconds(pid, main_thread=True) - m0
                wall = time.perf_counter() - started
                used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
            await ch.close()
    moved = rounds * count  # records each side moved in the timed calls
    return {"record_bytes": size, "records_per_call": batch, "calls_each": len(calls["ours"]),
            "ours_call_ms_p50": statistics.median(calls["ours"]) * 1e3,
            "echo_call_ms_p50": statistics.median(calls["echo"]) * 1e3,
            "ours_call_ms_min": min(calls["ours"]) * 1e3, "echo_call_ms_min": min(calls["echo"]) * 1e3,
            "wall_s": wall, **{f"{name}_cpu_s": v for name, v in used.items()},
            "ratio": statistics.median(calls["echo"]) / statistics.median(calls["ours"]),
            **{f"ours_{k}": v for k, v in split["ours"].per_record_us(moved).items()},
            **{f"echo_{k}": v for k, v in split["echo"].per_record_us(moved).items()},
            "cpus": os.cpu_count() or 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=record_sizes, default=[256 << 10],
                        help="record sizes, comma-separated (default 256K)")
    parser.add_argument("--rounds", type=int, default=10, help="alternations of ours and the echo (default 10)")
    parser.add_argument("--save", action="store_true", help="write bench/results/server_calls.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    rows = [asyncio.run(run(size, args.rounds)) for size in args.size]
    print(json.dumps(rows if len(rows) > 1 else rows[0], indent=1))
    if args.save:
        path = write_results("server_calls", device="cpu", params={"rounds": args.rounds, "sizes": args.size,
                                                                   "total_bytes": TOTAL_BYTES}, rows=rows)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
