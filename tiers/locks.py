"""Per-key mutual exclusion on the event loop, for the store and the SSD tier alike.

Both take a key's lock on their hottest path (every put), so an uncontended key costs one
dict insert and one delete: no `asyncio.Lock` per key, no context-manager objects on that
path (`try_acquire`/`acquire`/`release`), and no event or future unless someone waits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Hashable


class KeyLocks:
    """Per-key mutual exclusion, FIFO; a key is in the table only while held.

    Waiters queue as futures and the releasing holder hands the key to the first of them, still
    held: a key is never free between two holders, so nobody can barge in between (a caller
    that must not wait sees it `busy`), and a waiter cancelled in the queue drops out.
    """

    def __init__(self) -> None:
        self._held: dict[Hashable, collections.deque[asyncio.Future[None]] | None] = {}  # key -> waiters

    def busy(self, key: Hashable) -> bool:
        """Whether someone holds `key` (or it is being handed over)."""
        return key in self._held

    def try_acquire(self, key: Hashable) -> bool:
        """Take `key` if nobody holds it (True), never waiting; pair with `release`."""
        if key in self._held:
            return False
        self._held[key] = None
        return True

    async def acquire(self, key: Hashable) -> None:
        """Take `key`, waiting in line while another holds it; pair with `release`."""
        if self.try_acquire(key):
            return
        waiters = self._held[key]
        if waiters is None:
            waiters = self._held[key] = collections.deque()
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed the key just as it was cancelled
                self.release(key)
            else:
                with contextlib.suppress(ValueError):  # a release may have dropped it already
                    waiters.remove(fut)
            raise

    def release(self, key: Hashable) -> None:
        """Hand `key` to its first live waiter, or free it."""
        waiters = self._held[key]
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the key passes to this waiter, still held
                return
        del self._held[key]

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        await self.acquire(key)
        try:
            yield
        finally:
            self.release(key)
