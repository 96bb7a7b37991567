"""Print every benchmark's floors from bench/results/*.json as one Markdown table.

`python -m bench.summary` regenerates the README's "Floors" table, so the README always shows
what the committed results say (value, floor, ok, date and device of the run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import RESULTS_DIR


def floor_rows(results_dir: Path = RESULTS_DIR) -> list[dict[str, str]]:
    rows = []
    for path in sorted(results_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        for name, f in doc.get("floors", {}).items():
            value = f["value"]
            rows.append({
                "benchmark": path.stem,
                "floor": name,
                "value": f"{value:.3g}" if isinstance(value, (int, float)) else str(value),
                "needs": f"{f['floor']:g}" if isinstance(f["floor"], (int, float)) else str(f["floor"]),
                "ok": "yes" if f["ok"] else "**no**",
                "run": f"{doc.get('date', '?')[:16]} {doc.get('device', '?')}",
            })
    return rows


def markdown(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "(no results)"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    rows = floor_rows()
    print(markdown(rows))
    missed = sum(r["ok"] != "yes" for r in rows)
    print(f"\n{len(rows) - missed} of {len(rows)} floors met", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
