"""Fixtures of the fault tests: `statestore serve` processes (tests/fault/nodes.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault.nodes import NodeSet, node_set


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[NodeSet]:
    """Make server processes with `nodes.make(name, ...)`; all are killed at teardown."""
    yield from node_set(tmp_path)
