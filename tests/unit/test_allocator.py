"""The server's allocator setting: large buffers reused from the heap, not faulted in afresh."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt is glibc's")

PROBE = """
import resource, sys
from statestore.allocator import keep_large_buffers_in_heap
if sys.argv[1] == "tuned":
    assert keep_large_buffers_in_heap()
payload = b"x" * (1 << 20)
for _ in range(20):  # warm up
    bytes(bytearray(payload))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    bytes(bytearray(payload))  # a fresh 1 MiB buffer, freed at once: what a record join does
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_large_buffers_stop_page_faulting_once_tuned() -> None:
    default, tuned = _faults("default"), _faults("tuned")
    assert default > 200 * 100  # each 1 MiB buffer maps ~256 fresh pages by default
    assert tuned < default / 20, (default, tuned)
