"""Load benchmark: many agent sessions cycling append -> checkpoint -> idle (drop) -> resume
against one `statestore serve` process, for a fixed number of cycles.

    python -m bench.load [--quick] [--sessions 64] [--cycles N] [--tokens T] [--preset tiny|mini]

The server runs in a child process (the `tiny` engine by default; `--quick` uses `mini`), so
its RSS is its own: sampled from /proc/<pid>/status every `--rss-interval` seconds. The
clients are one asyncio task per session over a few channels of the async client, all
started together: each creates its session, then per cycle appends a message of `--tokens`
random token ids, checkpoints (LOCAL: fsynced on the SSD tier), drops the in-memory state
(what an idle agent does) and resumes it from the checkpoint (the server's default replay
mode), and finally deletes it. Every call is timed; a failed call is counted, never retried.

Reported: throughput (calls/s over the whole run, and per operation), p50/p99/max latency
per operation, server RSS (start, peak, end, and growth from the end of the first cycle to
the end, which a leak per cycle would show), and the error count, which must be zero (a
floor). Results: bench/results/load.json (`bench.common.write_results`).

All engine work of the server runs on its one engine thread, so on a small CPU the engine
(append prefill, resume replay) dominates and latencies grow with the number of sessions
queued behind it: the figures measure the service under that queueing, not a single call.
Every cycle appends, so contexts (engine states, tails, blocks) grow and so does the RSS; a
leak shows as growth at constant context (drop -> resume -> checkpoint without appends),
which plateaus within a few cycles (tiny, 16 sessions, 30 cycles: 383 -> 387 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Floor, print_floors, print_table, write_results
from statestore.client import ServiceError, StateStoreClient

ROOT = Path(__file__).resolve().parents[1]
VOCAB = {"mini": 256, "tiny": 8192}  # engine_adapter/ced/config.py presets (not imported: torch stays in the server)
OPS = ("create", "append", "checkpoint", "drop", "resume", "delete")
_READY = re.compile(r"statestore serving on 127\.0\.0\.1:(\d+)")


@dataclass
class Tally:
    """Latencies (seconds) per operation and failures."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    errors: dict[str, int] = field(default_factory=lambda: {op: 0 for op in OPS})
    first_errors: list[str] = field(default_factory=list)
    cycles_done: int = 0

    async def timed(self, op: str, call: Callable[[], Awaitable[Any]]) -> bool:
        start = time.perf_counter()
        try:
            await call()
        except ServiceError as exc:
            self.errors[op] += 1
            if len(self.first_errors) < 5:
                self.first_errors.append(f"{op}: {exc}")
            return False
        self.seconds[op].append(time.perf_counter() - start)
        return True


class ServerProcess:
    """`statestore serve` on port 0 in a child process; its output goes to a log file."""

    def __init__(self, data_dir: Path, preset: str) -> None:
        self.data_dir, self.preset = data_dir, preset
        self.log_path = data_dir.parent / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""

    def start(self, timeout_s: float = 120.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "STATESTORE_SERVER_GRACE_S": "1"}
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "statestore.cli", "serve", "--listen", "127.0.0.1:0",
                                          "--data-dir", str(self.data_dir), "--preset", self.preset],
                                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.target:
            match = _READY.search(self.log_path.read_text(errors="replace"))
            if match:
                self.target = f"127.0.0.1:{match.group(1)}"
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            else:
                time.sleep(0.05)

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


async def agent(client: StateStoreClient, tally: Tally, session_id: str, cycles: int, tokens: int,
                vocab: int, rng: random.Random, cycle_rss: list[list[int]], server: ServerProcess) -> None:
    """One session's life: create, `cycles` x (append, checkpoint, drop, resume), delete."""
    if not await tally.timed("create", lambda: client.create_session(session_id)):
        return
    for cycle in range(cycles):
        message = [rng.randrange(vocab) for _ in range(tokens)]
        ok = await tally.timed("append", lambda: client.append(session_id, message))
        ok = ok and await tally.timed("checkpoint", lambda: client.checkpoint(session_id))
        ok = ok and await tally.timed("drop", lambda: client.drop_session(session_id))
        ok = ok and await tally.timed("resume", lambda: client.resume(session_id))
        cycle_rss[cycle].append(server.rss_bytes())
        if not ok:
            break
        tally.cycles_done += 1
    await tally.timed("delete", lambda: client.delete_session(session_id))


async def sample_rss(server: ServerProcess, interval_s: float, samples: list[tuple[float, int]],
                     stop: asyncio.Event) -> None:
    start = time.monotonic()
    while not stop.is_set():
        samples.append((time.monotonic() - start, server.rss_bytes()))
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass
    samples.append((time.monotonic() - start, server.rss_bytes()))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocab = VOCAB[args.preset]
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        server = ServerProcess(Path(tmp) / "data", args.preset)
        server.start()
        try:
            clients = [StateStoreClient(server.target) for _ in range(args.channels)]
            for c in clients:
                c.open()
            await clients[0].wait_ready()
            # Warm-up: one session through a whole cycle (engine first-call costs), not timed.
            warm = Tally()
            await agent(clients[0], warm, "warm-up", 1, args.tokens, vocab, rng, [[]], server)
            samples: list[tuple[float, int]] = []
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_rss(server, args.rss_interval, samples, stop))
            tally = Tally()
            cycle_rss: list[list[int]] = [[] for _ in range(args.cycles)]
            start = time.perf_counter()
            await asyncio.gather(*(agent(clients[i % len(clients)], tally, f"agent-{i:03d}", args.cycles, args.tokens,
                                         vocab, random.Random(rng.random()), cycle_rss, server)
                                   for i in range(args.sessions)))
            wall = time.perf_counter() - start
            stop.set()
            await sampler
            health = await clients[0].health()
            for c in clients:
                await c.aclose()
        finally:
            server.stop()
    return {"tally": tally, "wall_s": wall, "samples": samples, "cycle_rss": cycle_rss, "health": health,
            "warm_errors": sum(warm.errors.values())}


