"""The `statestore` command line. The only place where logging is configured.

    statestore serve [--listen HOST:PORT] [--data-dir DIR] [--config FILE]   run the service
    statestore demo [--engine-only]                                          the README's main job
    statestore ls | inspect | stats | pin | unpin | evict | resume           talk to a running server
    statestore calibrate | bench [NAME]                                      measure this machine

Client commands find the server with `--target` (env STATESTORE_TARGET, default
127.0.0.1:7450) and authenticate with `--token` (env STATESTORE_TOKEN). They print human
tables by default and one JSON document with `--json`.

Exit codes: 0 success, 1 failure (server unreachable, internal error), 2 rejected input
(bad arguments, or the server refused the request: INVALID_ARGUMENT, NOT_FOUND, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "127.0.0.1:7450"
_REJECTED = {"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION", "PERMISSION_DENIED",
             "OUT_OF_RANGE", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}


# ----- output helpers ----------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {(k.hex() if isinstance(k, bytes) else str(k)): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "name") and hasattr(value, "value"):  # enums
        return value.name
    return value


def _print_json(value: Any) -> None:
    print(json.dumps(_jsonable(value), indent=2, sort_keys=True))


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if n and _numeric(c) else c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if not rows:
        print("(none)")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _numeric(text: str) -> bool:
    return text.replace(",", "").replace(".", "", 1).isdigit()


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----- serve and demo ----------------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace) -> int:
    from statestore.config import load_config
    from statestore.server import serve

    config = load_config(args.config).with_overrides(
        listen=args.listen, data_dir=Path(args.data_dir).expanduser() if args.data_dir else None,
        engine_preset=args.preset, metrics_port=args.metrics_port)

    def ready(server: Any) -> None:
        # The process is the server from here: what start-up built (engine, index, ~200k objects)
        # lives as long as it does, so the collector stops walking it (a full pass took ~47 ms).
        gc.freeze()
        print(f"statestore serving on {config.host}:{server.port} (data {config.data_dir}, engine "
              f"{server.adapter.model_name}, pid {os.getpid()})", flush=True)

    asyncio.run(serve(config, ready))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.engine_only:
        return _engine_demo(args)
    from statestore.service_demo import run_service_demo

    return run_service_demo(data_dir=args.data_dir, preset=args.preset or "tiny", as_json=args.json)


def _engine_demo(args: argparse.Namespace) -> int:
    from statestore.engine_demo import bytes_table, run_engine_demo

    report = run_engine_demo(args.preset or "tiny", args.prompt_tokens, args.new_tokens, args.seed)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"CED engine '{report['preset']}' on the CPU (random seeded weights, built in {report['build_s']:.2f} s)")
    print(f"  prefill  {report['prompt_tokens']:>6} tokens  {report['prefill_s']:8.3f} s  "
          f"{report['prefill_tok_s']:10.0f} tok/s")
    print(f"  decode   {len(report['generated']):>6} tokens  {report['decode_s']:8.3f} s  "
          f"{report['decode_tok_s']:10.1f} tok/s")
    print(f"  generated: {report['generated']}")
    print(f"  exported global state of {report['exported_tokens']} tokens: {report['exported_bytes']:,} B = "
          f"{report['measured_bytes_per_token']:.1f} B/token")
    for preset in (report["preset"], "v41"):
        print(f"\nbytes per token, {preset} (from the config):")
        for row in bytes_table(preset):
            unit = "B/seq" if "per sequence" in row.what else "B/token"
            print(f"  {row.what:<48} {row.bytes_per_token:>12,.1f} {unit:<7}  {row.note}")
    return 0


# ----- client commands -----------------------------------------------------------------------


def _hex_keys(values: Sequence[str]) -> list[bytes]:
    out = []
    for v in values:
        try:
            key = bytes.fromhex(v)
        except ValueError:
            raise ValueError(f"record key {v!r} is not hex") from None
        if len(key) != 34:
            raise ValueError(f"record key {v!r} is {len(key)} bytes; record keys are 34 bytes (68 hex digits)")
        out.append(key)
    return out


async def _ls(c: Any, args: argparse.Namespace) -> Any:
    if args.records:
        records, truncated = await c.list_records(kind=args.kind, limit=args.limit)
        if args.json:
            return {"records": records, "truncated": truncated}
        _table(["key", "kind", "bytes", "tiers", "pinned", "durability"],
               [[r.key.hex(), r.kind_name, r.size_bytes, ",".join(r.tiers), r.pinned,
                 r.durability.name if r.durability else "-"] for r in records])
        if truncated:
            print(f"(first {len(records)} shown; raise --limit)")
        return None
    sessions = await c.list_sessions()
    if args.json:
        return {"sessions": sessions}
    _table(["session", "tokens", "live", "checkpoint", "checkpointed tokens", "messages"],
           [[s.session_id, s.num_tokens, s.live, s.checkpoint_version or "-", s.checkpointed_tokens,
             len(s.message_boundaries)] for s in sessions])
    return None


async def _inspect(c: Any, args: argparse.Namespace) -> Any:
    if args.key:
        (key,) = _hex_keys([args.key])
        info = await c.inspect(key)
        if args.json:
            return info
        doc = _jsonable(info)
        explain = doc.pop("explain", None)
        for name, value in doc.items():
            print(f"{name:>18}  {value}")
        if explain:
            print("why it is where it is (store and policy):")
            print("  " + json.dumps(explain, indent=2, sort_keys=True, default=str).replace("\n", "\n  "))
        return None
    session = await c.get_session(args.session_id)
    plan = await c.plan_resume(args.session_id, args.mode) if session.checkpoint_version else None
    kinds = await _session_kind_bytes(c)
    if args.json:
        return {"session": session, "resume_plan": plan, "bytes_by_kind_and_tier": kinds}
    print(f"session {session.session_id}: {session.num_tokens:,} tokens, live={session.live}, "
          f"checkpoint v{session.checkpoint_version} of {session.checkpointed_tokens:,} tokens, "
          f"{len(session.message_boundaries)} messages")
    if plan is not None:
        r = plan.replay
        print(f"resume plan ({r.mode}): load {sum(plan.bytes_by_tier.values()):,} B "
              f"({', '.join(f'{t} {b:,} B' for t, b in plan.bytes_by_tier.items())}), replay {r.replay_tokens} "
              f"tokens ({r.row_layers} row-layers), missing blocks {plan.missing_blocks}, est {plan.est_seconds:.3f} s")
    print("stored records of this tenant, by kind and tier:")
    _table(["kind", "tier", "records", "bytes"], [[k, t, n, b] for (k, t), (n, b) in sorted(kinds.items())])
    return None


async def _session_kind_bytes(c: Any) -> dict[tuple[str, str], tuple[int, int]]:
    records, _ = await c.list_records(limit=100_000)
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for r in records:
        for tier, nbytes in r.tiers.items():
            n, b = out.get((r.kind_name, tier), (0, 0))
            out[r.kind_name, tier] = (n + 1, b + nbytes)
    return out


async def _stats(c: Any, args: argparse.Namespace) -> Any:
    s = await c.stats()
    if args.json:
        return s
    print(f"model {s.model_name} ({s.model_fingerprint.hex()}), {s.num_records:,} records, "
          f"{s.live_sessions} live sessions, up {s.uptime_seconds:.0f} s")
    _table(["tier", "budget", "resident", "reserve", "fill", "healthy"],
           [[t.tier, t.budget_bytes or "unbounded", t.resident_bytes, t.reserve_bytes, f"{t.fill:.1%}", t.healthy]
            for t in s.tiers])
    print()
    _table(["tier", "kind", "records", "bytes", "hits", "misses", "evictions", "promotions"],
           [[k.tier, k.kind_name, k.num_records, k.resident_bytes, k.hits, k.misses, k.evictions, k.promotions]
            for k in s.kinds if k.kind])
    return None


async def _pin(c: Any, args: argparse.Namespace) -> Any:
    keys = _hex_keys(args.keys)
    changed = await (c.unpin(keys) if args.command == "unpin" else c.pin(keys))
    if args.json:
        return {"changed": changed, "keys": len(keys)}
    print(f"{args.command}ned {len(keys)} record(s); {changed} changed")
    return None


async def _evict(c: Any, args: argparse.Namespace) -> Any:
    removed = await c.evict(_hex_keys(args.keys), args.tier or (), force=args.force)
    if args.json:
        return {"evicted": {k.hex(): list(t) for k, t in removed.items()}}
    _table(["key", "removed from"], [[k.hex(), ",".join(t) or "(nothing: unknown or pinned)"]
                                     for k, t in removed.items()])
    return None


async def _resume(c: Any, args: argparse.Namespace) -> Any:
    _progress(f"resuming {args.session_id} ({args.mode or 'server default mode'}) ...")
    report = await c.resume(args.session_id, args.mode)
    generated: list[int] = []
    if args.generate:
        _progress(f"generating {args.generate} tokens ...")
        async for chunk in c.generate_stream(args.session_id, args.generate):
            generated += chunk
            if not args.json:
                _progress(f"  {len(generated)}/{args.generate}")
    if args.json:
        return {"resume": report, "seconds": report.seconds, "generated": generated}
    print(f"resumed {args.session_id}: mode {report.mode}, {report.num_tokens:,} tokens, "
          f"{report.persisted_tokens:,} loaded ({report.bytes_loaded:,} B) in {report.load_seconds:.3f} s, "
          f"{report.replay_tokens:,} replayed ({report.row_layers:,} row-layers) in {report.replay_seconds:.3f} s")
    if generated:
        print(f"generated: {generated}")
    return None


_CLIENT_COMMANDS = {"ls": _ls, "inspect": _inspect, "stats": _stats, "pin": _pin, "unpin": _pin, "evict": _evict,
                    "resume": _resume}


def _cmd_client(args: argparse.Namespace) -> int:
    from statestore.client import ServiceError, StateStoreClient

    async def run() -> Any:
        async with StateStoreClient(args.target, token=args.token or None) as c:
            return await _CLIENT_COMMANDS[args.command](c, args)

    try:
        result = asyncio.run(run())
    except ServiceError as exc:
        print(f"statestore {args.command}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 2 if exc.code.name in _REJECTED else 1
    if result is not None:
        _print_json(result)
    return 0


# ----- parser -------------------------------------------------------------------------------


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=os.environ.get("STATESTORE_TARGET", DEFAULT_TARGET),
                   help="server HOST:PORT (env STATESTORE_TARGET)")
    p.add_argument("--token", default=os.environ.get("STATESTORE_TOKEN"), help="bearer token (env STATESTORE_TOKEN)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=_cmd_client)


def version_line() -> str:
    """What an operator reports with a bug: the installed package's version, the record format
    its tiers write and read, and the wire protocol's package."""
    from tiers.record import FORMAT_VERSION

    try:
        installed = importlib.metadata.version("statestore")
    except importlib.metadata.PackageNotFoundError:  # a source tree run without installing it
        installed = "unknown (not installed)"
    return f"statestore {installed} (record format {FORMAT_VERSION}, protocol statestore.v1)"


