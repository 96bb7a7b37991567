"""`bench.common.wait_until`: returns as soon as the condition holds, and names what it waited
for when it gives up."""

from __future__ import annotations

import time

import pytest

from bench.common import wait_until


def test_wait_until_returns_once_done() -> None:
    calls = iter([False, False, True])
    wait_until(lambda: next(calls), "never", timeout_s=5.0, poll_s=0.001)
    assert next(calls, None) is None  # polled exactly until it held


def test_wait_until_gives_up_naming_what() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"the thing did not happen \(waited 0.05 s\)"):
        wait_until(lambda: False, "the thing did not happen", timeout_s=0.05, poll_s=0.01)
    assert time.monotonic() - started >= 0.05
