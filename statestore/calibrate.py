"""`statestore calibrate`: measure this machine's costs and write the profile the policy loads.

What it measures (DESIGN.md §5: the cost model's constants are measured, not guessed):

- engine, per token by context length, through `CEDAdapter` (the `tiny` preset on the CPU;
  `--device cuda` measures the GPU path): prefill (chunked, so each point is the marginal
  cost at that context), decode, a bounded replay of R = W rows through the whole stack
  (what rebuilding SWA rings costs), and the encoder-only recompute of one global block
  given its predecessors (imported global state, B + W - 1 rows through the layers that
  publish, one row above);
- tiers, per record size class (4 KiB ... 4 MiB): put and get latency of the real tier code
  (host RAM; SSD in a temporary folder under the data dir, removed afterwards; Redis when
  `--redis-url` is given, under a throw-away prefix), fitted to latency + bytes / bandwidth.

`--quick` measures fewer contexts, sizes and repetitions (under ~30 s on 2 cores).
The CLI file wires `add_arguments` and `run` as the `calibrate` subcommand; `main(argv)`
runs it alone (`python -m statestore.calibrate`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from statestore.profile import CostProfile, EngineProfile, TierMeasurement, default_profile_path, fit_tier
from statestore.types import TierName
from tiers.base import Tier
from tiers.record import Record, make_record

KIB, MIB = 1 << 10, 1 << 20
SIZES_FULL = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)
SIZES_QUICK = (4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB)
CONTEXTS_FULL = (512, 1024, 2048, 4096)
CONTEXTS_QUICK = (512, 1024)
CONTEXTS_CUDA = (1024, 4096, 16384, 32768)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the profile (default: {default_profile_path()})")
    parser.add_argument("--quick", action="store_true", help="fewer contexts, sizes and repetitions (~30 s)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the engine runs")
    parser.add_argument("--preset", default=None, help="engine preset (default: tiny on cpu, v41 on cuda)")
    parser.add_argument("--block-tokens", type=int, default=256, help="tokens per global block (B)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="the SSD tier's data dir (a temporary folder is made under it)")
    parser.add_argument("--redis-url", default=None, help="also measure this Redis (e.g. redis://127.0.0.1:6379/0)")
    parser.add_argument("--no-engine", action="store_true", help="measure tiers only (engine: the previous profile's)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")


# ----- engine ---------------------------------------------------------------------------------

def measure_engine(preset: str, device: str, contexts: Sequence[int], block_tokens: int,
                   repeats: int = 1) -> EngineProfile:
    """Per-token prefill, decode, replay and encoder-recompute costs at each context length.

    Replays are repeated `repeats` times (the fastest counts); prefill and decode grow the
    sequence, so they run once per point.
    """
    import torch

    from engine_adapter.ced.adapter import CEDAdapter
    from engine_adapter.ced.config import get_preset
    from engine_adapter.ced.engine import CEDEngine
    from engine_adapter.ced.plan import RowPlan

    config = get_preset(preset)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    engine = CEDEngine(config, device=device, dtype=dtype)
    adapter = CEDAdapter(engine)
    align = adapter.token_alignment
    if block_tokens % align:
        raise ValueError(f"--block-tokens {block_tokens} must be a multiple of the engine's alignment {align}")
    w = config.sliding_window
    lead, replay_rows = w - 1, w
    encoder_top = config.candidate_source_layer_id
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (max(contexts) + 64,), generator=g).tolist()

    def timed_once(fn) -> float:  # type: ignore[no-untyped-def]
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def timed_replay(upto: int, seq: list[int], plan: RowPlan) -> float:
        """The fastest of `repeats` replays, each on a fresh state holding the global state of
        [0, upto): a repeat on the same state would find its entries already published."""
        best = math.inf
        for _ in range(repeats):
            fresh = adapter.new_state()
            adapter.import_range(fresh, adapter.export_range(live, 0, upto))
            best = min(best, timed_once(lambda: engine.replay(fresh, seq, plan)))
        return best

    warm = adapter.new_state()  # first-call costs (allocations, kernels, thread pools) off the clock
    adapter.append(warm, tokens[: min(contexts)])
    adapter.generate(warm, 1)

    prefill, decode, replay, encoder = [], [], [], []
    live = adapter.new_state()
    done = 0
    encoder_rows = RowPlan(tuple(block_tokens + lead if layer <= encoder_top else 1 for layer in range(config.n_layers)))
    replay_plan = RowPlan((replay_rows,) * config.n_layers)
    for ctx in contexts:
        chunk = tokens[done:ctx]
        prefill.append((ctx, timed_once(lambda: adapter.append(live, chunk)) / len(chunk)))
        done = ctx
        prefix = (ctx - block_tokens) // align * align
        encoder.append((ctx, timed_replay(prefix, tokens[: prefix + block_tokens], encoder_rows) / (block_tokens + lead)))
        end = ctx // align * align
        replay.append((ctx, timed_replay(end, tokens[:end], replay_plan) / replay_rows))
        probe = adapter.new_state()
        adapter.import_range(probe, adapter.export_range(live, 0, end))
        engine.replay(probe, tokens[:end], replay_plan)
        decode.append((ctx, timed_once(lambda: adapter.generate(probe, 2)) / 2))
    return EngineProfile(model=preset, device=device, measured=True, block_tokens=block_tokens,
                         lead_in_tokens=lead, replay_tokens=replay_rows, prefill=tuple(prefill),
                         decode=tuple(decode), replay=tuple(replay), encoder=tuple(encoder))


# ----- tiers ----------------------------------------------------------------------------------------

def _record(size: int, i: int) -> Record:
    block_key = uuid.uuid4().bytes * 2
    return make_record(1, 0, os.urandom(16) * (size // 16), model_fingerprint=b"calibrate\x00\x00\x00\x00\x00\x00\x00",
                       tenant_id=bytes(16), block_key=block_key, token_start=0, token_end=i + 1)


async def measure_tier(tier: Tier, sizes: Sequence[int], reps: int) -> list[tuple[int, float, float]]:
    """(size, median put seconds, median get seconds) per size class, through the tier's own code."""
    samples = []
    for size in sizes:
        puts, gets = [], []
        for i in range(reps):
            record = _record(size, i)
            t0 = time.perf_counter()
            ok = await tier.put(record)
            puts.append(time.perf_counter() - t0)
            if not ok:
                raise RuntimeError(f"{tier.name} tier refused a {size} B calibration record")
            t0 = time.perf_counter()
            got = await tier.get(record.key)
            gets.append(time.perf_counter() - t0)
            if got is None:
                raise RuntimeError(f"{tier.name} tier lost a {size} B calibration record")
            await tier.delete(record.key)
        samples.append((size, statistics.median(puts), statistics.median(gets)))
    return samples


