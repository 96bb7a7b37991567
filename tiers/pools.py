"""Per-kind page pools: the allocator of the host tier (and later of the GPU tier).

Each kind of state gets pages sized for it, so that a record of that kind fills its pages
exactly: one block of B tokens of a per-token kind, or one sequence of a per-sequence kind.
A store with one page size for every kind (`SinglePagePool`, the design vLLM uses for hybrid
models) pads small states up to the largest page and loses the capacity quantization was
meant to win; `bench/capacity.py` measures both.

Memory layout of one `PagePool`::

    slab 0: [page 0][page 1]...[page P-1]     page id = slab index * P + offset
    slab 1: [page P]...                        (P = pages_per_slab; a budget-limited slab may be shorter)
    ...

Slabs are grown lazily, one at a time, while the shared `ByteBudget` allows; a freed page
goes back to its slab's free list and is reused first (lowest slab first, so high slabs
drain); a slab whose pages are all free is returned to the budget at once, so one kind's
churn never strands memory another kind needs for long. Each pool keeps the memory of one
such slab mapped (its spare, outside the budget) for its next grow: a pool whose records churn
across a slab boundary then writes into warm pages instead of faulting in freshly zeroed ones
(a 4 MiB put that crossed one cost twice as much). So the process may hold one slab per page
size beyond the budget; the budget itself, and every residency figure, is unchanged.

Accounting invariants (what the tests check):
- `ByteBudget.held_bytes` = slab bytes + record overheads (headers and index entries) of
  live records = the bytes this allocator holds; it never exceeds the budget.
- A record's footprint = pages x page size (payload + padding) + `HEADER_SIZE` (its
  encoded header is kept) + an index entry (`INDEX_ENTRY_BASE_BYTES` + 4 bytes per page id).
- `resident_bytes` (sum of live footprints) + `free_page_bytes` (free pages inside held
  slabs) = `held_bytes`.

Nothing here knows the model: kinds are opaque integer codes.
"""

from __future__ import annotations

import heapq
import math
import mmap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tiers._iobuffers import advise_huge_pages, private_map
from tiers.base import KindUsage
from tiers.record import HEADER_SIZE, RECORD_KEY_BYTES

DEFAULT_PAGE_BYTES = 64 << 10
DEFAULT_SLAB_BYTES = 64 << 20
HUGE_PAGE_BYTES = 2 << 20  # x86-64 / arm64 PMD size: what MADV_HUGEPAGE asks for
MIN_SLABS_PER_BUDGET = 16  # a slab is at most budget / 16, so every kind can get memory
INDEX_ENTRY_BASE_BYTES = RECORD_KEY_BYTES + 16  # key, payload length, checksum slot
INDEX_BYTES_PER_PAGE = 4  # page ids as u32

Slice = tuple[bytes, int, int]  # (prefix, start, stop): prefix + bytes start..stop of a record's payload


def record_overhead_bytes(num_pages: int) -> int:
    """Bytes a record costs besides its pages: its header and its index entry."""
    return HEADER_SIZE + INDEX_ENTRY_BASE_BYTES + INDEX_BYTES_PER_PAGE * num_pages


def page_bytes_for(*, block_size: int, bytes_per_token: float = 0.0, bytes_per_sequence: int = 0) -> int:
    """The page a kind should get: one block's payload (per-token) or one sequence's (per-sequence)."""
    if (bytes_per_token > 0) == (bytes_per_sequence > 0):
        raise ValueError("give exactly one of bytes_per_token and bytes_per_sequence")
    if bytes_per_sequence:
        return int(bytes_per_sequence)
    exact = bytes_per_token * block_size
    if exact != int(exact):
        raise ValueError(f"{bytes_per_token} B/token x block {block_size} is not whole bytes")
    return int(exact)


