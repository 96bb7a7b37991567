"""Imports flow one way (DESIGN.md §2, STYLE.md §2): statestore -> replay -> engine_adapter and
statestore -> tiers; what a record is on a medium knows neither the service nor the model, and
the store's core (keys, policy, store) never reaches the wire or torch.

Read from the source with `ast` (nothing is imported), so a violation names the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> top-level modules it must never import
FORBIDDEN = {
    "tiers": {"statestore", "replay", "engine_adapter", "proto", "bench", "grpc"},
    "engine_adapter": {"statestore", "tiers", "replay", "proto", "bench", "grpc"},
    "replay": {"statestore", "tiers", "proto", "bench", "grpc"},
    "statestore": {"bench", "tests"},
}
# the store's core: pure placement and bookkeeping, below the wire and away from torch
CORE = ["statestore/keys.py", "statestore/policy.py", "statestore/store.py", "statestore/types.py",
        "statestore/reuse.py", "statestore/cost_policy.py"]
CORE_FORBIDDEN = {"proto", "grpc", "torch", "statestore.server", "statestore.rpc", "statestore.client",
                  "statestore.messages", "statestore.record_stream", "statestore.sessions_service",
                  "statestore.store_service"}


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, relative imports resolved to absolute names."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . / .. / ... import: up level - 1 packages from this file's
                parts = package.split(".")[: max(0, len(package.split(".")) - (node.level - 1))]
                out.append((node.lineno, ".".join([*parts, *([node.module] if node.module else [])])))
            elif node.module:
                out.append((node.lineno, node.module))
    return out


def _matches(module: str, banned: set[str]) -> bool:
    return any(module == b or module.startswith(b + ".") for b in banned)


def violations(package: str, banned: set[str], root: Path = ROOT) -> list[str]:
    """'file:line imports module' for each import of a banned module under `root/package`."""
    return [f"{path.relative_to(root)}:{line} imports {module}"
            for path in sorted((root / package).rglob("*.py"))
            for line, module in imports(path, root) if _matches(module, banned)]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_downwards(package: str) -> None:
    bad = violations(package, FORBIDDEN[package])
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_store_core_stays_below_the_wire_and_away_from_torch() -> None:
    bad = [f"{rel}:{line} imports {module}" for rel in CORE
           for line, module in imports(ROOT / rel) if _matches(module, CORE_FORBIDDEN)]
    assert not bad, "the store's core reaches up:\n" + "\n".join(bad)


def test_the_checker_sees_upward_and_relative_imports(tmp_path: Path) -> None:
    """The rule can fail: absolute and relative imports upwards are both reported."""
    (tmp_path / "tiers" / "sub").mkdir(parents=True)
    (tmp_path / "tiers" / "a.py").write_text("import os\nfrom statestore.store import TieredStore\n")
    (tmp_path / "tiers" / "sub" / "b.py").write_text("from ...statestore import server\nfrom . import c\n")
    assert violations("tiers", FORBIDDEN["tiers"], tmp_path) == [
        "tiers/a.py:2 imports statestore.store", "tiers/sub/b.py:1 imports statestore"]
