"""The hbm tier: records in CUDA memory, one preallocated slot pool per kind.

Why its own allocator: the engine reads global state straight from HBM, so pages must be
device tensors it can index, and HBM is too dear to pad. Each kind gets one tensor
``[num_slots, page_bytes]`` sized for one record of that kind (a block of B tokens of
GLOBAL_KV is 640 x 288 B = 184,320 B at V4.1 scale, INDEX_K 43,520 B), a free list and
integer slot ids, as vLLM's `BlockPool` over `ModelRunner.allocate_kv_cache`'s tensors::

    pool[GLOBAL_KV]: [slot 0][slot 1] ... [slot S-1]    one uint8 tensor, page_bytes per slot
    pool[INDEX_K]:   [slot 0] ...                        free list: a heap, lowest id first,
    index (host):    key -> (encoded header, kind, slot ids, payload length)

Lowest-id-first reuse keeps a session's slots contiguous in a fresh pool, so a load is one
copy per run of slots rather than one per record.

Loads are asynchronous (`load(records) -> events`): payloads are packed by worker threads
into one of two pinned staging buffers while the other buffer's host-to-device copy runs on
the tier's own CUDA stream, so packing chunk i+1 overlaps copying chunk i, and the caller
overlaps both with compute by waiting on each record's event only where it needs it.

Residency is exact: a record's footprint is its pages (payload + padding) plus its encoded
header and index entry (`tiers.pools.record_overhead_bytes`), which live in host memory but
are counted here, so `usage()` never undercounts what a record costs.

The only module under tiers/ that imports torch. Without CUDA the tier refuses to start
(`HbmUnavailable`), unless `allow_cpu=True`: then the pools are CPU tensors, so the pool logic
and accounting can be tested anywhere.
"""

from __future__ import annotations

import ctypes
import heapq
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import NamedTuple

import torch

from tiers.base import KindUsage, ScanResult, Tier, TierUsage
from tiers.host import HostTier
from tiers.pools import record_overhead_bytes
from tiers.record import Record, RecordKey, decode_header, encode_header, payload_checksum, read_back

DEFAULT_STAGING_BYTES = 16 << 20  # per staging buffer (two of them): big copies, short pipeline start
DEFAULT_FILL_THREADS = 8


class HbmUnavailable(RuntimeError):
    """The hbm tier cannot run here (no CUDA device)."""


