"""The `statestore` command line. The only place where logging is configured.

Exit codes: 0 success, 1 failure, 2 rejected input.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence


def _cmd_demo(args: argparse.Namespace) -> int:
    from statestore.engine_demo import bytes_table, run_engine_demo

    report = run_engine_demo(args.preset, args.prompt_tokens, args.new_tokens, args.seed)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="statestore", description="KV-state persistence for CED/CSA2 models")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the bundled engine end to end and print what statestore keeps")
    demo.add_argument("--preset", default="tiny", choices=["mini", "tiny"], help="engine preset (CPU)")
    demo.add_argument("--prompt-tokens", type=int, default=1024)
    demo.add_argument("--new-tokens", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="machine-readable output")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on rejected input, 0 on --help
        return int(exc.code or 0)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"statestore: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
