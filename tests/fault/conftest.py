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


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run an in-process engine on one intra-op thread, restored afterwards.

    On the shared 2-core machine, torch's default thread pool spins against the server's and
    the other processes' threads: the same session work took 31.6 s with 2 threads and 3.0 s
    with 1 under a load average of 7. Server processes get OMP_NUM_THREADS=1 (nodes.py).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