class _VersionAction(argparse.Action):
    """`--version`, its line built only when asked: the installed package's metadata lookup
    (~26 ms on the development VM) is paid by no other command at start-up."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statestore", description="KV-state persistence for CED/CSA2 models")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action=_VersionAction,
                        help="the package version, record format and wire protocol, then exit")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gRPC service until SIGTERM/SIGINT")
    serve.add_argument("--listen", help="HOST:PORT (port 0 = any free port); default 127.0.0.1:7450")
    serve.add_argument("--data-dir", help="SSD tier and service secret (default: the user's cache folder)")
    serve.add_argument("--config", help="TOML config file (STATESTORE_* env overrides it)")
    serve.add_argument("--preset", choices=["mini", "tiny"], help="bundled engine preset (default tiny)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = none)")
    serve.set_defaults(func=_cmd_serve)

    demo = sub.add_parser("demo", help="the service end to end: session, checkpoint, restart, resume")
    demo.add_argument("--engine-only", action="store_true", help="run only the engine (no service)")
    demo.add_argument("--data-dir", help="service data dir (default: demo/ under the user's cache folder)")
    demo.add_argument("--preset", choices=["mini", "tiny"], help="engine preset (default tiny)")
    demo.add_argument("--prompt-tokens", type=int, default=1024, help="--engine-only: prompt length")
    demo.add_argument("--new-tokens", type=int, default=16, help="--engine-only: tokens to generate")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.set_defaults(func=_cmd_demo)

    ls = sub.add_parser("ls", help="list sessions (or records with --records)")
    ls.add_argument("--records", action="store_true", help="list records instead of sessions")
    ls.add_argument("--kind", type=int, default=0, help="only this kind code (with --records)")
    ls.add_argument("--limit", type=int, default=0, help="at most this many records (default 1000)")
    _client_args(ls)

    inspect = sub.add_parser("inspect", help="a session (kinds, bytes per tier, resume plan) or a record (--key)")
    inspect.add_argument("session_id", nargs="?", help="session to inspect")
    inspect.add_argument("--key", help="record key (68 hex digits) to inspect instead")
    inspect.add_argument("--mode", default="", choices=["", "exact", "bounded", "off"], help="resume plan mode")
    _client_args(inspect)

    stats = sub.add_parser("stats", help="per-tier occupancy and hit rates")
    _client_args(stats)

    for name in ("pin", "unpin"):
        p = sub.add_parser(name, help=f"{name} records (protect from eviction)" if name == "pin" else "lift pins")
        p.add_argument("keys", nargs="+", help="record keys (68 hex digits)")
        _client_args(p)

    evict = sub.add_parser("evict", help="remove records from tiers")
    evict.add_argument("keys", nargs="+", help="record keys (68 hex digits)")
    evict.add_argument("--tier", action="append", choices=["host", "ssd", "redis"], help="only these tiers")
    evict.add_argument("--force", action="store_true", help="evict pinned records too")
    _client_args(evict)

    from statestore import calibrate as calibrate_module  # its measurements import torch lazily

    calibrate = sub.add_parser("calibrate", help="measure engine and tier costs; write the profile the cost policy loads")
    calibrate_module.add_arguments(calibrate)
    calibrate.set_defaults(func=calibrate_module.run)

    from statestore import bench_cli  # reads bench/ of the checkout; runs a benchmark as a child process

    bench = sub.add_parser("bench", help="list or run the benchmarks of the source checkout (bench/)")
    bench_cli.add_arguments(bench)
    bench.set_defaults(func=bench_cli.run)

    resume = sub.add_parser("resume", help="resume a checkpointed session, optionally generate")
    resume.add_argument("session_id")
    resume.add_argument("--mode", default="", choices=["", "exact", "bounded", "off"])
    resume.add_argument("--generate", type=int, default=0, help="tokens to generate after resuming")
    _client_args(resume)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on rejected input, 0 on --help
        return int(exc.code or 0)
    if args.command == "inspect" and not (args.session_id or args.key):
        print("statestore inspect: give a session id or --key", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # ConfigError included
        print(f"statestore: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"statestore: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1


if __name__ == "__main__":
    sys.exit(main())
