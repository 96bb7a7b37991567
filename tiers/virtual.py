"""Accounting-only tiers for the trace simulator (bench/trace.py): sized, never allocated.

The simulator must drive the store's own placement, eviction and accounting over tens of
GiB of modeled state on a laptop-class machine, so these tiers keep headers and sizes only:

- `AccountingHostTier`: `HostTier` with `materialize=False`, so its per-kind page pools do
  the real page/slab/budget arithmetic; `put` reserves pages without writing them and `get`
  returns a zero payload of the recorded length. (`HostTier` itself refuses to put into an
  accounting-only pool, since serving zeros as state would be a bug anywhere but here.)
- `VirtualTier`: a byte-budgeted tier named like the medium it stands in for ("ssd"), whose
  footprint follows the SSD tier's layout (header + payload rounded up to 4 KiB file blocks,
  plus an index entry). `SSDTier` cannot run without files and fsyncs, so the simulator uses
  this instead; it also counts bytes written, the SSD's wear figure.

Used only by the simulator: nothing here is a place to keep state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tiers.base import KindUsage, ScanResult, Tier, TierUsage
from tiers.host import HostTier
from tiers.pools import DEFAULT_PAGE_BYTES, Allocation
from tiers.record import HEADER_SIZE, Record, RecordHeader, RecordKey, decode_header

FILE_BLOCK_BYTES = 4096
INDEX_ENTRY_BYTES = 128  # key, sizes, path slot: the order of the SSD tier's in-memory entry


class _Zeros:
    """One shared zero payload per length: gets of virtual records allocate nothing new."""

    def __init__(self) -> None:
        self._by_len: dict[int, bytes] = {}

    def get(self, n: int) -> bytes:
        z = self._by_len.get(n)
        if z is None:
            z = self._by_len[n] = bytes(n)
        return z


class AccountingHostTier(HostTier):
    """Host RAM as the page pools account it, without the memory (see the module docstring)."""

    def __init__(self, budget_bytes: int, page_sizes: Mapping[int, int] | None = None,
                 default_page_bytes: int = DEFAULT_PAGE_BYTES, *, slab_bytes: int | None = None) -> None:
        super().__init__(budget_bytes, page_sizes, default_page_bytes, slab_bytes=slab_bytes, materialize=False)
        self._zeros = _Zeros()

    def _write_payload(self, alloc: Allocation, record: Record) -> int:
        """Pages reserved, nothing written: no bytes and no checksum to keep."""
        return 0

    async def get(self, key: RecordKey) -> Record | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        header, _ = decode_header(entry.header)
        return Record(header, self._zeros.get(header.raw_length))


class VirtualTier(Tier):
    """A budgeted stand-in for a storage medium that keeps headers and sizes only."""

    def __init__(self, name: str, budget_bytes: int = 0) -> None:
        self.name = name
        self._budget = budget_bytes
        self._index: dict[RecordKey, tuple[RecordHeader, int]] = {}
        self._by_kind: dict[int, list[int]] = {}  # kind -> [records, payload bytes, overhead bytes]
        self._zeros = _Zeros()
        self.bytes_written = 0
        self.num_puts = 0

    def footprint(self, record: Record) -> int:
        file_bytes = HEADER_SIZE + len(record.payload)
        return -(-file_bytes // FILE_BLOCK_BYTES) * FILE_BLOCK_BYTES + INDEX_ENTRY_BYTES

    async def put(self, record: Record) -> bool:
        need = self.footprint(record)
        old = self._index.get(record.key)
        held = self._resident() - (old[1] if old else 0)
        if self._budget and held + need > self._budget:
            return False
        self._drop(record.key)
        self._index[record.key] = (record.header, need)
        tally = self._by_kind.setdefault(record.header.kind, [0, 0, 0])
        tally[0] += 1
        tally[1] += len(record.payload)
        tally[2] += need - len(record.payload)
        self.bytes_written += HEADER_SIZE + len(record.payload)
        self.num_puts += 1
        return True

    async def get(self, key: RecordKey) -> Record | None:
        entry = self._index.get(key)
        return Record(entry[0], self._zeros.get(entry[0].raw_length)) if entry else None

    async def delete(self, key: RecordKey) -> bool:
        return self._drop(key)

    def _drop(self, key: RecordKey) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        header, need = entry
        tally = self._by_kind[header.kind]
        tally[0] -= 1
        tally[1] -= header.raw_length
        tally[2] -= need - header.raw_length
        return True

    def _resident(self) -> int:
        return sum(t[1] + t[2] for t in self._by_kind.values())

    async def contains(self, keys: Sequence[RecordKey]) -> list[bool]:
        return [k in self._index for k in keys]

    def usage(self) -> TierUsage:
        return TierUsage(self.name, self._budget, {k: KindUsage(t[0], t[1], t[2]) for k, t in self._by_kind.items() if t[0]})

    async def scan(self) -> ScanResult:
        return ScanResult([h for h, _ in self._index.values()], [])
