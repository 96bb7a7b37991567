"""tiers.offload: thread work that writes into a caller's memory is over before a cancellation
reaches the caller."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

from tiers.offload import run_to_completion, to_thread_to_completion, wait_through_cancel


def _fill_when_let(buf: bytearray, let: threading.Event, started: threading.Event) -> int:
    started.set()
    assert let.wait(10)
    buf[:] = b"x" * len(buf)
    return len(buf)


async def _started(started: threading.Event) -> None:
    while not started.is_set():
        await asyncio.sleep(0.001)


async def test_a_cancelled_caller_gets_the_cancellation_only_once_the_thread_is_done() -> None:
    buf, let, started = bytearray(64), threading.Event(), threading.Event()
    task = asyncio.create_task(to_thread_to_completion(_fill_when_let, buf, let, started))
    await _started(started)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the thread, which has not written yet
    assert buf == bytearray(64)
    let.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert buf == b"x" * 64  # written before the cancellation came through


async def test_a_cancellation_repeated_while_waiting_is_still_held() -> None:
    buf, let, started = bytearray(8), threading.Event(), threading.Event()
    task = asyncio.create_task(to_thread_to_completion(_fill_when_let, buf, let, started))
    await _started(started)
    for _ in range(3):
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done()
    let.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert buf == b"x" * 8


async def test_results_and_failures_come_through_uncancelled() -> None:
    assert await to_thread_to_completion(sum, [1, 2, 3]) == 6
    assert await to_thread_to_completion(int, "ff", base=16) == 255
    with pytest.raises(ValueError, match="invalid literal"):
        await to_thread_to_completion(int, "not a number")


async def test_a_failure_behind_a_cancellation_is_dropped_quietly() -> None:
    """The cancellation wins; the thread's failure, which nobody awaits any more, is not
    reported as an exception never retrieved."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    let, started = threading.Event(), threading.Event()

    def fail() -> None:
        started.set()
        assert let.wait(10)
        raise OSError("the copy failed")

    fut = loop.run_in_executor(None, fail)
    task = asyncio.create_task(wait_through_cancel(fut))
    await _started(started)
    task.cancel()
    await asyncio.sleep(0.01)
    let.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    del fut, task
    gc.collect()
    await asyncio.sleep(0)
    assert reported == []
    loop.set_exception_handler(None)


async def test_run_to_completion_finishes_the_work_before_the_cancellation_comes_through() -> None:
    steps: list[int] = []

    async def steps_of_work() -> str:
        for i in range(5):
            await asyncio.sleep(0.01)
            steps.append(i)
        return "done"

    task = asyncio.create_task(run_to_completion(steps_of_work()))
    while not steps:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == [0, 1, 2, 3, 4]  # none cut off
    assert await run_to_completion(steps_of_work()) == "done"
