"""What every benchmark shares: the results file format of DESIGN.md §7 and table printing.

Each benchmark writes `bench/results/<name>[-<device>].json` with the keys `name`, `date`,
`machine`, `device`, `versions`, `params`, `rows` (flat dicts, one per measured case) and
`floors` (`{floor_name: {"value": v, "floor": f, "ok": bool}}`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def versions(*packages: str) -> dict[str, str]:
    out = {}
    for name in ("statestore", "torch", "grpcio", "redis", "zstandard", *packages):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


@dataclass(frozen=True, slots=True)
class Floor:
    """A named floor from an issue. `higher_is_better=False` for times and latencies."""

    value: float
    floor: float
    higher_is_better: bool = True

    @property
    def ok(self) -> bool:
        return self.value >= self.floor if self.higher_is_better else self.value <= self.floor

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "floor": self.floor, "ok": self.ok}


def wait_until(done: Callable[[], bool], what: str, *, timeout_s: float, poll_s: float) -> None:
    """Poll `done` every `poll_s` seconds until it is true; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} (waited {timeout_s:g} s)")
        time.sleep(poll_s)


def write_results(
    name: str,
    *,
    device: str,
    params: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    floors: Mapping[str, Floor] | None = None,
) -> Path:
    """Write the results JSON and return its path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    suffix = "" if device == "cpu" else f"-{device}"
    path = RESULTS_DIR / f"{name}{suffix}.json"
    doc = {
        "name": name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "device": device,
        "versions": versions(),
        "params": dict(params),
        "rows": [dict(r) for r in rows],
        "floors": {k: f.to_json() for k, f in (floors or {}).items()},
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Print rows as an aligned text table (floats to 4 significant digits)."""
    if not rows:
        print("(no rows)")
        return
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def print_floors(floors: Mapping[str, Floor]) -> None:
    for name, f in floors.items():
        mark = "ok" if f.ok else "BELOW FLOOR"
        rel = ">=" if f.higher_is_better else "<="
        print(f"floor {name}: {f.value:.4g} (need {rel} {f.floor:g}) {mark}")
