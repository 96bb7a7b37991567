"""One protocol for every medium: host RAM, SSD files, Redis (and CUDA memory later).

A tier is a thin, honest byte store of records. It never chooses what to evict: the store
(mechanism) asks the policy and then calls `delete`. A miss, a full tier or an outage is a
result (`None`, `False`, a count of hits), not an exception: callers on the serving path must
never see a tier's trouble as an error.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiers.record import HEADER_SIZE, Record, RecordHeader, RecordKey


@dataclass(frozen=True, slots=True)
class KindUsage:
    """Residency of one kind in one tier, in bytes actually held."""

    num_records: int = 0
    payload_bytes: int = 0  # raw or stored payload bytes of the records
    overhead_bytes: int = 0  # headers, padding to pages, index entries, file-system slack

    @property
    def resident_bytes(self) -> int:
        return self.payload_bytes + self.overhead_bytes


@dataclass(frozen=True, slots=True)
class TierUsage:
    """A snapshot of what a tier holds. `resident_bytes` counts everything its records cost
    (payload, padding, headers, index); `reserve_bytes` what it holds beyond them for reuse."""

    name: str
    budget_bytes: int  # 0 = unbounded (the tier never refuses for size)
    by_kind: dict[int, KindUsage] = field(default_factory=dict)
    healthy: bool = True
    # Bytes held for reuse, not records (the SSD tier's recycled spares): part of what the
    # tier occupies and of its budget, given up first when a put needs the room.
    reserve_bytes: int = 0

    @property
    def resident_bytes(self) -> int:
        return sum(u.resident_bytes for u in self.by_kind.values())

    @property
    def num_records(self) -> int:
        return sum(u.num_records for u in self.by_kind.values())

    @property
    def fill(self) -> float:
        """Occupancy in [0, 1] (0 for an unbounded tier)."""
        return min(1.0, self.resident_bytes / self.budget_bytes) if self.budget_bytes else 0.0


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What a start-up scan found: the valid headers and what it had to discard."""

    headers: list[RecordHeader]
    discarded: list[str]  # one human-readable line per torn/corrupt/foreign object


class Tier(abc.ABC):
    """The async interface every tier implements.

    Invariants:
    - `put` returns only once the record is as durable as the medium makes it (an SSD put
      has fsynced the file and its directory; a Redis put has been acknowledged by Redis).
    - `get` never returns a record whose checksums fail; such a record is quarantined or
      deleted and reported as a miss.
    - `footprint(record)` is exactly what `usage()` grows by when the record is put.
    """

    name: str = "tier"

    @abc.abstractmethod
    async def put(self, record: Record) -> bool:
        """Store `record` under `record.key`, replacing any previous one. False: not stored
        (no room, medium unavailable); nothing half-written is left behind."""

    @abc.abstractmethod
    async def get(self, key: RecordKey) -> Record | None:
        """The record, verified, or None."""

    @abc.abstractmethod
    async def delete(self, key: RecordKey) -> bool:
        """Remove the record; True if it was there."""

    @abc.abstractmethod
    async def contains(self, keys: Sequence[RecordKey]) -> list[bool]:
        """Membership of each key (a batch: one round trip where the medium allows)."""

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Bytes held, per kind, counting headers, padding and index."""

    def occupancy(self) -> tuple[int, int]:
        """(budget_bytes, resident_bytes) of `usage()`, without its per-kind breakdown: what
        the store reads on every put and hit. A tier that keeps the totals at hand answers
        without building the snapshot."""
        usage = self.usage()
        return usage.budget_bytes, usage.resident_bytes

    @abc.abstractmethod
    def footprint(self, record: Record) -> int:
        """Resident bytes `record` would take in this tier."""

    def scanned_footprint(self, header: RecordHeader) -> int:
        """Resident bytes of a record this tier's scan found, from its header alone (the store
        indexes scanned records without their payloads). Default: the encoded size."""
        return HEADER_SIZE + (header.stored_length or header.raw_length)

    @abc.abstractmethod
    async def scan(self) -> ScanResult:
        """Walk the medium and return the headers of every valid record (re-indexing)."""

    async def reindex(self) -> ScanResult:
        """What a store indexing this tier needs: every valid record's header and what was
        discarded. A tier that already walked its medium when it opened answers from that
        walk instead of walking again (start-up would otherwise scan twice)."""
        return await self.scan()

    async def prefix_hits(self, keys: Sequence[RecordKey]) -> int:
        """Number of consecutive keys present from the start (longest stored prefix)."""
        hits = 0
        for present in await self.contains(keys):
            if not present:
                break
            hits += 1
        return hits

    async def get_many(self, keys: Sequence[RecordKey]) -> list[Record | None]:
        return [await self.get(k) for k in keys]

    async def put_many(self, records: Sequence[Record]) -> list[bool]:
        return [await self.put(r) for r in records]

    @property
    def healthy(self) -> bool:
        return True

    async def probe(self) -> bool:
        """Ask the medium whether it answers again, at most as often as the tier's own retry
        pacing allows (an unhealthy tier learns it recovered without waiting for traffic);
        returns `healthy`. Never raises."""
        return self.healthy

    async def aclose(self) -> None:
        """Release connections and files. Async resources are never closed by __del__."""
