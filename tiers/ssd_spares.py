"""The SSD tier's pools of files whose names are already durable (`tiers.ssd`): empty spares
a new key's put claims instead of paying a directory fsync, and recycled spares (a dropped
record's file, `tiers._fs.recycle`) a new record of as many blocks overwrites in place.
Bookkeeping only, on the event loop: the tier creates, fsyncs and unlinks the files."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from tiers._iobuffers import round_up

# Spare files kept ready for new keys. The pool starts at INITIAL_SPARE_FILES and doubles,
# up to `spare_files`, each time claims bring it down to a quarter (a tier that sees few new
# keys keeps a few spares; a busy one grows until its bursts take at most half). It is
# refilled in the background once half of it is claimed (after the batch, for `put_many`):
# SPARE_CHUNK creates per thread call, one directory fsync per refill.
DEFAULT_SPARE_FILES = 256
INITIAL_SPARE_FILES = 32
SPARE_CHUNK = 32
# Disk bytes the tier keeps as recycled spares (files of dropped records, `tiers._fs.recycle`)
# for new records of the same size in blocks, by default (`recycle_bytes`; never more than a quarter
# of a budget). A full cache drops about as many bytes as it writes, so a small reserve
# serves a steady stream; its bytes count against the budget and are given up first when a
# put needs room.
DEFAULT_RECYCLE_BYTES = 256 << 20


@dataclass(slots=True)
class SparePool:
    """Spare files (paths) whose names are durable, claimed by new keys' puts on the loop."""

    limit: int  # the most spares kept
    target: int = 0  # spares kept now: doubles up to `limit` when claims bring the pool to a quarter
    ready: collections.deque[str] = dataclasses.field(default_factory=collections.deque)
    refilling: bool = False
    ran_low: bool = False  # since the last refill: grow once per time the pool runs low

    def __post_init__(self) -> None:
        self.target = min(self.limit, INITIAL_SPARE_FILES)

    def claim(self) -> str | None:
        spare = self.ready.popleft() if self.ready else None
        if len(self.ready) <= self.target // 4 and not self.ran_low:
            self.ran_low = True
            self.target = min(self.limit, 2 * self.target)
        return spare

    def wants_refill(self) -> bool:
        return self.target > 0 and not self.refilling and len(self.ready) <= self.target // 2

    def running_low(self) -> bool:
        """Down to a quarter: refill now, busy or not."""
        return len(self.ready) <= self.target // 4


@dataclass(slots=True)
class RecyclePool:
    """Recycled spares (`tiers._fs.recycle`: durable names) by size in file-system blocks,
    claimed on the loop by new keys whose file takes as many blocks (sizes of one kind's records
    differ by a few bytes of metadata: an LMCache chunk's key string)."""

    limit_bytes: int
    block_bytes: int = 4096
    ready: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # block-rounded size -> paths
    held_bytes: int = 0  # block-rounded sizes of every file above, and of those being recycled

    def footprint(self, size: int) -> int:
        return round_up(size, self.block_bytes)

    def admit(self, size: int) -> bool:
        """Reserve room for one more file of `size` (False: over the limit, unlink it instead)."""
        need = self.footprint(size)
        if self.held_bytes + need > self.limit_bytes:
            return False
        self.held_bytes += need
        return True

    def abandon(self, size: int) -> None:
        """An admitted file that did not become a spare."""
        self.held_bytes -= self.footprint(size)

    def resize(self, admitted: int, actual: int) -> None:
        """An admitted file turned out to be `actual` bytes long, not `admitted`."""
        self.held_bytes += self.footprint(actual) - self.footprint(admitted)

    def claim(self, size: int) -> str | None:
        """A spare for a file of `size` bytes: one that takes as many blocks, or None."""
        rounded = self.footprint(size)
        paths = self.ready.get(rounded)
        if not paths:
            return None
        path = paths.pop()
        if not paths:
            del self.ready[rounded]
        self.held_bytes -= rounded
        return path

    def unclaim(self, path: str, size: int) -> None:
        """A claimed file its put did not use after all."""
        self.held_bytes += self.footprint(size)
        self.promote([(path, size)])

    def promote(self, files: Sequence[tuple[str, int]]) -> None:
        for path, size in files:
            self.ready.setdefault(self.footprint(size), []).append(path)

    def give_up(self, nbytes: int) -> list[str]:
        """Files to unlink so that `nbytes` more fit under a budget, largest first."""
        out: list[str] = []
        for rounded in sorted(self.ready, reverse=True):
            if nbytes <= 0:
                break
            paths = self.ready[rounded]
            while paths and nbytes > 0:
                out.append(paths.pop())
                self.held_bytes -= rounded
                nbytes -= rounded
            if not paths:
                del self.ready[rounded]
        return out
