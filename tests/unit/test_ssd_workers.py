"""The SSD tier's worker threads (tiers/_hop.py): results, errors, cancellation, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tiers._hop import Workers


async def test_results_and_errors_come_back_to_the_awaiting_coroutine() -> None:
    workers = Workers(2, "t")
    try:
        assert await workers.run(lambda a, b: a + b, 2, 3) == 5
        assert await workers.run(threading.current_thread) is not threading.current_thread()
        with pytest.raises(FileNotFoundError, match="nope"):
            await workers.run(open, "/nonexistent/nope")
        results = await asyncio.gather(*(workers.run(time.sleep, 0.01) for _ in range(8)))
        assert results == [None] * 8
    finally:
        workers.shutdown()


async def test_a_cancelled_caller_does_not_break_the_worker() -> None:
    workers = Workers(1, "t")
    try:
        started, release, done = threading.Event(), threading.Event(), []

        def slow() -> str:
            started.set()
            release.wait(5)
            done.append(True)
            return "late"

        fut = workers.run(slow)
        assert await asyncio.to_thread(started.wait, 5)
        fut.cancel()
        release.set()
        assert await workers.run(lambda: "next") == "next"  # the same thread, after slow() ended
        assert done == [True] and fut.cancelled()
    finally:
        workers.shutdown()


async def test_in_flight_counts_jobs_until_their_outcome_reaches_the_loop() -> None:
    """Cancelled or not, failed or not: a job counts from `run` until the loop hears of it."""
    workers = Workers(2, "t")
    try:
        release = threading.Event()
        slow = workers.run(release.wait, 5)
        failing = workers.run(open, "/nonexistent/nope")
        assert workers.in_flight == 2
        with pytest.raises(FileNotFoundError):
            await failing
        assert workers.in_flight == 1
        slow.cancel()
        assert workers.in_flight == 1  # still running: its thread will want the GIL back
        release.set()
        for _ in range(500):
            if workers.in_flight == 0:
                break
            await asyncio.sleep(0.002)
        assert workers.in_flight == 0
    finally:
        workers.shutdown()


def test_a_result_for_a_closed_loop_is_dropped_and_the_thread_serves_on() -> None:
    workers = Workers(1, "t")
    release = threading.Event()

    async def submit() -> None:
        workers.run(release.wait, 5)  # never awaited: the loop closes first

    asyncio.run(submit())
    release.set()

    async def again() -> int:
        return await workers.run(lambda: 7)

    assert asyncio.run(again()) == 7
    workers.shutdown()


def test_shutdown_ends_the_threads_after_queued_jobs() -> None:
    workers = Workers(3, "t")
    threads = list(workers._threads)
    ran: list[int] = []

    async def queue_and_stop() -> None:
        futs = [workers.run(ran.append, i) for i in range(5)]
        workers.shutdown()
        await asyncio.gather(*futs)

    asyncio.run(queue_and_stop())
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()
    assert sorted(ran) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="num_threads"):
        Workers(0, "t")