async def measure_tiers(sizes: Sequence[int], reps: int, data_dir: Path,
                        redis_url: str | None) -> dict[TierName, TierMeasurement]:
    from tiers.host import HostTier
    from tiers.ssd import SSDTier

    out: dict[TierName, TierMeasurement] = {}
    host = HostTier(4 * max(sizes) + 64 * MIB)
    out[TierName.HOST] = fit_tier(await measure_tier(host, sizes, reps), "host RAM (HostTier)")
    data_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="calibrate-", dir=data_dir))
    try:
        ssd = SSDTier(root / "ssd")
        await ssd.open()
        try:
            out[TierName.SSD] = fit_tier(await measure_tier(ssd, sizes, reps), f"SSDTier under {data_dir}")
        finally:
            await ssd.aclose()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if redis_url:
        from tiers.redis import RedisTier

        redis = RedisTier(redis_url, prefix=f"calibrate-{uuid.uuid4().hex[:8]}")
        try:
            out[TierName.REDIS] = fit_tier(await measure_tier(redis, sizes, reps), redis_url)
        finally:
            await redis.aclose()
    return out


# ----- the command ---------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    """Measure, write the profile, print a summary. 0 on success, 1 on a measurement error."""
    from statestore.config import default_data_dir

    t0 = time.perf_counter()
    out = args.out or default_profile_path()
    data_dir = args.data_dir or default_data_dir()
    preset = args.preset or ("v41" if args.device == "cuda" else "tiny")
    contexts = CONTEXTS_CUDA if args.device == "cuda" else (CONTEXTS_QUICK if args.quick else CONTEXTS_FULL)
    sizes, reps = (SIZES_QUICK, 3) if args.quick else (SIZES_FULL, 9)
    try:
        if args.no_engine:
            engine = CostProfile.load(out).engine
        else:
            print(f"engine: {preset} on {args.device}, contexts {list(contexts)} ...", file=sys.stderr)
            engine = measure_engine(preset, args.device, contexts, args.block_tokens, repeats=1 if args.quick else 2)
        print(f"tiers: sizes {[s // KIB for s in sizes]} KiB x {reps} ...", file=sys.stderr)
        tiers = asyncio.run(measure_tiers(sizes, reps, data_dir, args.redis_url))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 1
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "quick": bool(args.quick), "seconds": round(time.perf_counter() - t0, 2)}
    profile = CostProfile(engine, tiers, machine, _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    path = profile.save(out)
    if args.json:
        import json

        print(json.dumps(profile.to_dict(), indent=2))
    else:
        print_summary(profile)
    print(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    return 0


def print_summary(profile: CostProfile) -> None:
    e = profile.engine
    print(f"engine {e.model} on {e.device} (B={e.block_tokens}, lead-in {e.lead_in_tokens}, R={e.replay_tokens})")
    print(f"  {'context':>8} {'prefill us/tok':>15} {'decode ms/tok':>14} {'replay us/tok':>14} {'encoder us/tok':>15}")
    for (ctx, p), (_, d), (_, r), (_, enc) in zip(e.prefill, e.decode, e.replay, e.encoder):
        print(f"  {ctx:>8} {p * 1e6:>15.1f} {d * 1e3:>14.2f} {r * 1e6:>14.1f} {enc * 1e6:>15.1f}")
    print(f"  block rebuild (B at context {e.prefill[-1][0]}): {e.block_rebuild_s(e.prefill[-1][0] - e.block_tokens, e.prefill[-1][0]) * 1e3:.1f} ms; "
          f"ring rebuild: {e.ring_rebuild_s(e.prefill[-1][0]) * 1e3:.1f} ms")
    for name, m in profile.tiers.items():
        print(f"tier {name.value}: latency {m.latency_s * 1e6:.1f} us, bandwidth {m.bandwidth_bytes_per_s / 1e9:.2f} GB/s ({m.where})")
        for size, put, get in m.samples:
            print(f"  {size // KIB:>6} KiB  put {put * 1e6:>9.1f} us  get {get * 1e6:>9.1f} us")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statestore calibrate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
