"""Per-key locks (`tiers.locks.KeyLocks`), taken on every put by the store and the SSD tier."""

from __future__ import annotations

import asyncio

import pytest

from tiers.locks import KeyLocks


async def test_key_locks_hand_over_in_order_and_survive_a_cancelled_waiter() -> None:
    """FIFO hand-over, a cancelled waiter drops out, and the table forgets a key once nobody
    holds it."""
    locks, order = KeyLocks(), []
    assert locks.try_acquire(b"k") and not locks.try_acquire(b"k")

    async def take(name: str) -> None:
        async with locks.hold(b"k"):
            order.append(name)
            await asyncio.sleep(0)

    first, gone, last = (asyncio.create_task(take(n)) for n in ("first", "gone", "last"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    locks.release(b"k")
    await asyncio.gather(first, last)
    assert order == ["first", "last"] and gone.cancelled()
    assert locks.try_acquire(b"k")  # forgotten, then free again
    locks.release(b"k")
    assert not locks.busy(b"k") and locks._held == {}
    # A waiter cancelled after the holder released past it (its future skipped as done).
    assert locks.try_acquire(b"k")
    late = asyncio.create_task(locks.acquire(b"k"))
    await asyncio.sleep(0)
    late.cancel()
    locks.release(b"k")  # pops the cancelled future, skips it, forgets the key
    with pytest.raises(asyncio.CancelledError):
        await late
    assert locks._held == {}


async def test_a_released_key_passes_to_its_waiter_and_nobody_barges_in() -> None:
    """Between two holders the key stays busy: a caller that must not wait (the store's
    eviction and promotion, `try_acquire`) finds it taken, and the waiter gets it; other
    keys are independent."""
    locks = KeyLocks()
    assert locks.try_acquire("a") and locks.try_acquire("b")
    waiter = asyncio.create_task(locks.acquire("a"))
    await asyncio.sleep(0)
    locks.release("a")
    assert locks.busy("a") and not locks.try_acquire("a")  # handed over, not free
    await waiter
    locks.release("a")
    assert not locks.busy("a") and locks.busy("b")
    locks.release("b")
    assert locks._held == {}