def default_slab_bytes(budget_bytes: int) -> int:
    return max(1, min(DEFAULT_SLAB_BYTES, budget_bytes // MIN_SLABS_PER_BUDGET))


class ByteBudget:
    """Bytes held against a capacity, shared by every pool of one tier (check/act pairs)."""

    __slots__ = ("capacity_bytes", "held_bytes")

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"budget must be > 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.held_bytes

    def can_hold(self, nbytes: int) -> bool:
        return nbytes <= self.free_bytes

    def hold(self, nbytes: int) -> None:
        if not self.can_hold(nbytes):
            raise MemoryError(f"holding {nbytes} B would exceed the budget of {self.capacity_bytes} B "
                              f"({self.held_bytes} B held)")
        self.held_bytes += nbytes

    def release(self, nbytes: int) -> None:
        if nbytes > self.held_bytes:
            raise AssertionError(f"releasing {nbytes} B but only {self.held_bytes} B are held")
        self.held_bytes -= nbytes


def map_slab(nbytes: int) -> mmap.mmap:
    """Memory for a slab: a private anonymous map, backed by transparent huge pages where the
    kernel gives them (`madvise` or `always` mode). `mmap.mmap(-1, n)`'s default, a shared
    anonymous map, is shmem, which `MADV_HUGEPAGE` does not turn into huge pages (`shmem_enabled`
    is `never` on most kernels). Copies of large records in and out of 4 KiB pages pay a TLB
    miss every 4 KiB: 1 MiB copied out of cache into rotating slab memory on the development
    VM took 75 us into 4 KiB pages and 53 us into huge pages."""
    buf = private_map(nbytes)
    if nbytes >= HUGE_PAGE_BYTES:
        advise_huge_pages(buf)
    return buf


@dataclass(slots=True)
class _Slab:
    buf: mmap.mmap | None  # None in accounting-only mode
    num_pages: int
    next_fresh: int = 0  # pages [next_fresh, num_pages) were never handed out
    freed: list[int] = field(default_factory=list)  # offsets handed back
    num_used: int = 0

    @property
    def num_free(self) -> int:
        return self.num_pages - self.num_used


class PagePool:
    """Pages of one size in lazily grown slabs, with a free list per slab.

    Args:
        page_bytes: the page size.
        budget: the byte budget shared with the tier's other pools.
        slab_bytes: target slab size; a slab holds max(1, slab_bytes // page_bytes) pages.
        materialize: False = accounting only (capacity planning): no memory is allocated
            and pages cannot be read or written.
    """

    def __init__(self, page_bytes: int, budget: ByteBudget, *, slab_bytes: int = DEFAULT_SLAB_BYTES,
                 materialize: bool = True) -> None:
        if page_bytes <= 0:
            raise ValueError(f"page size must be > 0, got {page_bytes}")
        self.page_bytes = page_bytes
        self.pages_per_slab = max(1, slab_bytes // page_bytes)
        self.materialize = materialize
        self._budget = budget
        self._slabs: list[_Slab | None] = []
        self._open: list[int] = []  # heap of slab ids that may have free pages (lazy)
        self._empty_slots: list[int] = []  # heap of released slab ids, reused first
        self._spare: mmap.mmap | None = None  # a released slab's memory, mapped for the next grow
        self.num_held_pages = 0
        self.num_used_pages = 0

    @property
    def num_free_pages(self) -> int:
        return self.num_held_pages - self.num_used_pages

    @property
    def arena_bytes(self) -> int:
        return self.num_held_pages * self.page_bytes

    @property
    def num_slabs(self) -> int:
        return sum(s is not None for s in self._slabs)

    def num_pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def growth_bytes(self, num_pages: int) -> int:
        """Slab bytes that allocating `num_pages` would have to add (at least)."""
        return max(0, num_pages - self.num_free_pages) * self.page_bytes

    # ----- allocate / free ----------------------------------------------------------------

    def allocate(self, num_pages: int) -> list[int]:
        """Page ids for `num_pages` pages. The caller has checked `growth_bytes` against the budget."""
        ids: list[int] = []
        while len(ids) < num_pages:
            sid = self._first_open_slab()
            if sid is None:
                sid = self._grow(num_pages - len(ids))
            ids.extend(self._take(sid, num_pages - len(ids)))
        self.num_used_pages += num_pages
        return ids

    def free(self, page_ids: Iterable[int]) -> None:
        # Freed in reverse so `_take` (which pops the free list) hands them out ascending again:
        # a reused run of pages stays one run.
        ids = page_ids if isinstance(page_ids, (list, tuple)) else list(page_ids)
        if self._free_run(ids):
            return
        for pid in reversed(ids):
            sid, off = divmod(pid, self.pages_per_slab)
            slab = self._slabs[sid]
            if slab is None or not 0 <= off < slab.next_fresh or not slab.num_used:
                raise AssertionError(f"page {pid} is not allocated")
            slab.freed.append(off)
            slab.num_used -= 1
            self.num_used_pages -= 1
            if slab.num_used == 0:
                self._release(sid, slab)
            elif slab.num_free == 1:
                heapq.heappush(self._open, sid)

    def _free_run(self, ids: Sequence[int]) -> bool:
        """`free` of pages that are one ascending run in one slab (what `allocate` mostly hands
        out) in a few list operations instead of a step per page: a 4 MiB record is 160 pages
        of 26 KiB. False, with nothing freed, for any other shape."""
        n = len(ids)
        if n < 2:
            return False
        first = ids[0]
        sid, off = divmod(first, self.pages_per_slab)
        if off + n > self.pages_per_slab or tuple(ids) != tuple(range(first, first + n)):
            return False
        slab = self._slabs[sid]
        if slab is None or off + n > slab.next_fresh or n > slab.num_used:
            raise AssertionError(f"pages {first}..{first + n - 1} are not allocated")
        was_full = not slab.num_free
        slab.freed.extend(range(off + n - 1, off - 1, -1))
        slab.num_used -= n
        self.num_used_pages -= n
        if slab.num_used == 0:
            self._release(sid, slab)
        elif was_full:
            heapq.heappush(self._open, sid)
        return True

    def _first_open_slab(self) -> int | None:
        while self._open:
            sid = self._open[0]
            slab = self._slabs[sid] if sid < len(self._slabs) else None
            if slab is not None and slab.num_free:
                return sid
            heapq.heappop(self._open)
        return None

    def _take(self, sid: int, want: int) -> list[int]:
        slab = self._slabs[sid]
        assert slab is not None
        base = sid * self.pages_per_slab
        take = min(want, slab.num_free)
        from_freed = min(take, len(slab.freed))
        ids: list[int] = []
        if from_freed:  # the last `from_freed` offsets, last first (as popping them one by one)
            reused = slab.freed[-from_freed:]
            del slab.freed[-from_freed:]
            reused.reverse()
            ids = list(map(base.__add__, reused))
        fresh = take - from_freed
        ids.extend(range(base + slab.next_fresh, base + slab.next_fresh + fresh))
        slab.next_fresh += fresh
        slab.num_used += take
        if not slab.num_free and self._open and self._open[0] == sid:
            heapq.heappop(self._open)
        return ids

    def _grow(self, want_pages: int) -> int:
        affordable = self._budget.free_bytes // self.page_bytes
        num_pages = min(self.pages_per_slab, max(affordable, 0))
        if num_pages < min(want_pages, self.pages_per_slab):
            raise MemoryError(f"pool of {self.page_bytes} B pages cannot grow: budget has "
                              f"{self._budget.free_bytes} B free")
        self._budget.hold(num_pages * self.page_bytes)
        buf = self._map(num_pages * self.page_bytes) if self.materialize else None
        slab = _Slab(buf, num_pages)
        if self._empty_slots:
            sid = heapq.heappop(self._empty_slots)
            self._slabs[sid] = slab
        else:
            sid = len(self._slabs)
            self._slabs.append(slab)
        self.num_held_pages += num_pages
        heapq.heappush(self._open, sid)
        return sid

    def _map(self, nbytes: int) -> mmap.mmap:
        """Memory for a new slab: the spare when it has the size (warm pages), else a fresh mapping."""
        spare, self._spare = self._spare, None
        if spare is not None and len(spare) == nbytes:
            return spare
        if spare is not None:
            spare.close()
        return map_slab(nbytes)

    def _release(self, sid: int, slab: _Slab) -> None:
        """An empty slab goes back to the budget; its memory becomes the spare, or goes to the OS."""
        if slab.buf is not None:
            if self._spare is None:
                self._spare = slab.buf
            else:
                slab.buf.close()
        self._slabs[sid] = None
        heapq.heappush(self._empty_slots, sid)
        self.num_held_pages -= slab.num_pages
        self._budget.release(slab.num_pages * self.page_bytes)

    # ----- bytes ----------------------------------------------------------------------------

    def _locate(self, pid: int) -> tuple[mmap.mmap, int]:
        if not self.materialize:
            raise RuntimeError("accounting-only pool: pages hold no memory")
        sid, off = divmod(pid, self.pages_per_slab)
        slab = self._slabs[sid]
        assert slab is not None and slab.buf is not None
        return slab.buf, off * self.page_bytes

    def _runs(self, page_ids: Iterable[int], length: int) -> list[tuple[mmap.mmap, int, int, int]]:
        """(slab, offset in it, bytes, offset in the record) per run of consecutive pages of one
        slab, so a large record is copied in a few slices instead of one per page."""
        ids = list(page_ids)
        if ids and ids[-1] - ids[0] == len(ids) - 1 and ids == list(range(ids[0], ids[-1] + 1)):
            return self._contiguous_runs(ids[0], len(ids), length)
        runs, i = [], 0
        while i < len(ids):
            j, sid = i, ids[i] // self.pages_per_slab
            while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1 and ids[j + 1] // self.pages_per_slab == sid:
                j += 1
            at_record = i * self.page_bytes
            buf, at = self._locate(ids[i])
            runs.append((buf, at, min((j - i + 1) * self.page_bytes, length - at_record), at_record))
            i = j + 1
        return runs

    def _contiguous_runs(self, first: int, count: int, length: int) -> list[tuple[mmap.mmap, int, int, int]]:
        """`_runs` of pages first .. first + count - 1 (the common case): one run per slab crossed."""
        runs, pid, at_record = [], first, 0
        while pid < first + count:
            in_slab = min(first + count, (pid // self.pages_per_slab + 1) * self.pages_per_slab) - pid
            buf, at = self._locate(pid)
            runs.append((buf, at, min(in_slab * self.page_bytes, length - at_record), at_record))
            pid += in_slab
            at_record += in_slab * self.page_bytes
        return runs

    def write(self, page_ids: Iterable[int], data: bytes | memoryview) -> None:
        src = memoryview(data)
        for buf, at, nbytes, at_record in self._runs(page_ids, len(src)):
            buf[at:at + nbytes] = src[at_record:at_record + nbytes]

    def read(self, page_ids: Iterable[int], length: int) -> bytes:
        """The bytes of a record's pages, copied once (views into the slabs, one join)."""
        parts = [memoryview(buf)[at:at + nbytes] for buf, at, nbytes, _ in self._runs(page_ids, length)]
        try:
            return b"".join(parts)
        finally:
            for view in parts:  # an exported view would keep its slab from closing
                view.release()

    def read_slices(self, page_ids: Iterable[int], length: int, slices: Sequence[Slice],
                    each: Callable[[memoryview], object] | None = None) -> list[bytes]:
        """For each (prefix, start, stop): `prefix` then bytes start..stop of the record, in one
        new bytes object, copied once from the slabs (a reader that frames the bytes its own
        way, e.g. for a wire, saves the copy it would make of a plain `read`). `each` is called
        with each piece's record bytes right after that piece is copied, while they are still in
        the CPU cache (a checksum over a 4 MiB record read this way costs ~half of one over the
        finished pieces)."""
        runs = self._runs(page_ids, length)
        out: list[bytes] = []
        for prefix, start, stop in slices:
            if not 0 <= start <= stop <= length:
                raise ValueError(f"slice {start}..{stop} outside a record of {length} B")
            parts: list[bytes | memoryview] = [prefix]
            for buf, at, nbytes, at_record in runs:
                lo, hi = max(start, at_record), min(stop, at_record + nbytes)
                if lo < hi:
                    parts.append(memoryview(buf)[at + lo - at_record:at + hi - at_record])
            try:
                out.append(b"".join(parts))
            finally:
                for view in parts[1:]:
                    view.release()  # type: ignore[union-attr]
            if each is not None:
                each(memoryview(out[-1])[len(prefix):])
        return out


@dataclass(frozen=True, slots=True)
class Allocation:
    """The pages of `count` records of `payload_len` bytes each (one record, except in bulk
    capacity planning, where a batch of records is reserved and released as one)."""

    kind: int
    page_ids: tuple[int, ...]
    payload_len: int
    page_bytes: int
    count: int = 1

    @property
    def pages_per_record(self) -> int:
        return len(self.page_ids) // self.count

    @property
    def footprint_bytes(self) -> int:
        return len(self.page_ids) * self.page_bytes + self.count * record_overhead_bytes(self.pages_per_record)


@dataclass(slots=True)
class _KindTally:
    num_records: int = 0
    payload_bytes: int = 0
    footprint_bytes: int = 0


class PoolSet:
    """Pools of one tier sharing one byte budget; records are placed by kind.

    Subclasses decide which pool (page size) serves a kind. Check/act pairs:
    `can_reserve`/`reserve` (and `reserve_many` for bulk capacity planning) and `release`.
    """

    def __init__(self, budget_bytes: int, *, slab_bytes: int | None = None, materialize: bool = True) -> None:
        self.budget = ByteBudget(budget_bytes)
        self.slab_bytes = slab_bytes if slab_bytes is not None else default_slab_bytes(budget_bytes)
        self.materialize = materialize
        self._pools: dict[int, PagePool] = {}  # page size -> pool
        self._tally: dict[int, _KindTally] = {}

    def page_bytes(self, kind: int) -> int:
        raise NotImplementedError

    def pool_for(self, kind: int) -> PagePool:
        size = self.page_bytes(kind)
        pool = self._pools.get(size)
        if pool is None:
            pool = self._pools[size] = PagePool(size, self.budget, slab_bytes=max(self.slab_bytes, size),
                                                materialize=self.materialize)
        return pool

    def footprint(self, kind: int, payload_len: int) -> int:
        n = -(-payload_len // self.page_bytes(kind))
        return n * self.page_bytes(kind) + record_overhead_bytes(n)

    def can_reserve(self, kind: int, payload_len: int, count: int = 1) -> bool:
        pool = self.pool_for(kind)
        n = pool.num_pages_for(payload_len)
        return self.budget.can_hold(pool.growth_bytes(n * count) + count * record_overhead_bytes(n))

    def reserve_many(self, kind: int, payload_len: int, count: int) -> Allocation | None:
        """`count` records of `payload_len` bytes as one allocation, all or none (None: the
        budget cannot fit them). For capacity planning; the tier reserves one at a time
        (`reserve`), so each lookup is done once here."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        pool = self.pool_for(kind)
        n = pool.num_pages_for(payload_len)
        overhead = count * record_overhead_bytes(n)
        budget = self.budget
        if not budget.can_hold(pool.growth_bytes(n * count) + overhead):
            return None
        budget.hold(overhead)
        alloc = Allocation(kind, tuple(pool.allocate(n * count)), payload_len, pool.page_bytes, count)
        self._count(alloc, +1)
        return alloc

    def reserve(self, kind: int, payload_len: int) -> Allocation | None:
        """One record's pages (None: the budget cannot fit them)."""
        return self.reserve_many(kind, payload_len, 1)

    def release(self, alloc: Allocation) -> None:
        self.pool_for(alloc.kind).free(alloc.page_ids)
        self.budget.release(alloc.count * record_overhead_bytes(alloc.pages_per_record))
        self._count(alloc, -1)

    def _count(self, alloc: Allocation, sign: int) -> None:
        tally = self._tally.get(alloc.kind)
        if tally is None:  # (not setdefault: that builds a tally on every call)
            tally = self._tally[alloc.kind] = _KindTally()
        tally.num_records += sign * alloc.count
        tally.payload_bytes += sign * alloc.count * alloc.payload_len
        tally.footprint_bytes += sign * alloc.footprint_bytes
        if not tally.num_records:
            del self._tally[alloc.kind]

    def write(self, alloc: Allocation, data: bytes | memoryview) -> None:
        if alloc.count != 1 or len(data) != alloc.payload_len:
            raise ValueError(f"writing {len(data)} B into an allocation of {alloc.payload_len} B")
        self.pool_for(alloc.kind).write(alloc.page_ids, data)

    def read(self, alloc: Allocation) -> bytes:
        return self.pool_for(alloc.kind).read(alloc.page_ids, alloc.payload_len)

    def read_slices(self, alloc: Allocation, slices: Sequence[Slice],
                    each: Callable[[memoryview], object] | None = None) -> list[bytes]:
        """`PagePool.read_slices` of the allocation's record."""
        return self.pool_for(alloc.kind).read_slices(alloc.page_ids, alloc.payload_len, slices, each)

    # ----- accounting -----------------------------------------------------------------------

    def usage_by_kind(self) -> dict[int, KindUsage]:
        return {k: KindUsage(t.num_records, t.payload_bytes, t.footprint_bytes - t.payload_bytes)
                for k, t in self._tally.items()}

    @property
    def resident_bytes(self) -> int:
        return sum(t.footprint_bytes for t in self._tally.values())

    @property
    def arena_bytes(self) -> int:
        return sum(p.arena_bytes for p in self._pools.values())

    @property
    def free_page_bytes(self) -> int:
        return sum(p.num_free_pages * p.page_bytes for p in self._pools.values())

    @property
    def held_bytes(self) -> int:
        return self.budget.held_bytes


class PerKindPools(PoolSet):
    """Each kind gets its own page size (kinds of equal page size share a pool)."""

    def __init__(self, budget_bytes: int, page_sizes: Mapping[int, int] | None = None,
                 default_page_bytes: int = DEFAULT_PAGE_BYTES, **kwargs: object) -> None:
        super().__init__(budget_bytes, **kwargs)  # type: ignore[arg-type]
        self.page_sizes = dict(page_sizes or {})
        for kind, size in self.page_sizes.items():
            if size <= 0:
                raise ValueError(f"page size of kind {kind} must be > 0, got {size}")
        self.default_page_bytes = default_page_bytes

    def page_bytes(self, kind: int) -> int:
        return self.page_sizes.get(kind, self.default_page_bytes)


class SinglePagePool(PoolSet):
    """One page size for every kind (the largest): vLLM's uniform-page hybrid allocator.

    Kept for the capacity comparison: it pads every record up to whole pages of the largest
    size. See `uniform_page_layout` for how vLLM sizes the page and the blocks of per-token
    kinds.
    """

    def __init__(self, budget_bytes: int, page_bytes: int, **kwargs: object) -> None:
        super().__init__(budget_bytes, **kwargs)  # type: ignore[arg-type]
        if page_bytes <= 0:
            raise ValueError(f"page size must be > 0, got {page_bytes}")
        self._page_bytes = page_bytes

    def page_bytes(self, kind: int) -> int:
        return self._page_bytes


@dataclass(frozen=True, slots=True)
class UniformPageLayout:
    """vLLM's hybrid layout: one page size, and how many tokens a per-token kind's page holds."""

    page_bytes: int
    tokens_per_page: dict[int, int]  # per-token kind -> block size inflated to fill a page


def uniform_page_layout(per_token_bytes: Mapping[int, float], per_sequence_bytes: Mapping[int, int],
                        *, align_tokens: int = 16) -> UniformPageLayout:
    """Size one page for every kind the way vLLM's hybrid allocator does.

    The page must hold the largest per-sequence state; each per-token kind's block size is
    raised to the smallest multiple of `align_tokens` whose page is at least that large
    (`unify_kv_cache_spec_page_size`); the page is the largest of those, and every smaller
    state is padded up to it. Without per-sequence kinds, the page is the largest per-token
    kind's page at `align_tokens` tokens.
    """
    floor = max(per_sequence_bytes.values(), default=0)
    if not floor:
        floor = int(math.ceil(max(per_token_bytes.values()) * align_tokens))
    tokens = {k: int(math.ceil(floor / (b * align_tokens))) * align_tokens for k, b in per_token_bytes.items()}
    page = max([floor, *(int(math.ceil(tokens[k] * b)) for k, b in per_token_bytes.items())])
    return UniformPageLayout(page, tokens)
