"""The host tier: records in RAM, in per-kind page pools (see `tiers.pools`).

A thin byte store: it refuses (False) what its budget cannot fit and never chooses what to
evict; the store's policy does. Every record keeps its encoded header (with the payload
checksum), which `get` verifies, so a bit flip in RAM is a miss, never served.

Everything here is in-memory bookkeeping plus memcpy: no call awaits, so each operation is
atomic on the event loop.

`stage` copies a record's payload into pages reserved ahead of its `put`, which then takes them
without copying: a server stages each record of a PutRecords stream as it is verified, while
the rest of the stream still comes in, and stores nothing before the whole stream is verified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from tiers.base import ScanResult, Tier, TierUsage
from tiers.pools import DEFAULT_PAGE_BYTES, Allocation, PerKindPools, PoolSet, SinglePagePool, Slice
from tiers.record import Record, RecordHeader, RecordKey, decode_header, encode_header, payload_checksum, read_back


@dataclass(frozen=True, slots=True)
class _Resident:
    header: bytes  # the encoded header: HEADER_SIZE bytes, counted in the footprint
    alloc: Allocation


@dataclass(frozen=True, slots=True)
class _Staged:
    payload: object  # held: staged pages are found by the payload's id, which stays its own meanwhile
    kind: int
    alloc: Allocation
    footprint: int
    checksum: int  # of the bytes staged: what the header stores, whatever the payload holds later


class HostTier(Tier):
    """Records in host RAM.

    Args:
        budget_bytes: bytes the tier may hold: slabs, headers and index entries (> 0).
        page_sizes: kind code -> page size; kinds not listed get `default_page_bytes`.
            `statestore.store.make_page_sizes` derives them from the engine's specs.
        slab_bytes: slab growth unit (default: min(64 MiB, budget / 16)).
        single_page: use one page size for every kind (the largest): the vLLM-style
            allocator, for comparisons only.
        materialize: False = accounting only (no memory; put/get refuse): capacity planning.
    """

    name = "host"

    def __init__(self, budget_bytes: int, page_sizes: Mapping[int, int] | None = None,
                 default_page_bytes: int = DEFAULT_PAGE_BYTES, *, slab_bytes: int | None = None,
                 single_page: bool = False, materialize: bool = True) -> None:
        self._pools: PoolSet
        if single_page:
            largest = max([default_page_bytes, *(page_sizes or {}).values()])
            self._pools = SinglePagePool(budget_bytes, largest, slab_bytes=slab_bytes, materialize=materialize)
        else:
            self._pools = PerKindPools(budget_bytes, page_sizes, default_page_bytes,
                                       slab_bytes=slab_bytes, materialize=materialize)
        self._index: dict[RecordKey, _Resident] = {}
        self._staged: dict[int, _Staged] = {}  # id(payload) -> pages its record's put will take
        self._staged_bytes = 0

    @property
    def pools(self) -> PoolSet:
        """The allocator (read-only use: `held_bytes`, `arena_bytes`, `free_page_bytes`)."""
        return self._pools

    async def put(self, record: Record) -> bool:
        """Store the record; False (and the previous copy kept) if the budget cannot fit it.
        A record whose payload was staged (`stage`) takes its pages, already written."""
        staged = self._unstaged(record.payload) if self._staged else None
        if staged is not None and staged.kind != record.header.kind:
            self._pools.release(staged.alloc)
            staged = None
        if staged is not None:
            alloc, checksum = staged.alloc, staged.checksum
        else:
            alloc = self._pools.reserve(record.header.kind, len(record.payload))
            if alloc is None:
                return False
            checksum = self._write_payload(alloc, record)
        header = encode_header(record.header, stored_length=len(record.payload), flags=0, checksum=checksum)
        self._drop(record.key)
        self._index[record.key] = _Resident(header, alloc)
        return True

    def _write_payload(self, alloc: Allocation, record: Record) -> int:
        """Copy the payload into its pages; returns the checksum its header stores."""
        self._pools.write(alloc, record.payload)
        return record.payload_sum()

    def stage(self, record: Record) -> bool:
        """Copy `record`'s payload into pages reserved now, for the `put` of a record with the same
        payload object (a server re-stamps the header) to take without copying. False, holding
        nothing, where the budget has no room now (that put then reserves as usual, once the store
        made room) or the payload is staged already. The pages count as held until a put takes
        them or `unstage` gives them back; `occupancy` leaves them out, as the store counts a
        record's footprint when it puts it."""
        payload = record.payload
        if id(payload) in self._staged:
            return False
        alloc = self._pools.reserve(record.header.kind, len(payload))
        if alloc is None:
            return False
        checksum = self._write_payload(alloc, record)
        footprint = self.footprint(record)
        self._staged[id(payload)] = _Staged(payload, record.header.kind, alloc, footprint, checksum)
        self._staged_bytes += footprint
        return True

    def unstage(self, payload: object) -> None:
        """Give back the pages staged for `payload`, if no put took them."""
        staged = self._unstaged(payload)
        if staged is not None:
            self._pools.release(staged.alloc)

    def _unstaged(self, payload: object) -> _Staged | None:
        staged = self._staged.get(id(payload))
        if staged is None or staged.payload is not payload:
            return None
        del self._staged[id(payload)]
        self._staged_bytes -= staged.footprint
        return staged

    async def get(self, key: RecordKey) -> Record | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        record = read_back(entry.header, self._pools.read(entry.alloc))
        if record is None:
            self._drop(key)  # RAM corruption: never served, reported as a miss
        return record

    def read_slices(self, key: RecordKey, layout: Callable[[bytes, int], Sequence[Slice]]
                    ) -> tuple[RecordHeader, list[bytes], int] | None:
        """The record as the caller lays it out: `layout(encoded header, payload length)` gives
        (prefix, start, stop) slices, and each comes back as one bytes object, the prefix then
        those payload bytes copied once from the pages (a reader that frames records for a wire
        saves the copy of `get` plus its own). Verified as `get` verifies: the slices must cover
        the payload once, in order, and its checksum must match, else a corrupt record is dropped
        and, like a miss, None. Returns (header, slices, payload checksum)."""
        entry = self._index.get(key)
        if entry is None:
            return None
        header, checksum = decode_header(entry.header)
        slices = layout(entry.header, entry.alloc.payload_len)
        covered = 0
        for _, start, stop in slices:
            if start != covered or stop < start:
                raise ValueError(f"slices must cover the payload in order: {start}..{stop} after {covered}")
            covered = stop
        if covered != entry.alloc.payload_len:
            raise ValueError(f"slices cover {covered} of {entry.alloc.payload_len} payload bytes")
        if len(slices) == 1:
            out = self._pools.read_slices(entry.alloc, slices)
            digest = payload_checksum(memoryview(out[0])[len(slices[0][0]):])
        else:  # each piece hashed as soon as it is copied, while it is in cache
            state = xxhash.xxh3_64()
            out = self._pools.read_slices(entry.alloc, slices, state.update)
            digest = state.intdigest()
        if digest != checksum:
            self._drop(key)  # RAM corruption: never served, reported as a miss
            return None
        return header, out, checksum

    async def delete(self, key: RecordKey) -> bool:
        return self._drop(key)

    def _drop(self, key: RecordKey) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._pools.release(entry.alloc)
        return True

    async def contains(self, keys: Sequence[RecordKey]) -> list[bool]:
        return [k in self._index for k in keys]

    def usage(self) -> TierUsage:
        """Footprints of the records held: pages (payload + padding), headers, index entries.

        Free pages cached in partly used slabs are not residency (see `pools.free_page_bytes`);
        `usage().resident_bytes + pools.free_page_bytes == pools.held_bytes` <= budget.
        """
        return TierUsage(self.name, self._pools.budget.capacity_bytes, self._pools.usage_by_kind())

    def occupancy(self) -> tuple[int, int]:
        return self._pools.budget.capacity_bytes, self._pools.resident_bytes - self._staged_bytes

    def footprint(self, record: Record) -> int:
        return self._pools.footprint(record.header.kind, len(record.payload))

    async def scan(self) -> ScanResult:
        """RAM does not survive a restart: the scan reports what this process holds."""
        return ScanResult([decode_header(e.header)[0] for e in self._index.values()], [])
