"""Where a PutRecords call's time goes in the sidecar shape (a diagnostic beside `bench.server`,
no floor): the wall time of each call of ours and of the raw gRPC echo moving the same records,
alternated, and the CPU seconds the client, `statestore serve` and the echo spent meanwhile.
On a host with cores to spare it says which side is the bottleneck (README, Service: on the
H200's host our server's event loop is, not the client).

    python -m bench.server_calls [--size 256K] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.server import (CHUNK_BYTES, MAX_MESSAGE_BYTES, channel, echo_put_calls, make_records, put_calls,
                          records_for, sidecar_servers)
from bench.tiers import parse_size
from statestore.client import ClientOptions, StateStoreClient

TOTAL_BYTES = 64 << 20  # as bench.server: records of one size, 32 MiB per call


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def record_size(text: str) -> int:
    """`--size`: a size as `bench.tiers` reads them ("256K", "1M"), at most one 32 MiB call."""
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size > 32 << 20:
        raise argparse.ArgumentTypeError(f"record size {text!r} above 32M")
    return size


async def run(size: int, rounds: int) -> dict[str, float]:
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
                before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                started = time.perf_counter()
                for r in range(rounds):
                    for side in (ours, echo) if r % 2 == 0 else (echo, ours):
                        await side()
                wall = time.perf_counter() - started
                used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
            await ch.close()
    return {"record_bytes": size, "records_per_call": batch, "calls_each": len(calls["ours"]),
            "ours_call_ms_p50": statistics.median(calls["ours"]) * 1e3,
            "echo_call_ms_p50": statistics.median(calls["echo"]) * 1e3,
            "ours_call_ms_min": min(calls["ours"]) * 1e3, "echo_call_ms_min": min(calls["echo"]) * 1e3,
            "wall_s": wall, **{f"{name}_cpu_s": v for name, v in used.items()}, "cpus": os.cpu_count() or 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=record_size, default=256 << 10, help="record size (default 256K)")
    parser.add_argument("--rounds", type=int, default=10, help="alternations of ours and the echo (default 10)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    print(json.dumps(asyncio.run(run(args.size, args.rounds)), indent=1))


if __name__ == "__main__":
    main()