def summarize(args: argparse.Namespace, out: dict[str, Any]) -> None:
    tally: Tally = out["tally"]
    wall = out["wall_s"]
    rows = []
    for op in OPS:
        s = tally.seconds[op]
        rows.append({"op": op, "calls": len(s), "errors": tally.errors[op], "ops_s": len(s) / wall,
                     "p50_ms": 1e3 * percentile(s, 50), "p99_ms": 1e3 * percentile(s, 99),
                     "max_ms": 1e3 * max(s, default=0.0), "mean_ms": 1e3 * (statistics.fmean(s) if s else 0.0)})
    calls = sum(r["calls"] for r in rows)
    errors = sum(tally.errors.values()) + out["warm_errors"]
    everything = [x for op in OPS for x in tally.seconds[op]]
    rows.append({"op": "all", "calls": calls, "errors": errors, "ops_s": calls / wall,
                 "p50_ms": 1e3 * percentile(everything, 50), "p99_ms": 1e3 * percentile(everything, 99),
                 "max_ms": 1e3 * max(everything, default=0.0), "mean_ms": 1e3 * statistics.fmean(everything)})
    mib = 1 / 2**20
    rss = [r for _, r in out["samples"]]
    per_cycle = [max(c) if c else 0 for c in out["cycle_rss"]]
    rss_row = {"op": "server_rss", "start_mib": rss[0] * mib, "peak_mib": max(rss) * mib, "end_mib": rss[-1] * mib,
               "after_cycle_1_mib": per_cycle[0] * mib,
               "growth_after_cycle_1_mib": (per_cycle[-1] - per_cycle[0]) * mib,
               "samples": len(rss)}
    print(f"load: {args.sessions} sessions x {args.cycles} cycles of append({args.tokens} tokens) -> checkpoint "
          f"-> drop -> resume, engine {args.preset}, {args.channels} channels: {calls} calls in {wall:.1f} s "
          f"= {calls / wall:.1f} calls/s, {tally.cycles_done} cycles, {errors} errors; health {out['health']}")
    print_table(rows, ["op", "calls", "errors", "ops_s", "p50_ms", "p99_ms", "max_ms", "mean_ms"])
    print("\nserver RSS (MiB): start {start_mib:.1f}, peak {peak_mib:.1f}, end {end_mib:.1f}; at the end of cycle 1 "
          "{after_cycle_1_mib:.1f}, growth from there to the last cycle {growth_after_cycle_1_mib:.1f}".format(**rss_row))
    print("per cycle (max over sessions):", ", ".join(f"{r * mib:.1f}" for r in per_cycle))
    for line in tally.first_errors:
        print("error:", line)
    cycles_expected = args.sessions * args.cycles
    floors = {"errors": Floor(float(errors), 0.0, higher_is_better=False),
              "cycles_completed": Floor(float(tally.cycles_done), float(cycles_expected))}
    print_floors(floors)
    path = write_results("load", device="cpu", params={
        "quick": args.quick, "sessions": args.sessions, "cycles": args.cycles, "tokens_per_append": args.tokens,
        "engine": args.preset, "channels": args.channels, "seed": args.seed, "wall_s": wall,
        "rss_interval_s": args.rss_interval,
        "rss_samples_mib": [(round(t, 2), round(r * mib, 1)) for t, r in out["samples"]],
        "rss_per_cycle_mib": [round(r * mib, 1) for r in per_cycle]}, rows=rows + [rss_row], floors=floors)
    print(f"\nwrote {path}")
    if errors or tally.cycles_done != cycles_expected:
        raise SystemExit(f"load: {errors} errors, {tally.cycles_done} of {cycles_expected} cycles completed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="under a minute on 2 cores: 12 sessions x 2 cycles, mini")
    parser.add_argument("--sessions", type=int, help="concurrent agent sessions (default 64; --quick 12)")
    parser.add_argument("--cycles", type=int, help="append/checkpoint/drop/resume cycles per session (default 3; --quick 2)")
    parser.add_argument("--tokens", type=int, help="tokens per append (default 96; --quick 48)")
    parser.add_argument("--preset", choices=sorted(VOCAB), help="server engine (default tiny; --quick mini)")
    parser.add_argument("--channels", type=int, default=4, help="client channels the sessions share")
    parser.add_argument("--rss-interval", type=float, default=0.5, help="seconds between server RSS samples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    defaults = {"sessions": 12, "cycles": 2, "tokens": 48, "preset": "mini"} if args.quick else \
        {"sessions": 64, "cycles": 3, "tokens": 96, "preset": "tiny"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.sessions < 1 or args.cycles < 1 or args.tokens < 1 or args.channels < 1:
        parser.error("--sessions, --cycles, --tokens and --channels must be >= 1")
    summarize(args, asyncio.run(run_load(args)))


if __name__ == "__main__":
    main()
