"""Session resume: time to the first new token after a resume, by replay mode, vs a re-prefill.

    python -m bench.resume [--quick] [--repeats N] [--threads N] [--preset tiny]

For `tiny` in fp32 on the CPU at 1K/4K/8K tokens (--quick: 1K/2K), one session is prefilled and
checkpointed (LOCAL: fsynced on a real SSD tier under a temporary directory), then resumed
through `SessionManager` in four ways, all in one run and on the same engine:

    bounded   load the global FP4 state, replay R = W (+ the pair edge) rows through every layer
    exact     load the global FP4 state, replay the exact staircase (1 + L(W-1) rows at layer 0)
    rings     the SWA rings and compressor tails kept in host RAM (`keep_rings_ttl_s`): load only
    off       a full re-prefill from the token ids (the in-run reference)

Time to first new token = `resume()` + `generate(1)` (which also runs the one decode step that
follows the token, the same for every case). bounded/exact/off resume from a store reopened
over the directory (host RAM empty, so the global state comes from the SSD files; the OS page
cache is warm), rings from the store that holds them. Each figure is the best of `--repeats`
after a warm-up resume. The first logits of `bounded` are compared with `exact` (max |delta
logit|, top-1, KL). Writes bench/results/resume.json; floors (none set for CPU by the issue):
resume faster than a re-prefill at the largest length, `<mode>_speedup_<n>k` >= 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import Floor, print_floors, print_table, write_results
from engine_adapter.ced import CEDEngine, get_preset
from engine_adapter.ced.adapter import CEDAdapter
from replay.quality import logits_divergence
from statestore.sessions import ResumeReport, SessionConfig, SessionManager
from statestore.store import TieredStore
from tiers.host import HostTier
from tiers.ssd import SSDTier

TENANT, SESSION = "bench", "resume"
SECRET = b"bench-resume-secret-0123456789ab"
BLOCK_SIZE = 256
HOST_BUDGET = 256 << 20
RINGS_TTL_S = 3600.0
FLOOR_SPEEDUP = 1.0  # a resume must beat a re-prefill (no CPU floor is set by the issue)
CASES = ("bounded", "exact", "rings", "off")


@dataclass(frozen=True, slots=True)
class Timed:
    """One resume: the report and the time to the first new token."""

    report: ResumeReport
    ttft_s: float
    logits: torch.Tensor


async def open_store(root: Path) -> TieredStore:
    store = TieredStore(host=HostTier(HOST_BUDGET), ssd=await SSDTier.create(root))
    await store.open()
    return store


async def timed_resume(sessions: SessionManager, mode: str) -> Timed:
    """resume + generate(1) on an idle session (the first logits are copied between the two,
    off the clock); the session is dropped again afterwards."""
    t0 = time.perf_counter()
    report = await sessions.resume(TENANT, SESSION, mode)
    resume_s = time.perf_counter() - t0
    first = sessions.live_state(TENANT, SESSION).last_logits.detach().clone()  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    await sessions.generate(TENANT, SESSION, 1)
    ttft = resume_s + time.perf_counter() - t0
    await sessions.drop(TENANT, SESSION)
    return Timed(report, ttft, first)


async def best_resume(root: Path, adapter: CEDAdapter, mode: str, repeats: int) -> Timed:
    """Best of `repeats` after a warm-up, each from a store reopened over the SSD directory
    (host RAM empty: the global state comes from the files)."""
    runs = []
    for _ in range(repeats + 1):
        store = await open_store(root)
        sessions = SessionManager(store, adapter, SessionConfig(secret=SECRET, block_size=BLOCK_SIZE))
        try:
            runs.append(await timed_resume(sessions, mode))
        finally:
            await sessions.aclose()
            await store.aclose()
    return min(runs[1:], key=lambda t: t.ttft_s)


async def best_rings_resume(root: Path, adapter: CEDAdapter, repeats: int) -> tuple[Timed, int]:
    """Checkpoint again with rings kept in host RAM, then resume from them `repeats` (+1) times."""
    store = await open_store(root)
    sessions = SessionManager(store, adapter, SessionConfig(secret=SECRET, block_size=BLOCK_SIZE,
                                                            keep_rings_ttl_s=RINGS_TTL_S))
    try:
        await sessions.resume(TENANT, SESSION, "exact")
        report = await sessions.checkpoint(TENANT, SESSION)
        await sessions.drop(TENANT, SESSION)
        ring_bytes = sum(v for k, v in report.bytes_written.items() if k in ("SWA_RING", "COMPRESSOR_TAIL", "OPAQUE"))
        runs = [await timed_resume(sessions, "exact") for _ in range(repeats + 1)]
        best = min(runs[1:], key=lambda t: t.ttft_s)
        assert best.report.mode == "rings", best.report
        return best, ring_bytes
    finally:
        await sessions.aclose()
        await store.aclose()


def divergence(ref: torch.Tensor, other: torch.Tensor) -> dict[str, Any]:
    d = logits_divergence(ref, other)
    return {"max_dlogit_vs_exact": d.max_abs_dlogit, "top1_vs_exact": d.top1_same, "kl_vs_exact": d.kl}


async def measure_length(engine: CEDEngine, num_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Prefill and checkpoint one session of `num_tokens`, then time each resume case."""
    adapter = CEDAdapter(engine)
    tokens = torch.randint(0, engine.config.vocab_size, (num_tokens,),
                           generator=torch.Generator().manual_seed(num_tokens)).tolist()
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        root = Path(tmp) / "ssd"
        store = await open_store(root)
        sessions = SessionManager(store, adapter, SessionConfig(secret=SECRET, block_size=BLOCK_SIZE))
        try:
            await sessions.create(TENANT, SESSION)
            t0 = time.perf_counter()
            await sessions.append(TENANT, SESSION, tokens)
            prefill_s = time.perf_counter() - t0
            checkpoint = await sessions.checkpoint(TENANT, SESSION)
            await sessions.drop(TENANT, SESSION)
        finally:
            await sessions.aclose()
            await store.aclose()
        timed = {mode: await best_resume(root, adapter, mode, repeats) for mode in ("bounded", "exact", "off")}
        timed["rings"], ring_bytes = await best_rings_resume(root, adapter, repeats)
    rows = []
    for case in CASES:
        t = timed[case]
        r = t.report
        row: dict[str, Any] = {
            "tokens": num_tokens, "case": case, "mode": r.mode, "ttft_s": t.ttft_s, "resume_s": r.seconds,
            "load_s": r.load_seconds, "replay_s": r.replay_seconds, "replay_tokens": r.replay_tokens,
            "row_layers": r.row_layers, "bytes_loaded": r.bytes_loaded,
            "speedup_vs_reprefill": timed["off"].ttft_s / t.ttft_s,
            "checkpoint_bytes": checkpoint.total_bytes + (ring_bytes if case == "rings" else 0),
            "prefill_s": prefill_s,
        }
        row.update(divergence(timed["exact"].logits, t.logits))
        rows.append(row)
    return rows


