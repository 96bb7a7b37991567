"""Thread work that writes into someone else's memory, awaited so that a cancellation cannot
outrun it: for the SSD tier's deliveries and the service's shared-memory copies alike.

A cancelled `await loop.run_in_executor(...)` or `asyncio.to_thread(...)` returns at once,
while the thread goes on: a copy into a caller's buffer or a shared-memory slot then keeps
writing after the caller was told the call is over, and may already have handed that memory to
someone else (a get cancelled mid-delivery went on writing into its target for milliseconds).
Here a cancellation waits for the thread's call to end, then is raised; the wait is one copy
of at most a record, never a disk read.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
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
