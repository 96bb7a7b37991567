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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby, repeat
from operator import attrgetter, itemgetter
from typing import NamedTuple

import torch

from tiers.base import KindUsage, ScanResult, Tier, TierUsage
from tiers.host import HostTier
from tiers.pools import record_overhead_bytes
from tiers.record import Record, RecordKey, decode_header, encode_header, payload_checksum, read_back

DEFAULT_STAGING_BYTES = 16 << 20  # per staging buffer (two of them): big copies, short pipeline start
DEFAULT_FILL_THREADS = 8
# load_from's chunks (records): the first copy of a kind starts after FIRST_CHUNK records'
# Python, later chunks double up to MAX_CHUNK. Chosen on the H200 (bench.gpu_probe, 2026-11-30:
# 32..512 gave 0.89 / 0.93 of one plain copy at 256 / 1,024 records, 8..128 0.83 / 0.87, one
# copy per kind 0.84 / 0.91; at 32 records all are within noise of each other, ~0.75).
FIRST_CHUNK = 32
MAX_CHUNK = 512


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
        self.pinned = pin and materialize
        self.address = self.tensor.data_ptr() if self.tensor is not None and self.tensor.numel() else 0  # of slot 0
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
    """An index entry (the pinned host tier's, which `HbmTier.load_from` indexes as they are)."""

    header: bytes  # encoded header with the payload checksum (host memory, counted as overhead)
    kind: int
    slot_ids: tuple[int, ...]
    payload_len: int
    verified: bool  # the header holds the payload's checksum (see `load(checksums=...)`)


