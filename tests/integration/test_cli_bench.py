"""`statestore bench`: lists the checkout's benchmarks, runs one as a child process (its output
and exit status passed through), and rejects what it cannot run with exit 2 and a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import statestore
from statestore import bench_cli
from statestore.cli import main

CHECKOUT = Path(__file__).resolve().parents[2]


def test_bench_lists_every_benchmark_with_its_latest_committed_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--json"]) == 0
    listed = {b["name"]: b for b in json.loads(capsys.readouterr().out)}
    on_disk = {p.stem for p in (CHECKOUT / "bench").glob("*.py")} - {"__init__", "common"}
    assert set(listed) == on_disk and {"tiers", "server", "capacity", "lmcache_compare", "summary"} <= on_disk
    assert all(b["about"] for b in listed.values())  # every benchmark says what it measures
    tiers_run = json.loads((CHECKOUT / "bench" / "results" / "tiers.json").read_text())["date"][:16]
    assert listed["tiers"]["last_run"] == tiers_run
    assert listed["summary"]["last_run"] == ""  # writes no results of its own
    assert main(["bench"]) == 0
    table = capsys.readouterr().out
    assert "tiers" in table and tiers_run in table and "statestore bench NAME" in table


def test_bench_runs_a_benchmark_as_a_child_process(capfd: pytest.CaptureFixture[str]) -> None:
    """`summary` reads the committed results only: the child's table and its count come through."""
    assert main(["bench", "summary"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("| benchmark | floor |") and "| tiers |" in out
    assert "floors met" in err


def test_bench_rejects_what_it_cannot_run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    for name in ("nosuch", "common", "../tests/conftest"):
        assert main(["bench", name]) == 2
        assert "no benchmark" in capsys.readouterr().err
    # A benchmark whose extra dependency is missing says how to run it instead.
    monkeypatch.setitem(bench_cli._NEEDS, "summary", ("statestore_no_such_module", "install it first"))
    assert main(["bench", "summary"]) == 2
    assert "needs statestore_no_such_module" in capsys.readouterr().err
    # Without a checkout (statestore installed from a wheel: no bench/ beside it).
    monkeypatch.setattr(statestore, "__file__", str(tmp_path / "statestore" / "__init__.py"))
    assert bench_cli.bench_dir() is None
    assert main(["bench"]) == 2
    assert "source checkout" in capsys.readouterr().err
