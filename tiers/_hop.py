"""The SSD tier's worker threads: one thread hop per disk operation, awaited on the loop.

`loop.run_in_executor` wraps every call in a `concurrent.futures.Future` chained to an
asyncio future (a work item, two futures, a done-callback, a state copy back on the loop).
On the 2-core development VM that bookkeeping was ~50 us of event-loop CPU per call, a
tenth of a 256 KiB put. Here a job is a tuple on a `SimpleQueue`, and the thread that ran
it resolves the asyncio future with one `call_soon_threadsafe`.

What a hop still costs is mostly waking a thread that went idle: the development VM is a
Firecracker guest with `haltpoll.guest_halt_poll_ns=0`, so an idle vCPU halts and every
wake-up is a VM exit plus an IPI. A round trip of an empty job costs ~30 us, but around a
300 us blocking call (the loop thread sleeps meanwhile) it costs ~90 us of latency and ~40 us
of loop-thread CPU (thread_time); at queue depth 1 that is a quarter of a 256 KiB O_DIRECT
read. Pinning would hide it, and does not belong in a library on shared cores; nor does a
loop that spins while threads work (it holds the GIL they need to finish).

Reads of records below 2 MiB skip the hop where the kernel allows (`tiers._aio`: native AIO
from the loop, which polls for a lone read's completion); everything else comes here.

The threads live as long as the tier (starting one per operation would cost more than the
hop). They are daemon threads: at interpreter exit a job still queued is dropped like a
crash drops it, which the tier's protocols allow for (nothing queued was acknowledged).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class Workers:
    """`num_threads` threads running `fn(*args)` jobs for coroutines (`await workers.run(...)`)."""

    def __init__(self, num_threads: int, name: str) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._in_flight = 0  # jobs run() handed out whose outcome has not reached the loop yet
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run `fn(*args)` on a worker thread; the future resolves on the calling loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, fut, fn, args))
        self._in_flight += 1
        return fut

    @property
    def in_flight(self) -> int:
        """Jobs queued or running (their threads will want the GIL back)."""
        return self._in_flight

    def _settle(self, fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
        """On the loop: a caller that was cancelled meanwhile has given up on the result."""
        self._in_flight -= 1
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def shutdown(self) -> None:
        """Stop the threads once the jobs queued so far are done (does not wait for them)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, fut, fn, args = job
            job = None  # drop references to the arguments while idle
            try:
                result, exc = fn(*args), None
            except BaseException as error:  # handed to the awaiting coroutine, not lost here
                result, exc = None, error
            try:
                loop.call_soon_threadsafe(self._settle, fut, result, exc)
            except RuntimeError:  # the loop was closed: nobody is waiting any more
                pass
            del loop, fut, fn, args, result, exc