class _DriverH2D:
    """Host-to-device copies issued with the driver's `cuMemcpyHtoDAsync` through ctypes.

    Why: on the H200's host a torch `dst[a:b].copy_(src[c:d], non_blocking=True)` costs
    ~15 µs of Python and dispatch (two slices, a dispatcher pass) plus ~9 µs to make the tier's
    stream current, where the driver call through ctypes costs ~3 µs; a 4K-token checkpoint (3.6 MB) is ~80 µs on the link, so those
    microseconds are what separates `load_from` from one plain copy. Only for sources in pinned
    pools (page-locked by torch's pinned allocator); a call the driver refuses (for instance
    from a thread without the device's context current) returns False and the caller copies
    with torch instead.
    """

    def __init__(self) -> None:
        fn = ctypes.CDLL("libcuda.so.1").cuMemcpyHtoDAsync_v2
        fn.argtypes = (ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        fn.restype = ctypes.c_int
        self._fn = fn
        self.refused = 0
        self.last_refusal = 0

    @staticmethod
    def open() -> _DriverH2D | None:
        """The driver's copy, or None where libcuda cannot be loaded (then torch copies)."""
        try:
            return _DriverH2D()
        except (OSError, AttributeError):
            return None

    def __call__(self, dst_address: int, src_address: int, nbytes: int, stream: int) -> bool:
        status = self._fn(dst_address, src_address, nbytes, stream)
        if status:
            self.last_refusal = status  # a CUresult, for diagnostics
            self.refused += 1
        return not status


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
        # key -> its entry (header, kind, length, verified) and, apart, its slots in this tier:
        # `load_from` indexes the host tier's own entries (the same header and length) with one
        # C-level update, so an entry's `slot_ids` are those of the tier that made it, and
        # `_slots` (an int for the usual one-page record) is where it lives here.
        self._index: dict[RecordKey, _Resident] = {}
        self._slots: dict[RecordKey, int | tuple[int, ...]] = {}
        self._tally: dict[int, list[int]] = {}  # kind -> [records, payload bytes, footprint bytes]
        on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if on_cuda and materialize else None
        self._h2d = _DriverH2D.open() if self._stream is not None else None
        self._stream_handle = self._stream.cuda_stream if self._stream is not None else 0  # read once: ~1 µs a call
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
        ids = _as_tuple(self._slots.pop(key))
        pool = self.pools[entry.kind]
        pool.free(ids)
        self._count(entry.kind, entry.payload_len, len(ids) * pool.page_bytes + record_overhead_bytes(len(ids)), -1)
        return True

    # ----- device access -----------------------------------------------------------------------

    def slot_ids(self, key: RecordKey) -> tuple[int, ...] | None:
        slots = self._slots.get(key)
        return None if slots is None else _as_tuple(slots)

    def payload_tensor(self, key: RecordKey) -> torch.Tensor:
        """The record's payload as a uint8 device tensor (a view when it fits one page)."""
        entry = self._index[key]
        pool = self.pools[entry.kind]
        if pool.tensor is None:
            raise RuntimeError("accounting-only hbm tier: pages hold no memory")
        ids = _as_tuple(self._slots[key])
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
            self._slots[record.key] = ids[0] if len(ids) == 1 else ids
            pool = self.pools[record.header.kind]
            self._count(record.header.kind, len(record.payload),
                        len(ids) * pool.page_bytes + record_overhead_bytes(len(ids)), +1)
        return events

    def load_from(self, host: PinnedHostTier, keys: Sequence[RecordKey]) -> list[object | None]:
        """Copy records held in `host`'s pinned pools straight into this tier: no staging copy.

        Each kind's keys are taken in chunks that grow from `FIRST_CHUNK` records to
        `MAX_CHUNK`: a chunk's slots are reserved and one host-to-device copy is issued per run
        of slots contiguous on both sides (`_DriverH2D`) before the chunk's index entries are
        written, so the link starts after one chunk's worth of Python and the Python of chunk
        i+1 runs while chunk i is copied. The payload checksums the host tier computed at put
        are kept, so `get` still verifies. Returns one event per key (None: not in a pinned
        pool of `host`, or no room here; a chunk is loaded whole or not at all).
        """
        found = list(map(host._index.get, keys))
        events: list[object | None] = [None] * len(keys)
        loaded: list[range | list[int]] = []
        for kind, pos in _group_by_kind(found, self.pools):
            src_pool, dst_pool = host.pinned_pools[kind], self.pools[kind]
            if src_pool.page_bytes != dst_pool.page_bytes:
                raise ValueError(f"kind {kind}: host pages of {src_pool.page_bytes} B, "
                                 f"hbm pages of {dst_pool.page_bytes} B")
            for chunk in _pipeline_chunks(pos):
                if self._load_chunk(keys, found, kind, chunk, src_pool, dst_pool):
                    loaded.append(chunk)
        event = self._batch_event() if loaded else None
        for chunk in loaded:
            if isinstance(chunk, range):
                events[chunk.start: chunk.stop] = repeat(event, len(chunk))
            else:
                for i in chunk:
                    events[i] = event
        return events

    def _load_chunk(self, keys: Sequence[RecordKey], found: list[_Resident | None], kind: int,
                    pos: range | list[int], src_pool: SlotPool, dst_pool: SlotPool) -> bool:
        """Reserve, copy and index one chunk of one kind (False: no room for it)."""
        is_range = isinstance(pos, range)
        items = found[pos.start: pos.stop] if is_range else [found[i] for i in pos]
        slot_lists = list(map(_SLOTS, items))
        single = sum(map(len, slot_lists)) == len(items)  # one page per record (the usual case)
        src_ids = list(map(_FIRST, slot_lists)) if single else [sid for t in slot_lists for sid in t]
        ids = dst_pool.allocate(len(src_ids))
        if ids is None:
            return False
        self._issue_copies(src_pool, dst_pool, _slot_runs(src_ids, ids))
        # bookkeeping while the copy flies: C-level updates of the index (the host's entries: same
        # header, kind, length) and of the slot map, one tally update
        index, slots, page = self._index, self._slots, dst_pool.page_bytes
        batch_keys = list(keys[pos.start: pos.stop]) if is_range else [keys[i] for i in pos]
        if not index.keys().isdisjoint(batch_keys):  # replaced records give their pages back first
            for key in batch_keys:
                self._drop(key)
        if single:
            here: list[int] | list[tuple[int, ...]] = ids
            footprint = len(items) * (page + record_overhead_bytes(1))
        else:
            here, at = [], 0
            for t in slot_lists:
                here.append(tuple(ids[at: at + len(t)]))
                at += len(t)
            footprint = sum(len(t) * page + record_overhead_bytes(len(t)) for t in here)
        before = len(index)
        index.update(zip(batch_keys, items))
        slots.update(zip(batch_keys, here))
        if len(index) - before == len(batch_keys):
            t = self._tally.setdefault(kind, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + len(items), t[1] + sum(map(_PAYLOAD_LEN, items)), t[2] + footprint
        else:  # a key twice in this chunk: the later copy is indexed, the earlier ones' pages are freed
            last = {key: j for j, key in enumerate(batch_keys)}
            for j, key in enumerate(batch_keys):
                n = 1 if single else len(here[j])
                if last[key] != j:
                    dst_pool.free(_as_tuple(here[j]))
                else:
                    self._count(kind, items[j].payload_len, n * page + record_overhead_bytes(n), +1)
        return True

    def _copy_stream(self) -> AbstractContextManager[object]:
        """The tier's CUDA stream as the current one (copies are issued onto it); none on CPU."""
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _issue_copies(self, src: SlotPool, dst: SlotPool, runs: list[tuple[int, int, int]]) -> None:
        """One copy per run of slots onto the tier's stream (asynchronous on CUDA): through the
        driver where the source is pinned, else (or if the driver refuses) with torch."""
        if dst.tensor is None or src.tensor is None:
            return
        h2d = self._h2d if src.pinned else None
        page, dst_base, src_base, stream = dst.page_bytes, dst.address, src.address, self._stream_handle
        for s_id, d_id, n in runs:
            if h2d is None or not h2d(dst_base + d_id * page, src_base + s_id * page, n * page, stream):
                with self._copy_stream():
                    dst.tensor[d_id: d_id + n].copy_(src.tensor[s_id: s_id + n], non_blocking=self._stream is not None)

    def _batch_event(self) -> object:
        """An event on the tier's stream after the copies issued so far (on CPU: already done)."""
        if self._stream is None:
            return _Ready()
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
_KIND = attrgetter("kind")
_SLOTS = attrgetter("slot_ids")
_PAYLOAD_LEN = attrgetter("payload_len")


def _group_by_kind(found: list[_Resident | None], pools: Mapping[int, SlotPool]) -> list[tuple[int, range | list[int]]]:
    """(kind, positions in `found`) for each kind this tier pools; None entries are skipped.

    Positions are one `range` per kind when each kind's entries are adjacent (a checkpoint's
    keys, kind by kind), found with one C-level `groupby` pass; otherwise index lists. Few
    operations on purpose: this runs before a load's first copy starts.
    """
    if all(found):  # no None (entries are non-empty tuples): C-level, unlike `None not in found`
        spans = [(kind, len(list(run))) for kind, run in groupby(map(_KIND, found))]
        if len(spans) == len({kind for kind, _ in spans}):  # each kind in one run
            out: list[tuple[int, range | list[int]]] = []
            at = 0
            for kind, n in spans:
                if kind in pools:
                    out.append((kind, range(at, at + n)))
                at += n
            return out
    lists: dict[int, list[int]] = {}
    for i, e in enumerate(found):
        if e is not None and e.kind in pools:
            lists.setdefault(e.kind, []).append(i)
    return list(lists.items())


def _as_tuple(slots: int | tuple[int, ...]) -> tuple[int, ...]:
    return (slots,) if isinstance(slots, int) else slots


def _pipeline_chunks(pos: range | list[int]) -> Iterator[range | list[int]]:
    """Slices of `pos` of FIRST_CHUNK, 2x, 4x ... records, at most MAX_CHUNK each."""
    size, at = FIRST_CHUNK, 0
    while at < len(pos):
        yield pos[at: at + size]
        at += size
        size = min(2 * size, MAX_CHUNK)


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
