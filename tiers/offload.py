"""Work that a cancellation must not cut off halfway, awaited so that the cancellation cannot
outrun it: thread work writing into someone else's memory (the SSD tier's deliveries and
writes, the service's shared-memory copies), and a stream's puts once the service began them.

A cancelled `await loop.run_in_executor(...)` or `asyncio.to_thread(...)` returns at once,
while the thread goes on: a copy into a caller's buffer or a shared-memory slot then keeps
writing after the caller was told the call is over, and may already have handed that memory to
someone else (a get cancelled mid-delivery went on writing into its target for milliseconds).
Here a cancellation waits for the work to end, then is raised; the wait is a copy or a write
of records already received, never a wait for a client or the network.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_through_cancel(fut: asyncio.Future[T]) -> T:
    """`await fut`, where `fut` is thread work writing into memory its caller hands back once it
    returns: a cancellation meanwhile is held until `fut` is done, then raised (the work's own
    outcome is then dropped)."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # noqa: BLE001 - fut's own failure: raised below (or dropped for the cancellation)
            pass
    if cancelled:  # (fut's failure, if any, was retrieved by the shield: it is not logged as unretrieved)
        raise asyncio.CancelledError
    return fut.result()


async def to_thread_to_completion(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`asyncio.to_thread(fn, *args, **kwargs)` whose cancellation waits for `fn` to return
    (`wait_through_cancel`)."""
    loop = asyncio.get_running_loop()
    return await wait_through_cancel(loop.run_in_executor(None, functools.partial(fn, *args, **kwargs)))


async def run_to_completion(work: Coroutine[Any, Any, T]) -> T:
    """Await `work` as a task of its own, which a cancellation of the caller does not reach: the
    cancellation waits for it to finish, then is raised (`wait_through_cancel`)."""
    return await wait_through_cancel(asyncio.ensure_future(work))