async def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    config = get_preset(args.preset)
    lengths = [1024, 2048] if args.quick else [1024, 4096, 8192]
    load_before = os.getloadavg()
    engine = CEDEngine(config, seed=0, dtype=torch.float32)
    rows: list[dict[str, Any]] = []
    for n in lengths:
        rows += await measure_length(engine, n, args.repeats)
    print(f"resume: {config.name} fp32 on cpu ({args.threads} threads), block {BLOCK_SIZE}, best of "
          f"{args.repeats}; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print_table(rows, ["tokens", "case", "ttft_s", "load_s", "replay_s", "replay_tokens", "row_layers",
                       "bytes_loaded", "speedup_vs_reprefill", "max_dlogit_vs_exact", "top1_vs_exact",
                       "kl_vs_exact"])
    largest = max(lengths)
    floors = {f"{case}_speedup_{largest // 1024}k": Floor(round(r["speedup_vs_reprefill"], 3), FLOOR_SPEEDUP)
              for r in rows for case in ("bounded", "exact", "rings") if r["tokens"] == largest and r["case"] == case}
    print_floors(floors)
    params = {"preset": config.name, "dtype": "float32", "threads": args.threads, "lengths": lengths,
              "repeats": args.repeats, "quick": args.quick, "block_size": BLOCK_SIZE, "durability": "LOCAL",
              "tiers": "host + ssd (reopened per bounded/exact/off resume)", "rings_ttl_s": RINGS_TTL_S,
              "ttft": "resume() + generate(1) through SessionManager",
              "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0],
              "config": config.to_dict()}
    path = write_results("resume", device="cpu", params=params, rows=rows, floors=floors)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.resume", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1K/2K only (under a minute on 2 cores)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed resumes per case, after one warm-up (default 3; 2 with --quick)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
