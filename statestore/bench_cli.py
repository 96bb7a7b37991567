"""`statestore bench`: the benchmarks of `bench/` from the CLI (DESIGN.md §6).

    statestore bench                        list them: what each measures, its latest committed run
    statestore bench summary                every floor of the committed results (bench.summary)
    statestore bench NAME [--quick] [ARGS]  run one: `python -m bench.NAME`, its table on stdout,
                                            its results written under bench/results/

The benchmarks live in the source checkout (`bench/` beside `statestore/`), not in an installed
wheel: they need the checkout's results folder and, for some, its test data. Without a checkout
the command says so (exit 2). A run is a child process of this interpreter, so a benchmark's
own options pass through unchanged and its exit status is the command's.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import statestore

# Modules of bench/ that are not benchmarks of their own.
_NOT_BENCHMARKS = frozenset({"__init__", "common"})
# Benchmarks that need more than the main environment, and what the user runs instead.
_NEEDS = {"lmcache_compare": ("lmcache", "make bench-lmcache (LMCache runs in a venv of its own, .venv-lmcache)")}


@dataclass(frozen=True, slots=True)
class Benchmark:
    name: str
    about: str  # the first sentence of its docstring
    last_run: str  # the date of its latest committed results ("" if none)


def bench_dir() -> Path | None:
    """The checkout's bench/ folder, if statestore runs from a checkout that has one."""
    folder = Path(statestore.__file__).resolve().parent.parent / "bench"
    return folder if (folder / "__init__.py").is_file() else None


def benchmarks(folder: Path) -> list[Benchmark]:
    """Every benchmark module in `folder`, read without importing it (some import torch)."""
    found = []
    for path in sorted(folder.glob("*.py")):
        if path.stem in _NOT_BENCHMARKS:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        found.append(Benchmark(path.stem, _summary_line(doc), _last_run(folder, path.stem)))
    return found


def _summary_line(doc: str, limit: int = 110) -> str:
    """A docstring's first sentence, within `limit` characters."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    if ". " in text:
        text = text[:text.index(". ") + 1]
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _last_run(folder: Path, name: str) -> str:
    dates = []
    for path in (folder / "results").glob(f"{name}*.json"):
        if path.stem == name or path.stem.startswith(f"{name}-"):  # name[-device]: not another name's prefix
            try:
                dates.append(str(json.loads(path.read_text()).get("date", ""))[:16])
            except (OSError, ValueError):
                continue
    return max(dates, default="")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="benchmark to run (none: list them); `summary` prints every floor")
    parser.add_argument("--quick", action="store_true", help="the benchmark's short run (under a minute on 2 cores)")
    parser.add_argument("--json", action="store_true", help="the list as JSON (without NAME)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="further options for the benchmark itself")


def run(args: argparse.Namespace) -> int:
    folder = bench_dir()
    if folder is None:
        print("statestore bench: the benchmarks ship with the source checkout (bench/ beside statestore/), "
              "not with an installed package; run statestore from a checkout (pip install -e .)", file=sys.stderr)
        return 2
    found = benchmarks(folder)
    if not args.name:
        return _list(found, as_json=args.json)
    names = [b.name for b in found]
    if args.name not in names:
        print(f"statestore bench: no benchmark {args.name!r}; there are: {', '.join(names)}", file=sys.stderr)
        return 2
    need = _NEEDS.get(args.name)
    if need is not None and importlib.util.find_spec(need[0]) is None:
        print(f"statestore bench: {args.name} needs {need[0]}, which this environment lacks: {need[1]}",
              file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", f"bench.{args.name}", *(["--quick"] if args.quick else []), *args.args]
    return subprocess.run(argv, cwd=folder.parent, check=False).returncode


def _list(found: list[Benchmark], *, as_json: bool) -> int:
    if as_json:
        print(json.dumps([{"name": b.name, "about": b.about, "last_run": b.last_run} for b in found], indent=2))
        return 0
    width = max(len(b.name) for b in found)
    for b in found:
        print(f"{b.name.ljust(width)}  {(b.last_run or 'no results').ljust(16)}  {b.about}")
    print("\nstatestore bench NAME [--quick] [options of the benchmark]   (results: bench/results/NAME.json)")
    return 0