class SlotPool:
    """One kind's pages: a preallocated ``[num_slots, page_bytes]`` uint8 tensor and a free list.

    Check/act pair: `num_free_slots` then `allocate` (None when short: running out is a normal
    outcome), and `free`. Freed slots are reused lowest id first; slots never handed out are
    taken in order from a watermark, and a pool whose slots are all free starts over from 0,
    so a batch allocated into an empty pool is one contiguous range (one copy, not one per slot).
    """

    def __init__(self, page_bytes: int, num_slots: int, device: torch.device, *, materialize: bool = True,
                 pin: bool = False) -> None:
        if page_bytes <= 0 or num_slots < 0:
            raise ValueError(f"a slot pool needs page_bytes > 0 and num_slots >= 0, got {page_bytes}, {num_slots}")
        self.page_bytes = page_bytes
        self.num_slots = num_slots
        self.tensor = (torch.empty(num_slots, page_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
                       if materialize else None)
        self._freed: list[int] = []  # heap of freed ids below the watermark
        self._fresh = 0  # ids [fresh, num_slots) were never handed out since the pool was last empty
        self._used = bytearray(num_slots)  # 1 = allocated; catches double frees
        self._num_used = 0

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self._num_used

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.page_bytes

    def allocate(self, num: int) -> list[int] | None:
        """`num` slot ids, lowest first; None (nothing taken) if fewer are free."""
        if num > self.num_slots - self._num_used:
            return None
        if not self._freed:  # bulk path: one range from the watermark, marked with one slice write
            start = self._fresh
            self._fresh = start + num
            self._used[start: start + num] = b"\x01" * num
            self._num_used += num
            return list(range(start, start + num))
        take = min(num, len(self._freed))
        ids = [heapq.heappop(self._freed) for _ in range(take)]
        ids.extend(range(self._fresh, self._fresh + num - take))
        self._fresh += num - take
        for i in ids:
            self._used[i] = 1
        self._num_used += num
        return ids

    def free(self, slot_ids: Sequence[int]) -> None:
        for i in slot_ids:
            if not 0 <= i < self.num_slots or not self._used[i]:
                raise AssertionError(f"slot {i} is not allocated (double free or foreign id)")
            self._used[i] = 0
            heapq.heappush(self._freed, i)
        self._num_used -= len(slot_ids)
        if self._num_used == 0:  # empty: start over from slot 0
            self._freed.clear()
            self._fresh = 0


class _Resident(NamedTuple):
    """An index entry (a tuple: `load_from` builds a batch of them with one C-level map)."""

    header: bytes  # encoded header with the payload checksum (host memory, counted as overhead)
    kind: int
    slot_ids: tuple[int, ...]
    payload_len: int
    verified: bool  # the header holds the payload's checksum (see `load(checksums=...)`)


class _Ready:
    """Stands in for a CUDA event on CPU pools: the copy is already done."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream: object = None) -> None:
        return None


def plan_slots(budget_bytes: int, page_sizes: Mapping[int, int], shares: Mapping[int, float]) -> dict[int, int]:
    """Slots per kind: the budget split by each kind's share of the bytes (e.g. bytes per token).

    For kinds that grow together (GLOBAL_KV and INDEX_K of the same blocks) this gives both
    pools room for the same number of blocks, so neither strands the other's memory.
    """
    total = sum(shares[k] for k in page_sizes)
    if budget_bytes <= 0 or total <= 0:
        raise ValueError(f"plan_slots needs a positive budget and shares, got {budget_bytes}, {dict(shares)}")
    return {k: int(budget_bytes * shares[k] / total) // size for k, size in page_sizes.items()}


class HbmTier(Tier):
    """Records in device memory, in one `SlotPool` per kind.

    Args:
        page_sizes: kind -> page bytes (`statestore.store.make_page_sizes`: one record per page).
        num_slots: kind -> slots to preallocate; kinds not listed cannot be stored.
        device: a CUDA device ("cuda", "cuda:1"); "cpu" only with `allow_cpu`.
        allow_cpu: tests of the pool logic on CPU tensors.
        staging_bytes: size of each of the two pinned staging buffers.
        materialize: False = accounting only (capacity planning: no memory is taken).
    """

    name = "hbm"

    def __init__(self, page_sizes: Mapping[int, int], num_slots: Mapping[int, int], device: str | torch.device = "cuda",
                 *, allow_cpu: bool = False, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 fill_threads: int = DEFAULT_FILL_THREADS, materialize: bool = True) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise HbmUnavailable("the hbm tier needs a CUDA device and torch sees none; use the host tier "
                                 "(or allow_cpu=True with device='cpu' to test the pool logic)")
        if self.device.type != "cuda" and not allow_cpu:
            raise HbmUnavailable(f"the hbm tier keeps records in CUDA memory; got device {self.device} "
                                 f"(pass allow_cpu=True to test the pool logic on CPU tensors)")
        missing = set(num_slots) - set(page_sizes)
        if missing:
            raise ValueError(f"num_slots names kinds without a page size: {sorted(missing)}")
        self.pools = {k: SlotPool(page_sizes[k], n, self.device, materialize=materialize)
                      for k, n in num_slots.items()}
        self.materialize = materialize
        self._index: dict[RecordKey, _Resident] = {}
        self._tally: dict[int, list[int]] = {}  # kind -> [records, payload bytes, footprint bytes]
        on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if on_cuda and materialize else None
        self._staging = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=on_cuda) for _ in range(2)] \
            if materialize else []
        self._staging_free: list[object] = [_Ready(), _Ready()]
        self._fill_threads = fill_threads
        self._fill = ThreadPoolExecutor(max_workers=fill_threads, thread_name_prefix="hbm-fill")

    # ----- accounting ------------------------------------------------------------------------

    @property
    def pool_bytes(self) -> int:
        """Device bytes preallocated for pages (what the tier holds whatever is stored)."""
        return sum(p.pool_bytes for p in self.pools.values())

    def footprint(self, record: Record) -> int:
        pool = self._pool(record.header.kind)
        pages = _pages(len(record.payload), pool.page_bytes)
        return pages * pool.page_bytes + record_overhead_bytes(pages)

    def usage(self) -> TierUsage:
        """Footprints of held records by kind: pages (payload + padding), headers, index entries."""
        by_kind = {k: KindUsage(n, payload, fp - payload) for k, (n, payload, fp) in self._tally.items() if n}
        return TierUsage(self.name, self.pool_bytes, by_kind)

    def _pool(self, kind: int) -> SlotPool:
        pool = self.pools.get(kind)
        if pool is None:
            raise ValueError(f"the hbm tier has no pool for kind {kind} (pools: {sorted(self.pools)})")
        return pool

    def _count(self, kind: int, payload_len: int, footprint: int, sign: int) -> None:
        t = self._tally.setdefault(kind, [0, 0, 0])
        t[0] += sign
        t[1] += sign * payload_len
        t[2] += sign * footprint

    # ----- the Tier protocol -----------------------------------------------------------------

    async def put(self, record: Record) -> bool:
        """Store one record and wait for its copy; False (old copy kept) when its pool is full."""
        event = self.load([record])[0]
        if event is None:
            return False
        event.synchronize()
        return True

    async def get(self, key: RecordKey) -> Record | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        if self._stream is not None:
            self._stream.synchronize()  # its load may still be in flight
        payload = bytes(self.payload_tensor(key).cpu().numpy().tobytes())
        record = read_back(entry.header, payload, verified=entry.verified)
        if record is None:
            self._drop(key)  # device memory corruption: never served
        return record

    async def delete(self, key: RecordKey) -> bool:
        return self._drop(key)

    async def contains(self, keys: Sequence[RecordKey]) -> list[bool]:
        return [k in self._index for k in keys]

    async def scan(self) -> ScanResult:
        """Device memory does not survive a restart: the scan reports what this process holds."""
        return ScanResult([decode_header(e.header)[0] for e in self._index.values()], [])

    async def aclose(self) -> None:
        self._fill.shutdown(wait=True)

    def _drop(self, key: RecordKey) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        pool = self.pools[entry.kind]
        pool.free(entry.slot_ids)
        self._count(entry.kind, entry.payload_len,
                    len(entry.slot_ids) * pool.page_bytes + record_overhead_bytes(len(entry.slot_ids)), -1)
        return True

    # ----- device access -----------------------------------------------------------------------

    def slot_ids(self, key: RecordKey) -> tuple[int, ...] | None:
        entry = self._index.get(key)
        return None if entry is None else entry.slot_ids

    def payload_tensor(self, key: RecordKey) -> torch.Tensor:
        """The record's payload as a uint8 device tensor (a view when it fits one page)."""
        entry = self._index[key]
        pool = self.pools[entry.kind]
        if pool.tensor is None:
            raise RuntimeError("accounting-only hbm tier: pages hold no memory")
        ids = entry.slot_ids
        if len(ids) == 1:
            return pool.tensor[ids[0], : entry.payload_len]
        return pool.tensor[list(ids)].reshape(-1)[: entry.payload_len]

    # ----- asynchronous load -------------------------------------------------------------------

    def reserve(self, records: Sequence[Record]) -> list[tuple[int, ...] | None]:
        """Slots for each record (None where its pool is full); replaces older copies of the same key."""
        out: list[tuple[int, ...] | None] = []
        for record in records:
            pool = self._pool(record.header.kind)
            ids = pool.allocate(_pages(len(record.payload), pool.page_bytes))
            out.append(None if ids is None else tuple(ids))
        return out

    def load(self, records: Sequence[Record], *, checksums: bool = True) -> list[object | None]:
        """Copy records into their pools asynchronously; returns one event per record (None: no room).

        Wait on an event (`torch.cuda.current_stream().wait_event(ev)`, or `ev.synchronize()`)
        before reading that record's pages. Records become visible to `contains`/`get` at once;
        their bytes are valid once their event has completed.

        `checksums=False` is for the resume hot path: the records were verified by the tier
        they were just read from, and hashing them again (xxh3 holds the GIL, ~10 GB/s on one
        core) would be slower than the PCIe copy itself. Such records are served by `get`
        without a check (HBM has ECC); `put` always checksums.
        """
        slots = self.reserve(records)
        runs = self._runs(records, slots)
        events: list[object | None] = [None] * len(records)
        sums = self._copy_runs(records, runs, events, checksums)
        for i, (record, ids) in enumerate(zip(records, slots)):
            if ids is None:
                continue
            self._drop(record.key)
            header = encode_header(record.header, stored_length=len(record.payload), flags=0,
                                   checksum=sums[i] if checksums else 0)
            self._index[record.key] = _Resident(header, record.header.kind, ids, len(record.payload), checksums)
            pool = self.pools[record.header.kind]
            self._count(record.header.kind, len(record.payload),
                        len(ids) * pool.page_bytes + record_overhead_bytes(len(ids)), +1)
        return events

    def load_from(self, host: PinnedHostTier, keys: Sequence[RecordKey]) -> list[object | None]:
        """Copy records held in `host`'s pinned pools straight into this tier: no staging copy.

        Slots are reserved for the whole batch first, then one `cudaMemcpyAsync` is issued per
        run of slots that is contiguous on both sides (a session checkpointed in order is one
        run per kind), and the index is written while those copies fly. The payload checksums
        the host tier computed at put are kept, so `get` still verifies. Returns one event per
        key (None: not in a pinned pool of `host`, or no room here). Per record this is a few
        dict and list operations: at 1,024 records it must stay under the ~2 ms of the copy.
        """
        entries = host._index
        found = list(map(entries.get, keys))
        events: list[object | None] = [None] * len(keys)
        # 1. per kind: its positions in `keys` (a range when the kind's keys are adjacent, as a
        #    checkpoint's are), source pages, one allocation; every copy is issued before any
        #    bookkeeping. C-level maps and slices: on the H200 host the Python before the first
        #    byte moves is what separates this load from a plain copy.
        groups = _group_by_kind(found, self.pools)
        placed: list[tuple[int, range | list[int], list[_Resident], list[int], bool]] = []
        copies: list[tuple[SlotPool, SlotPool, list[int], list[int]]] = []
        for kind, pos in groups:
            src_pool, dst_pool = host.pinned_pools[kind], self.pools[kind]
            if src_pool.page_bytes != dst_pool.page_bytes:
                raise ValueError(f"kind {kind}: host pages of {src_pool.page_bytes} B, hbm pages of {dst_pool.page_bytes} B")
            items = found[pos.start: pos.stop] if isinstance(pos, range) else [found[i] for i in pos]
            slot_lists = list(map(_SLOTS, items))
            single = sum(map(len, slot_lists)) == len(items)  # one page per record (the usual case)
            src_ids = list(map(_FIRST, slot_lists)) if single else [sid for t in slot_lists for sid in t]
            ids = dst_pool.allocate(len(src_ids))
            if ids is None:
                continue
            copies.append((src_pool, dst_pool, src_ids, ids))
            placed.append((kind, pos, items, ids, single))
        event = self._copy_slot_runs_many(copies) if copies else None
        # 2. bookkeeping while the copies fly: one index update and one tally update per kind
        index = self._index
        for kind, pos, items, ids, single in placed:
            page = self.pools[kind].page_bytes
            batch_keys = keys[pos.start: pos.stop] if isinstance(pos, range) else [keys[i] for i in pos]
            if not isinstance(batch_keys, list):
                batch_keys = list(batch_keys)
            unique = set(batch_keys)
            if not index.keys().isdisjoint(unique):  # replaced records give their pages back first
                for key in unique:
                    if key in index:
                        self._drop(key)
            if single:
                slot_tuples = list(zip(ids))
                npages = len(items)
                footprint = npages * page + len(items) * record_overhead_bytes(1)
            else:
                slot_tuples, at = [], 0
                for t in map(_SLOTS, items):
                    slot_tuples.append(tuple(ids[at: at + len(t)]))
                    at += len(t)
                footprint = sum(len(t) * page + record_overhead_bytes(len(t)) for t in slot_tuples)
            payload_lens = list(map(_PAYLOAD_LEN, items))
            residents = map(_new_resident, zip(map(_HEADER, items), repeat(kind), slot_tuples, payload_lens,
                                               map(_VERIFIED, items)))
            if len(unique) == len(batch_keys):
                index.update(zip(batch_keys, residents))
                t = self._tally.setdefault(kind, [0, 0, 0])
                t[0], t[1], t[2] = t[0] + len(items), t[1] + sum(payload_lens), t[2] + footprint
            else:  # a key twice in one batch: the later copy wins and the earlier one's pages are freed
                for key, resident in zip(batch_keys, residents):
                    self._drop(key)
                    index[key] = resident
                    n = len(resident.slot_ids)
                    self._count(kind, resident.payload_len, n * page + record_overhead_bytes(n), +1)
            if isinstance(pos, range):
                events[pos.start: pos.stop] = repeat(event, len(pos))
            else:
                for i in pos:
                    events[i] = event
        return events

    def _copy_slot_runs_many(self, copies: list[tuple[SlotPool, SlotPool, list[int], list[int]]]) -> object:
        """All kinds' copies on the tier's stream, one event for the batch."""
        runs = [(src, dst, _slot_runs(src_ids, dst_ids)) for src, dst, src_ids, dst_ids in copies]
        if any(dst.tensor is None or src.tensor is None for src, dst, _ in runs):
            return _Ready()
        if self._stream is None:
            for src, dst, rs in runs:
                for s_id, d_id, n in rs:
                    dst.tensor[d_id: d_id + n].copy_(src.tensor[s_id: s_id + n])
            return _Ready()
        with torch.cuda.stream(self._stream):
            for src, dst, rs in runs:
                for s_id, d_id, n in rs:
                    dst.tensor[d_id: d_id + n].copy_(src.tensor[s_id: s_id + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    @staticmethod
    def _runs(records: Sequence[Record], slots: Sequence[tuple[int, ...] | None]) -> list[tuple[int, int, list[int]]]:
        """(kind, first slot, record indices) for each run of consecutive slots of one kind."""
        order = sorted((records[i].header.kind, ids[0], i) for i, ids in enumerate(slots) if ids is not None)
        runs: list[tuple[int, int, list[int]]] = []
        next_slot: tuple[int, int] | None = None
        for kind, first, i in order:
            if next_slot != (kind, first):
                runs.append((kind, first, []))
            runs[-1][2].append(i)
            next_slot = (kind, first + len(slots[i]))
        return runs

    def _copy_runs(self, records: Sequence[Record], runs: list[tuple[int, int, list[int]]],
                   events: list[object | None], checksums: bool) -> dict[int, int]:
        """Pack runs into the staging buffers (threads) and copy them on the tier's stream.

        A run is cut into chunks of at most one staging buffer; a record larger than a
        staging buffer is copied on its own, straight from its bytes.
        """
        sums: dict[int, int] = {}
        buf_id = 0
        limit = len(self._staging[0]) if self._staging else 0
        for kind, first, members in runs:
            pool = self.pools[kind]
            slot, chunk, chunk_bytes = first, [], 0
            for i in members + [-1]:
                span = _pages(len(records[i].payload), pool.page_bytes) * pool.page_bytes if i >= 0 else 0
                if chunk and (i < 0 or chunk_bytes + span > limit):
                    event = self._copy_chunk(records, chunk, pool, slot, buf_id, checksums, sums)
                    for j in chunk:
                        events[j] = event
                    slot += chunk_bytes // pool.page_bytes
                    buf_id ^= 1
                    chunk, chunk_bytes = [], 0
                if i < 0:
                    break
                if span > limit:
                    events[i] = self._copy_direct(records[i], pool, slot, checksums, sums, i)
                    slot += span // pool.page_bytes
                    continue
                chunk.append(i)
                chunk_bytes += span
        return sums

    def _copy_direct(self, record: Record, pool: SlotPool, slot: int, checksums: bool, sums: dict[int, int],
                     i: int) -> object:
        """An oversized record: one synchronous copy from its (pageable) bytes."""
        sums[i] = payload_checksum(record.payload) if checksums else 0
        if pool.tensor is None:
            return _Ready()
        src = torch.frombuffer(bytearray(record.payload), dtype=torch.uint8)
        pool.tensor[slot: slot + _pages(len(record.payload), pool.page_bytes)].view(-1)[: src.numel()].copy_(src)
        return _Ready()

    def _copy_chunk(self, records: Sequence[Record], chunk: list[int], pool: SlotPool, start_slot: int,
                    buf_id: int, checksums: bool, sums: dict[int, int]) -> object:
        if pool.tensor is None:
            for i in chunk:
                sums[i] = payload_checksum(records[i].payload) if checksums else 0
            return _Ready()
        staging = self._staging[buf_id]
        self._staging_free[buf_id].synchronize()  # its previous copy has left the buffer
        base = staging.data_ptr()
        tasks, offset = [], 0
        for i in chunk:
            payload = records[i].payload
            tasks.append((i, base + offset, payload))
            offset += _pages(len(payload), pool.page_bytes) * pool.page_bytes
        share = -(-len(tasks) // self._fill_threads)  # one future per thread, not per record
        groups = [tasks[k: k + share] for k in range(0, len(tasks), share)]
        for done in self._fill.map(lambda g: _pack(g, checksums), groups):
            sums.update(done)
        dst = pool.tensor[start_slot: start_slot + offset // pool.page_bytes].view(-1)
        if self._stream is None:
            dst.copy_(staging[:offset])
            event: object = _Ready()
        else:
            with torch.cuda.stream(self._stream):
                dst.copy_(staging[:offset], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        self._staging_free[buf_id] = event
        return event


_FIRST = itemgetter(0)
_new_resident = partial(tuple.__new__, _Resident)  # C-level construction (NamedTuple.__new__ is a Python frame)
_KIND = attrgetter("kind")
_SLOTS = attrgetter("slot_ids")
_HEADER = attrgetter("header")
_PAYLOAD_LEN = attrgetter("payload_len")
_VERIFIED = attrgetter("verified")


def _group_by_kind(found: list[_Resident | None], pools: Mapping[int, SlotPool]) -> list[tuple[int, range | list[int]]]:
    """(kind, positions in `found`) for each kind this tier pools; None entries are skipped.

    Positions are one `range` per kind when each kind's entries are adjacent (a checkpoint's
    keys, kind by kind), found with C-level list methods; otherwise index lists.
    """
    if all(found):  # no None (entries are non-empty tuples): C-level, unlike `None not in found`
        kinds = list(map(_KIND, found))
        out: list[tuple[int, range | list[int]]] = []
        for kind in set(kinds):
            start, n = kinds.index(kind), kinds.count(kind)
            if kinds[start: start + n] != [kind] * n:
                break  # a kind's keys are interleaved with another's: index lists below
            if kind in pools:
                out.append((kind, range(start, start + n)))
        else:
            return sorted(out, key=lambda kr: kr[1].start)
    lists: dict[int, list[int]] = {}
    for i, e in enumerate(found):
        if e is not None and e.kind in pools:
            lists.setdefault(e.kind, []).append(i)
    return list(lists.items())


def _slot_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first source slot, first destination slot, length) per run consecutive on both sides."""
    n = len(src_ids)
    if n and src_ids[-1] - src_ids[0] == n - 1 and dst_ids[-1] - dst_ids[0] == n - 1 \
            and src_ids == list(range(src_ids[0], src_ids[0] + n)) and dst_ids == list(range(dst_ids[0], dst_ids[0] + n)):
        return [(src_ids[0], dst_ids[0], n)]  # a session checkpointed in order: one copy
    runs: list[list[int]] = []
    last_s = last_d = -2
    for s_id, d_id in zip(src_ids, dst_ids):
        if s_id == last_s + 1 and d_id == last_d + 1:
            runs[-1][2] += 1
        else:
            runs.append([s_id, d_id, 1])
        last_s, last_d = s_id, d_id
    return [tuple(r) for r in runs]


def _pages(payload_len: int, page_bytes: int) -> int:
    """Pages a payload takes (an empty payload still takes one: it needs a slot id)."""
    return max(1, -(-payload_len // page_bytes))


def _pack(tasks: list[tuple[int, int, bytes]], checksums: bool) -> list[tuple[int, int]]:
    """Worker thread: copy payloads into the staging buffer (ctypes releases the GIL)."""
    out = []
    for i, address, payload in tasks:
        ctypes.memmove(address, payload, len(payload))
        out.append((i, payload_checksum(payload) if checksums else 0))
    return out


class PinnedHostTier(Tier):
    """The host tier of a CUDA machine: the kinds the GPU reads in pinned slot pools, the rest in a HostTier.

    Why: a load from pageable RAM needs a CPU copy into pinned staging first, which runs at
    memcpy speed (a few GB/s a core) instead of PCIe speed. Records of the pinned kinds
    (GLOBAL_KV, INDEX_K) live in pinned pages, so `HbmTier.load_from` moves them with
    `cudaMemcpyAsync` alone. Other kinds (tokens, manifests, rings) go to `inner`. Named
    "host": the store uses it as its host tier.

    Args:
        inner: the HostTier for every other kind (its budget is separate).
        page_sizes / num_slots: the pinned kinds, as for `HbmTier`.
        pin: False on machines without CUDA (tests).
    """

    name = "host"

    def __init__(self, inner: HostTier, page_sizes: Mapping[int, int], num_slots: Mapping[int, int], *,
                 pin: bool | None = None, materialize: bool = True) -> None:
        pin = torch.cuda.is_available() if pin is None else pin
        self.inner = inner
        self.pinned_pools = {k: SlotPool(page_sizes[k], n, torch.device("cpu"), materialize=materialize, pin=pin)
                             for k, n in num_slots.items()}
        self._index: dict[RecordKey, _Resident] = {}
        self._tally: dict[int, list[int]] = {}

    def pinned_entry(self, key: RecordKey) -> _Resident | None:
        return self._index.get(key)

    def _pool_of(self, kind: int) -> SlotPool | None:
        return self.pinned_pools.get(kind)

    async def put(self, record: Record) -> bool:
        pool = self._pool_of(record.header.kind)
        if pool is None:
            return await self.inner.put(record)
        ids = pool.allocate(_pages(len(record.payload), pool.page_bytes))
        if ids is None:
            return False
        if pool.tensor is not None and record.payload:
            for j, sid in enumerate(ids):  # one page per record in the usual case
                chunk = record.payload[j * pool.page_bytes: (j + 1) * pool.page_bytes] if len(ids) > 1 \
                    else record.payload
                ctypes.memmove(pool.tensor[sid].data_ptr(), chunk, len(chunk))
        header = encode_header(record.header, stored_length=len(record.payload), flags=0,
                               checksum=record.payload_sum())
        await self.delete(record.key)
        self._index[record.key] = _Resident(header, record.header.kind, tuple(ids), len(record.payload), True)
        t = self._tally.setdefault(record.header.kind, [0, 0, 0])
        fp = len(ids) * pool.page_bytes + record_overhead_bytes(len(ids))
        t[0], t[1], t[2] = t[0] + 1, t[1] + len(record.payload), t[2] + fp
        return True

    async def get(self, key: RecordKey) -> Record | None:
        entry = self._index.get(key)
        if entry is None:
            return await self.inner.get(key)
        pool = self.pinned_pools[entry.kind]
        payload = b"" if pool.tensor is None else \
            pool.tensor[list(entry.slot_ids)].reshape(-1)[: entry.payload_len].numpy().tobytes()
        record = read_back(entry.header, payload)
        if record is None:
            await self.delete(key)
        return record

    async def delete(self, key: RecordKey) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return await self.inner.delete(key)
        pool = self.pinned_pools[entry.kind]
        pool.free(entry.slot_ids)
        t = self._tally[entry.kind]
        fp = len(entry.slot_ids) * pool.page_bytes + record_overhead_bytes(len(entry.slot_ids))
        t[0], t[1], t[2] = t[0] - 1, t[1] - entry.payload_len, t[2] - fp
        return True

    async def contains(self, keys: Sequence[RecordKey]) -> list[bool]:
        inner = await self.inner.contains(keys)
        return [k in self._index or hit for k, hit in zip(keys, inner)]

    def usage(self) -> TierUsage:
        base = self.inner.usage()
        by_kind = dict(base.by_kind)
        for k, (n, payload, fp) in self._tally.items():
            if n:
                by_kind[k] = KindUsage(n, payload, fp - payload)
        pinned = sum(p.pool_bytes for p in self.pinned_pools.values())
        return TierUsage(self.name, base.budget_bytes + pinned, by_kind)

    def footprint(self, record: Record) -> int:
        pool = self._pool_of(record.header.kind)
        if pool is None:
            return self.inner.footprint(record)
        pages = _pages(len(record.payload), pool.page_bytes)
        return pages * pool.page_bytes + record_overhead_bytes(pages)

    async def scan(self) -> ScanResult:
        inner = await self.inner.scan()
        return ScanResult(inner.headers + [decode_header(e.header)[0] for e in self._index.values()], inner.discarded)

    async def aclose(self) -> None:
        await self.inner.aclose()
