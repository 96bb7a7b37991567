"""The tiered store: the mechanism that places records across tiers, as the policy decides.

`TieredStore` owns the tier instances (host, ssd, redis; any may be absent), the key ->
residency index (`StateMeta`) and one eviction queue per tier, and calls the policy only
through `_PolicyInvoker`. A miss is a result (`None`); a put that cannot be acknowledged
raises, because the caller must learn that its state is not safe:

- `BudgetExceeded`: the tier the put needs cannot fit the record without evicting pinned,
  unacknowledged or only-durable-copy data (the message names the budget);
- `DurabilityUnavailable`: the tier a LOCAL/SHARED put needs is absent or down.

Put, step by step::

    1. index the key as in flight (acked=False: nothing evicts it)
    2. the policy picks tiers; the durability tier is always among them
    3. make room in the durability tier (evicting by policy) and write it   -> or raise
    4. cache copies in the other chosen tiers, best effort
    5. acked=True, pins applied, eviction queues updated

Invariants:
- the index of a local tier (host, ssd) is authoritative: a key is resident there iff the
  index says so (a copy found missing is dropped from the index); the index of a shared
  tier (redis) is a hint, since other nodes write and expire it, so `get` and `lookup`
  always ask it;
- an eviction never removes a copy that `policy.eviction_block_reason` protects, and a
  put never evicts anything unless the planned victims free enough room;
- one put, promotion or explicit eviction at a time per key (`tiers.locks.KeyLocks`).

Nothing here blocks the event loop: the tiers do their I/O off it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from engine_adapter.base import Retention, StateSpec
from statestore.collector import collector_paused
from statestore.policy import (LRUPolicy, PlacementPolicy, _PolicyInvoker, eviction_block_reason, may_evict,
                               required_tier)
from statestore.types import (
    DEFAULT_TIER_PROFILES,
    SHARED_TIERS,
    TIER_DURABILITY,
    TIER_ORDER,
    Durability,
    EventKind,
    KindStats,
    LookupResult,
    OpenReport,
    PutHints,
    PutResult,
    StateMeta,
    StoreEvent,
    TierCost,
    TierName,
    TierProfile,
    TierStats,
)
from tiers.base import Tier
from tiers.locks import KeyLocks
from tiers.pools import Slice, page_bytes_for
from tiers.record import HEADER_SIZE, Record, RecordHeader, RecordKey

logger = logging.getLogger(__name__)


class StoreError(Exception):
    """A put the store could not acknowledge."""


class BudgetExceeded(StoreError):
    """The tier cannot fit the record without dropping protected data."""

    def __init__(self, message: str, *, tier: TierName, budget_bytes: int, need_bytes: int) -> None:
        super().__init__(message)
        self.tier, self.budget_bytes, self.need_bytes = tier, budget_bytes, need_bytes


class DurabilityUnavailable(StoreError):
    """The tier the requested durability needs is absent or down: the put is not acknowledged."""

    def __init__(self, message: str, *, durability: Durability, tier: TierName | None) -> None:
        super().__init__(message)
        self.durability, self.tier = durability, tier


def make_page_sizes(specs: Iterable[StateSpec], block_size: int) -> dict[int, int]:
    """Host/GPU pool page size per kind code: given, one block's payload, or one sequence's."""
    return {int(s.kind): s.page_size_bytes or page_bytes_for(block_size=block_size, bytes_per_token=s.bytes_per_token,
                                                              bytes_per_sequence=s.bytes_per_sequence)
            for s in specs}


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Knobs of the mechanism (the policy has its own)."""

    retention_by_kind: Mapping[int, Retention] = field(default_factory=dict)  # default MUST_KEEP
    tier_profiles: Mapping[TierName, TierProfile] = field(default_factory=lambda: dict(DEFAULT_TIER_PROFILES))
    eviction_window: int = 32  # candidates shown to the policy per eviction (at least enough bytes),
    # for a policy that names no window of its own (`PlacementPolicy.eviction_window`)
    enable_events: bool = False  # record StoreEvents for take_events()
    # Kinds whose records are a cache (LMCache chunks, OPAQUE): evictable for room even as the
    # only copy at their durability level. Pins and unacknowledged puts stay protected. The kind
    # is in every record's header, so the rule holds for records indexed by a scan after a restart.
    cache_kinds: frozenset[int] = frozenset()


class _Placed(enum.Enum):
    STORED = "stored"
    NO_ROOM = "no room"  # the budget arithmetic: protected data fills it
    REFUSED = "refused"  # a tier without a byte budget refused the write: its medium is full or failing
    UNAVAILABLE = "unavailable"


# Why a tier with no byte budget refuses a write while healthy (the tier logs the exact error).
_REFUSAL = {
    TierName.SSD: "the file system under the ssd tier refused the write (no space left on device, or an I/O "
                  "error: see the server log)",
    TierName.REDIS: "Redis refused the write (out of memory? see the server log)",
    TierName.HOST: "the host tier refused the write",
}


class _EvictionQueue:
    """A heap of (score, sequence, key) with lazy invalidation (kvcr's `_EvictionQueue`).

    A key's live entry is the last one inserted; equal scores leave in insertion order. The
    queue of a tier holds exactly its evictable copies, so it also sums their bytes
    (`evictable_bytes`): what a refused put's message reports without a pass over the index.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, RecordKey]] = []
        self._live: dict[RecordKey, tuple[float, int, int]] = {}  # key -> (score, sequence, bytes)
        self._seq = 0
        self.evictable_bytes = 0

    def __len__(self) -> int:
        return len(self._live)

    def insert(self, key: RecordKey, score: float, nbytes: int) -> None:
        self._seq += 1
        old = self._live.get(key)
        self._live[key] = (score, self._seq, nbytes)
        self.evictable_bytes += nbytes - (old[2] if old is not None else 0)
        heapq.heappush(self._heap, (score, self._seq, key))
        if len(self._heap) > 4 * len(self._live) + 64:  # bound the stale entries
            self._heap = [(s, q, k) for k, (s, q, _) in self._live.items()]
            heapq.heapify(self._heap)

    def remove(self, key: RecordKey) -> None:
        live = self._live.pop(key, None)
        if live is not None:
            self.evictable_bytes -= live[2]

    def ordered(self) -> Iterator[RecordKey]:
        """Live keys in score order; close the generator to put the visited ones back."""
        visited: list[tuple[float, int, RecordKey]] = []
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                live = self._live.get(item[2])
                if live is None or live[1] != item[1]:  # stale: the key was removed or inserted since
                    continue
                visited.append(item)
                yield item[2]
        finally:
            for item in visited:
                heapq.heappush(self._heap, item)


class _TierCosts(Mapping[TierName, TierCost]):
    """The present tiers' costs, each built when first read: a policy that never reads them
    (LRU decides by recency and membership) costs no usage snapshot per put or hit."""

    __slots__ = ("_tiers", "_make", "_built")

    def __init__(self, tiers: Mapping[TierName, Tier], make: Callable[[TierName], TierCost]) -> None:
        self._tiers, self._make = tiers, make
        self._built: dict[TierName, TierCost] = {}

    def __getitem__(self, name: TierName) -> TierCost:
        cost = self._built.get(name)
        if cost is None:
            if name not in self._tiers:
                raise KeyError(name)
            cost = self._built[name] = self._make(name)
        return cost

    def __contains__(self, name: object) -> bool:
        return name in self._tiers

    def __iter__(self) -> Iterator[TierName]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0


@dataclass(slots=True)
class _Op:
    """One put or promotion: the copies it evicted and the tiers it is writing or has written."""

    evicted: list[tuple[RecordKey, TierName]] = field(default_factory=list)
    writing: set[TierName] = field(default_factory=set)


def _kind_of(key: RecordKey) -> int:
    return int.from_bytes(key[:2], "big")


def _prefix_len(flags: Sequence[bool]) -> int:
    n = 0
    for present in flags:
        if not present:
            break
        n += 1
    return n


class TieredStore:
    """Records across host RAM, local SSD and Redis, placed and evicted by a policy.

    Args:
        host, ssd, redis: the tiers (any may be None); their `name` must match the slot.
        policy: a `PlacementPolicy` (default `LRUPolicy`).
        config: `StoreConfig`.
        clock: wall-clock seconds for `created`/`last_access` (injectable for tests).

    Tiers are opened by their owner (`tiers.registry.open_tier`); `await open()` then
    re-indexes the local tiers from their scans, and `await aclose()` closes all tiers.
    """

    def __init__(self, *, host: Tier | None = None, ssd: Tier | None = None, redis: Tier | None = None,
                 policy: PlacementPolicy | None = None, config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        slots = {TierName.HOST: host, TierName.SSD: ssd, TierName.REDIS: redis}
        self._tiers: dict[TierName, Tier] = {n: t for n, t in slots.items() if t is not None}
        if not self._tiers:
            raise ValueError("a TieredStore needs at least one tier")
        for name, tier in self._tiers.items():
            if tier.name != name.value:
                raise ValueError(f"tier {tier.name!r} given as the {name.value} tier")
        self._invoker = _PolicyInvoker(policy or LRUPolicy())
        self._config = config or StoreConfig()
        self._eviction_window = self._invoker.eviction_window(self._config.eviction_window)
        self._clock = clock
        self._index: dict[RecordKey, StateMeta] = {}
        # Bytes of each tenant's acknowledged records in the index, kept by `_set_meta` and
        # `_forget`, the only two places the index changes (`acked_bytes`, `_count_entry`).
        self._acked_bytes: dict[bytes, int] = {}
        # Keys per (tenant id, kind) of the kinds a caller asked to list (`track_kind`), kept
        # the same way (dicts as ordered sets): a session layer finds its manifests without a pass.
        self._listed: dict[tuple[bytes, int], dict[RecordKey, None]] = {}
        self._listed_kinds: set[int] = set()
        self._queues = {n: _EvictionQueue() for n in self._tiers}
        self._gate = KeyLocks()
        self._counters: dict[tuple[TierName, int], _Counters] = {}
        self._events: list[StoreEvent] = []
        # In-flight writes: bytes being written per tier (tiers do not count them in usage()),
        # and operations that wrote to a tier and have not finished. Such an operation never
        # waits again, so waiting for it to settle cannot deadlock.
        self._writing_bytes: dict[TierName, int] = {n: 0 for n in self._tiers}
        self._settling: dict[TierName, int] = {n: 0 for n in self._tiers}
        self._settled = asyncio.Event()  # replaced on every settle that has waiters: no lost wake-ups
        self._settle_waiters = 0

    # ----- life cycle -------------------------------------------------------------------

    async def open(self) -> OpenReport:
        """Re-index from each local tier's scan (oldest first, so LRU order follows age).

        Durability is not recorded in records: a record found on SSD is indexed as LOCAL
        (never evicted as a cache copy would be), one in RAM as MEMORY. Shared tiers are not
        scanned: their index is a hint and `get`/`lookup` ask them anyway.
        """
        indexed: dict[TierName, int] = {}
        discarded: dict[TierName, list[str]] = {}
        for name in self._local_tiers():
            result = await self._tiers[name].reindex()
            costs = self._costs()  # the tier holds all it scanned: its costs stay as they are while indexing
            with collector_paused():  # (statestore/collector.py)
                for header in sorted(result.headers, key=lambda h: h.created_at_ns):
                    self._index_scanned(header, name, costs)
            indexed[name], discarded[name] = len(result.headers), list(result.discarded)
        return OpenReport(indexed, discarded)

    def _index_scanned(self, header: RecordHeader, name: TierName,
                       costs: Mapping[TierName, TierCost] | None = None) -> None:
        # Scans give headers, not payloads: the tier prices the copy from its header (an estimate
        # below the tier's real footprint made evicting one record too little for a record of
        # the same size after a restart: a full SSD then refused every put).
        footprint = self._tiers[name].scanned_footprint(header)
        meta = self._index.get(header.key)
        if meta is None:  # the common case, built whole (start-up indexes every record this way)
            created = header.created_at_ns / 1e9
            meta = StateMeta(
                header.key, header.kind, HEADER_SIZE + header.raw_length, self._retention(header.kind),
                durability=TIER_DURABILITY[name], acked=True, cache=self._is_cache(header.kind),
                resident=((name, footprint),), created=created, last_access=created,
                model_fingerprint=header.model_fingerprint, tenant_id=header.tenant_id,
                token_start=header.token_start, token_end=header.token_end)
        else:
            meta = meta.evolve(durability=max(meta.durability, TIER_DURABILITY[name])).with_copy(name, footprint)
        self._set_meta(meta, costs)
        self._event(EventKind.STORED, header.key, name, "scan")

    async def aclose(self) -> None:
        for tier in self._tiers.values():
            await tier.aclose()

    async def probe_unhealthy(self) -> dict[TierName, bool]:
        """Probe every tier that is down (`Tier.probe`, paced by the tier): a shared tier that
        came back is marked healthy even when no get, put or lookup has reached for it, so its
        health in `stats()` tells the truth. Returns the probed tiers' health."""
        return {name: await tier.probe() for name, tier in self._tiers.items() if not tier.healthy}

    async def __aenter__(self) -> TieredStore:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ----- put ---------------------------------------------------------------------------

    async def put(self, record: Record, durability: Durability = Durability.MEMORY, *, pin: bool = False,
                  hints: PutHints | None = None) -> PutResult:
        """Store `record`; returns once it is as safe as `durability` asks.

        Raises:
            BudgetExceeded: the durability tier cannot fit it without dropping protected data.
            DurabilityUnavailable: the durability tier is absent or down (nothing acknowledged).
            ValueError: the record's kind is EPHEMERAL (never stored).
        """
        durability = Durability(durability)
        if self._retention(record.header.kind) is Retention.EPHEMERAL:
            raise ValueError(f"kind {record.header.kind} is EPHEMERAL: it is never stored")
        required = required_tier(durability, self._tiers)
        if required is None:
            raise DurabilityUnavailable(
                f"{durability.name} put of {record.key.hex()} not acknowledged: no "
                f"{'ssd' if durability is Durability.LOCAL else 'redis'} tier is configured",
                durability=durability, tier=None)
        key = record.key
        await self._gate.acquire(key)  # the hot path: `hold` without its context manager
        try:
            prev = self._index.get(key)
            self._set_meta(self._in_flight_meta(record, durability, hints, prev))
            op = _Op()
            done = False
            try:
                result = await self._put_claimed(record, durability, required, pin, op)
                done = True
                return result
            finally:
                if not done:
                    self._abort_put(key, prev)
                self._settle(op)
        finally:
            self._gate.release(key)

    def _in_flight_meta(self, record: Record, durability: Durability, hints: PutHints | None,
                        prev: StateMeta | None) -> StateMeta:
        now = self._clock()
        h = record.header
        if prev is None:
            return StateMeta(record.key, h.kind, record.nbytes, self._retention(h.kind), durability=durability,
                             cache=self._is_cache(h.kind),
                             created=now, last_access=now, hints=hints, model_fingerprint=h.model_fingerprint,
                             tenant_id=h.tenant_id, token_start=h.token_start, token_end=h.token_end)
        return prev.evolve(acked=False, durability=max(durability, prev.durability), last_access=now,
                           size_bytes=record.nbytes, hints=hints or prev.hints,
                           token_start=h.token_start, token_end=h.token_end)

    async def _put_claimed(self, record: Record, durability: Durability, required: TierName,
                           pin: bool, op: _Op) -> PutResult:
        targets = self._invoker.decide_put(self._index[record.key], self._costs())
        outcome = await self._place(required, record, op, "put", may_wait=True)
        if outcome is not _Placed.STORED:
            raise self._put_failure(required, record, durability, outcome)
        for name in TIER_ORDER:
            if name in targets and name is not required:
                await self._place(name, record, op, "put")  # a cache copy: best effort, never waits
        meta = self._index[record.key]
        meta = meta.evolve(acked=True, pinned=meta.pinned or pin)
        self._set_meta(meta)
        self._invoker.on_put(meta, meta.tiers)
        return PutResult(record.key, durability, meta.tiers, tuple(op.evicted))

    def _abort_put(self, key: RecordKey, prev: StateMeta | None) -> None:
        """Undo the in-flight mark: the copies written stay, at the level acknowledged before."""
        meta = self._index.get(key)
        if meta is None:
            return
        meta = meta.evolve(acked=True, durability=prev.durability if prev else Durability.MEMORY)
        if meta.resident:
            self._set_meta(meta)
        else:
            self._forget(key)

    def _put_failure(self, name: TierName, record: Record, durability: Durability, outcome: _Placed) -> StoreError:
        key = record.key.hex()
        if outcome is _Placed.UNAVAILABLE:
            return DurabilityUnavailable(
                f"{durability.name} put of {key} not acknowledged: the {name.value} tier is unavailable "
                f"(healthy={self._tiers[name].healthy}); retry later or ask for a lower durability",
                durability=durability, tier=name)
        usage = self._tiers[name].usage()
        need = self._tiers[name].footprint(record)
        if outcome is _Placed.REFUSED:
            return BudgetExceeded(
                f"{durability.name} put of {key} not acknowledged: {_REFUSAL[name]}; {usage.resident_bytes} B of "
                f"records resident, no {name.value} byte budget configured. Free space or evict records, and "
                f"configure a {name.value} budget below the medium's capacity so that the store evicts before "
                f"the medium fills", tier=name, budget_bytes=0, need_bytes=need)
        protected = max(0, usage.resident_bytes - self.evictable_bytes(name))
        return BudgetExceeded(
            f"{name.value} tier budget of {usage.budget_bytes} B cannot fit {need} B for record {key}: "
            f"{usage.resident_bytes} B resident, {protected} B of it pinned, unacknowledged or the only "
            f"durable copy; unpin or evict records, or raise the {name.value} budget",
            tier=name, budget_bytes=usage.budget_bytes, need_bytes=need)

    # ----- placement and eviction --------------------------------------------------------

    async def _place(self, name: TierName, record: Record, op: _Op, reason: str, *,
                     may_wait: bool = False) -> _Placed:
        """Write `record` into tier `name`, evicting by policy first if its budget needs it.

        With `may_wait`, a put that finds the room taken by other operations' writes still in
        flight waits for them to settle (their copies then become evictable) instead of failing.
        """
        tier = self._tiers[name]
        need = tier.footprint(record)
        budget, _ = tier.occupancy()
        if budget and need > budget:
            return _Placed.NO_ROOM
        freed_after_refusal = 0
        while True:
            short = self._shortfall(name, need)  # a fresh snapshot each round: what follows may await
            if short > 0:
                if await self._make_room(name, short, op):
                    continue
                if may_wait and self._settling[name]:
                    self._settle_waiters += 1
                    try:
                        await self._settled.wait()
                    finally:
                        self._settle_waiters -= 1
                    continue
                return _Placed.NO_ROOM
            if await self._write(name, record, need, op):
                self._add_copy(record.key, name, need, reason)
                return _Placed.STORED
            if not tier.healthy:
                return _Placed.UNAVAILABLE
            if not budget:
                return _Placed.REFUSED  # nothing to evict for: the medium itself is full or failing
            # Refused with room by the arithmetic (free pages held by another kind's slabs):
            # free up to `need` more bytes, then give up.
            if freed_after_refusal >= need:
                return _Placed.NO_ROOM
            freed = await self._make_room(name, need - freed_after_refusal, op)
            if not freed:
                return _Placed.NO_ROOM
            freed_after_refusal += freed

    async def _write(self, name: TierName, record: Record, need: int, op: _Op) -> bool:
        if name not in op.writing:
            op.writing.add(name)
            self._settling[name] += 1
        self._writing_bytes[name] += need
        try:
            return await self._tiers[name].put(record)
        finally:
            self._writing_bytes[name] -= need

    def _settle(self, op: _Op) -> None:
        """The operation is over: wake whoever waits for room it held."""
        for name in op.writing:
            self._settling[name] -= 1
        if op.writing and self._settle_waiters:  # (no event per put when nobody waits)
            settled, self._settled = self._settled, asyncio.Event()
            settled.set()

    def _shortfall(self, name: TierName, need: int) -> int:
        budget, resident = self._tiers[name].occupancy()
        if not budget:
            return 0
        return resident + self._writing_bytes[name] + need - budget

    async def _make_room(self, name: TierName, need: int, op: _Op) -> int:
        """Evict the policy's victims for `need` bytes; 0 when the evictable data cannot cover it."""
        victims = self._plan_eviction(name, need)
        freed = 0
        for key in victims:
            freed += await self._evict_copy(key, name, op)
        return freed

    def _plan_eviction(self, name: TierName, need: int) -> list[RecordKey]:
        candidates: list[StateMeta] = []
        total = 0
        with contextlib.closing(self._queues[name].ordered()) as keys:
            for key in keys:
                meta = self._index.get(key)
                if meta is None or self._gate.busy(key) or eviction_block_reason(meta, name) is not None:
                    continue
                candidates.append(meta)
                total += meta.resident_bytes(name)
                if total >= need and len(candidates) >= self._eviction_window:
                    break
        if total < need:
            return []
        return self._invoker.decide_eviction(candidates, need, self._tier_cost(name))

    async def _evict_copy(self, key: RecordKey, name: TierName, op: _Op) -> int:
        meta = self._index.get(key)
        if meta is None or name not in meta.tiers or eviction_block_reason(meta, name) is not None:
            return 0
        if not self._gate.try_acquire(key):
            return 0  # a put of this key started meanwhile
        try:
            nbytes = meta.resident_bytes(name)
            self._drop_copy(key, name, "evicted")
            self._counter(name, meta.kind).evictions += 1
            op.evicted.append((key, name))
            await self._tiers[name].delete(key)
        finally:
            self._gate.release(key)
        return nbytes

    # ----- get ---------------------------------------------------------------------------

    async def get(self, key: RecordKey, *, expect_fingerprint: bytes | None = None,
                  expect_tenant: bytes | None = None) -> Record | None:
        """The record, searched fast to slow and promoted per policy; None on a miss.

        A record of another model fingerprint or tenant than the one expected is never
        returned (it counts as a miss).
        """
        searched: list[TierName] = []
        for name in self._search_order(self._index.get(key)):
            searched.append(name)
            record = await self._tiers[name].get(key)
            if record is None:
                self._note_missing(key, name)
                continue
            if not self._belongs(record, expect_fingerprint, expect_tenant):
                break
            self._count_lookup(searched, _kind_of(key))
            await self._after_hit(record, name)
            return record
        self._count_lookup(searched, _kind_of(key), hit=False)
        return None

    async def get_slices(self, key: RecordKey, layout: Callable[[bytes, int], Sequence[Slice]], *,
                         expect_fingerprint: bytes | None = None, expect_tenant: bytes | None = None
                         ) -> Record | tuple[RecordHeader, list[bytes]] | None:
        """`get` for a reader that frames the payload itself (GetRecords): a hit in the host tier
        comes back as (header, slices), the payload copied once from its pages into `layout`'s
        slices (`HostTier.read_slices`, verified as `get` verifies) instead of into a Record that
        the reader copies again. Any other case (the record elsewhere, or a tier faster than the
        host present, which a hit may have to be promoted into) is `get`."""
        order = self._search_order(self._index.get(key))
        host = self._tiers.get(TierName.HOST)
        if not order or order[0] is not TierName.HOST or TierName.HBM in self._tiers \
                or not hasattr(host, "read_slices"):
            return await self.get(key, expect_fingerprint=expect_fingerprint, expect_tenant=expect_tenant)
        got = host.read_slices(key, layout)  # type: ignore[union-attr]  # the host tier's own API
        if got is None:
            self._note_missing(key, TierName.HOST)
            return await self.get(key, expect_fingerprint=expect_fingerprint, expect_tenant=expect_tenant)
        header, slices, _ = got
        if not self._belongs_header(header, key, expect_fingerprint, expect_tenant):
            self._count_lookup([TierName.HOST], _kind_of(key), hit=False)
            return None
        self._count_lookup([TierName.HOST], _kind_of(key))
        meta = self._index.get(key)
        if meta is not None:
            await self._touch(meta, TierName.HOST, None)
        return header, slices

    def _search_order(self, meta: StateMeta | None) -> list[TierName]:
        held = meta.tiers if meta is not None else frozenset()
        return [n for n in TIER_ORDER if n in self._tiers and (n in SHARED_TIERS or n in held)]

    @staticmethod
    def _belongs(record: Record, fingerprint: bytes | None, tenant: bytes | None) -> bool:
        return TieredStore._belongs_header(record.header, record.key, fingerprint, tenant)

    @staticmethod
    def _belongs_header(h: RecordHeader, key: RecordKey, fingerprint: bytes | None, tenant: bytes | None) -> bool:
        if fingerprint is not None and h.model_fingerprint != fingerprint:
            logger.info("record %s belongs to another model fingerprint; not served", key.hex())
            return False
        if tenant is not None and h.tenant_id != tenant:
            logger.info("record %s belongs to another tenant; not served", key.hex())
            return False
        return True

    def _count_lookup(self, searched: list[TierName], kind: int, hit: bool = True) -> None:
        """Every present tier before the hit missed; the hit tier hit."""
        last = TIER_ORDER.index(searched[-1]) if hit and searched else len(TIER_ORDER)
        for name in self._tiers:
            if TIER_ORDER.index(name) < last:
                self._counter(name, kind).misses += 1
        if hit and searched:
            self._counter(searched[-1], kind).hits += 1

    def _note_missing(self, key: RecordKey, name: TierName) -> None:
        """A local tier the index trusted no longer has the copy (corrupt or removed)."""
        meta = self._index.get(key)
        if meta is not None and name in meta.tiers and name not in SHARED_TIERS and not self._gate.busy(key):
            logger.warning("%s copy of %s is gone (corrupt or removed); dropped from the index", name.value, key.hex())
            self._drop_copy(key, name, "missing")

    async def _after_hit(self, record: Record, source: TierName) -> None:
        await self._touch(self._index.get(record.key) or self._adopt(record, source), source, record)

    async def _touch(self, meta: StateMeta, source: TierName, record: Record | None) -> None:
        """A hit's bookkeeping, and its promotion when `record` is given (None: no faster tier)."""
        key = meta.key
        meta = meta.evolve(last_access=self._clock(), access_count=meta.access_count + 1)
        costs = self._costs()  # nothing moves before the promotion decision: one snapshot serves both
        self._set_meta(meta, costs)
        self._invoker.on_access(meta, source)
        if record is None:  # no faster tier to promote into (`get_slices`): nothing to decide
            return
        targets = self._invoker.decide_promote(meta, source, costs) - meta.tiers
        if not targets or not self._gate.try_acquire(key):
            return
        op = _Op()
        try:
            for name in sorted(targets, key=TIER_ORDER.index):
                if await self._place(name, record, op, "promoted") is _Placed.STORED:
                    self._counter(name, meta.kind).promotions += 1
        finally:
            self._gate.release(key)
            self._settle(op)

    def _adopt(self, record: Record, source: TierName) -> StateMeta:
        """Index a record another node wrote to a shared tier."""
        h = record.header
        meta = StateMeta(record.key, h.kind, record.nbytes, self._retention(h.kind),
                         durability=TIER_DURABILITY[source], acked=True, cache=self._is_cache(h.kind),
                         created=h.created_at_ns / 1e9,
                         model_fingerprint=h.model_fingerprint, tenant_id=h.tenant_id,
                         token_start=h.token_start, token_end=h.token_end)
        return meta.with_copy(source, self._tiers[source].footprint(record))

    # ----- lookup, pins, explicit eviction ---------------------------------------------------

    async def lookup(self, keys: Sequence[RecordKey]) -> LookupResult:
        """Longest stored prefix of `keys` in each tier, and across tiers (each key in any).

        Local tiers answer from the index (acknowledged copies), each scan stopping at its first
        miss: a Lookup of a long chain (512 blocks for a 128K-token prompt) costs what its
        stored prefix costs. Shared tiers are asked (one batch round trip; a tier that is down
        answers no hits).
        """
        self._invoker.on_lookup(keys)  # a policy may learn where each key sits in a reader's chain
        shared = {name: await self._tiers[name].contains(keys) for name in self._shared_tiers()}
        local = self._local_tiers()
        per_tier = {name: self._held_prefix(keys, (name,)) for name in local}
        held_locally = self._held_prefix(keys, local, max(per_tier.values(), default=0))
        if shared:  # a key counts if a local tier or a shared one holds it
            combined = _prefix_len([i < held_locally or any(flags[i] for flags in shared.values())
                                    for i in range(len(keys))])
        else:
            combined = held_locally
        per_tier.update((name, _prefix_len(flags)) for name, flags in shared.items())  # (fastest first, as TIER_ORDER)
        return LookupResult(per_tier, combined)

    def _held_prefix(self, keys: Sequence[RecordKey], names: Sequence[TierName], start: int = 0) -> int:
        """How many of `keys`, from the first, have an acknowledged copy in one of `names`
        (the first `start` known to have one)."""
        index = self._index
        for i in range(start, len(keys)):
            meta = index.get(keys[i])
            if meta is None or not meta.acked:
                return i
            for tier, _ in meta.resident:
                if tier in names:
                    break
            else:
                return i
        return len(keys)

    def metas(self, keys: Sequence[RecordKey]) -> list[StateMeta | None]:
        """`meta` of each key (a Lookup reads a whole chain's)."""
        index = self._index
        return [index.get(key) for key in keys]

    def request_done(self, keys: Sequence[RecordKey], generated_tokens: int) -> None:
        """A reader's request over `keys` (as it looked them up) finished, having generated
        `generated_tokens` tokens: the policy may learn from the outcome (how long a turn's answer
        was says much about whether the conversation comes back), and the keys' copies are
        re-scored for eviction at once."""
        if isinstance(generated_tokens, bool) or not isinstance(generated_tokens, int) or generated_tokens < 0:
            raise ValueError(f"generated_tokens must be an int >= 0, got {generated_tokens!r}")
        if not self._invoker.learns_outcomes:  # LRU: nothing to learn, nothing to re-score
            return
        self._invoker.on_request_end(keys, generated_tokens)
        costs = self._costs()
        for key in keys:
            meta = self._index.get(key)
            if meta is not None and meta.acked and not meta.pinned and meta.tiers:
                self._set_meta(meta, costs)

    def pin(self, key: RecordKey) -> bool:
        """Protect the record from eviction in every tier (in this process). False if unknown."""
        return self._set_pinned(key, True)

    def unpin(self, key: RecordKey) -> bool:
        return self._set_pinned(key, False)

    def _set_pinned(self, key: RecordKey, pinned: bool) -> bool:
        meta = self._index.get(key)
        if meta is None:
            return False
        self._set_meta(meta.evolve(pinned=pinned))
        return True

    async def evict(self, key: RecordKey, tiers: Iterable[TierName] | None = None, *,
                    force: bool = False) -> frozenset[TierName]:
        """Remove the record from `tiers` (default: all), durable copies included.

        A pinned record is left alone unless `force`. Waits for a put of the key in flight.
        Returns the tiers it was removed from.
        """
        wanted = set(self._tiers) if tiers is None else set(tiers) & set(self._tiers)
        async with self._gate.hold(key):
            meta = self._index.get(key)
            if meta is not None and meta.pinned and not force:
                return frozenset()
            removed = set()
            for name in sorted(wanted, key=TIER_ORDER.index):
                indexed = meta is not None and name in meta.tiers
                if indexed:
                    self._drop_copy(key, name, "explicit")
                if (indexed or name in SHARED_TIERS) and await self._tiers[name].delete(key):
                    removed.add(name)
            return frozenset(removed)

    # ----- introspection ---------------------------------------------------------------------

    def meta(self, key: RecordKey) -> StateMeta | None:
        return self._index.get(key)

    def explain(self, key: RecordKey) -> dict[str, object] | None:
        """Why the record is where it is, for `statestore inspect`; None if the key is unknown.

        Always: residency, pin, durability, and what protects each copy from eviction. A policy
        that can explain itself (`explain_dict(meta, tiers)`, e.g. `CostAwarePolicy`) adds its
        reasoning (value, P(reuse), rebuild vs load seconds, fill) under "policy"; a policy
        that raises there is reported, not propagated (the policy boundary).
        """
        meta = self._index.get(key)
        if meta is None:
            return None
        policy = self._invoker.policy
        out: dict[str, object] = {
            "key": key.hex(), "kind": meta.kind, "size_bytes": meta.size_bytes,
            "retention": meta.retention.name, "durability": meta.durability.name, "pinned": meta.pinned,
            "acked": meta.acked, "tiers": {t.value: n for t, n in meta.resident},
            "last_access": meta.last_access, "access_count": meta.access_count,
            "protected": {t.value: eviction_block_reason(meta, t) for t in meta.tiers},
            "policy_name": policy.name,
        }
        explain = getattr(policy, "explain_dict", None)
        if callable(explain):
            try:
                out["policy"] = explain(meta, self._costs())
            except Exception as exc:  # noqa: BLE001 - the policy boundary: inspect must not fail
                logger.warning("policy %s: explain_dict raised", policy.name, exc_info=True)
                out["policy"] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[RecordKey]:
        return list(self._index)

    def evictable_bytes(self, tier: TierName) -> int:
        """Bytes of the copies in `tier` that the store may evict now (`policy.may_evict`: not
        pinned, acknowledged, not the only durable copy), as its eviction queue sums them."""
        return self._queues[tier].evictable_bytes

    def acked_bytes(self, tenant_id: bytes) -> int:
        """`size_bytes` summed over the tenant's acknowledged records in the index (each once,
        however many tiers hold it): what a byte quota counts, without a pass over the index."""
        return self._acked_bytes.get(tenant_id, 0)

    def track_kind(self, kind: int) -> None:
        """Keep the keys of every tenant's records of `kind` listed (`keys_of_kind`) from now on:
        for a kind with few records that a caller must find by tenant (session manifests)."""
        if kind in self._listed_kinds:
            return
        self._listed_kinds.add(kind)
        for meta in self._index.values():
            if meta.kind == kind:
                self._listed.setdefault((meta.tenant_id, kind), {})[meta.key] = None

    def keys_of_kind(self, tenant_id: bytes, kind: int) -> list[RecordKey]:
        """The index's keys of the tenant's records of `kind` (acknowledged or in flight), a
        kind `track_kind` listed: as a pass over the index would find them, without the pass."""
        if kind not in self._listed_kinds:
            raise ValueError(f"kind {kind} is not listed: call track_kind({kind}) first")
        return list(self._listed.get((tenant_id, kind), ()))

    def _count_entry(self, old: StateMeta | None, new: StateMeta | None) -> None:
        """`acked_bytes` and the listed keys as an index entry goes from `old` to `new` (None:
        absent)."""
        if self._listed_kinds:
            self._list_entry(old, new)
        if old is not None and new is not None and (old.acked, old.size_bytes, old.tenant_id) == \
                (new.acked, new.size_bytes, new.tenant_id):
            return  # most updates (a hit's access time, a copy placed): the totals stay as they are
        totals = self._acked_bytes
        if old is not None and old.acked:
            left = totals[old.tenant_id] - old.size_bytes
            if left:
                totals[old.tenant_id] = left
            else:
                del totals[old.tenant_id]
        if new is not None and new.acked:
            totals[new.tenant_id] = totals.get(new.tenant_id, 0) + new.size_bytes

    def _list_entry(self, old: StateMeta | None, new: StateMeta | None) -> None:
        """A listed kind's key joins its (tenant, kind) list when its entry appears and leaves it
        when the entry goes; between, neither changes (the kind is in the key, and every update
        of an entry keeps its tenant)."""
        if old is None and new is not None and new.kind in self._listed_kinds:
            self._listed.setdefault((new.tenant_id, new.kind), {})[new.key] = None
        elif new is None and old is not None and old.kind in self._listed_kinds:
            keys = self._listed[(old.tenant_id, old.kind)]
            del keys[old.key]
            if not keys:
                del self._listed[(old.tenant_id, old.kind)]

    def usage(self) -> dict[TierName, float]:
        """Fill of each tier in [0, 1] (0 for an unbounded tier)."""
        return {n: t.usage().fill for n, t in self._tiers.items()}

    def stats(self) -> dict[TierName, TierStats]:
        """Per tier and kind: records and bytes (the tier's own usage), hits, misses, evictions, promotions."""
        out = {}
        for name, tier in self._tiers.items():
            usage = tier.usage()
            kinds = set(usage.by_kind) | {k for n, k in self._counters if n is name}
            by_kind = {k: self._kind_stats(name, k, usage.by_kind.get(k)) for k in sorted(kinds)}
            out[name] = TierStats(name, usage.budget_bytes, usage.resident_bytes, usage.fill, tier.healthy, by_kind,
                                  usage.reserve_bytes)
        return out

    def _kind_stats(self, name: TierName, kind: int, usage: object) -> KindStats:
        c = self._counters.get((name, kind), _Counters())
        records = getattr(usage, "num_records", 0)
        resident = getattr(usage, "resident_bytes", 0)
        return KindStats(records, resident, c.hits, c.misses, c.evictions, c.promotions)

    def take_events(self) -> list[StoreEvent]:
        """Drain the residency events recorded since the last call (needs `enable_events`)."""
        events, self._events = self._events, []
        return events

    # ----- index bookkeeping ---------------------------------------------------------------------

    def _local_tiers(self) -> list[TierName]:
        return [n for n in TIER_ORDER if n in self._tiers and n not in SHARED_TIERS]

    def _shared_tiers(self) -> list[TierName]:
        return [n for n in TIER_ORDER if n in self._tiers and n in SHARED_TIERS]

    def _retention(self, kind: int) -> Retention:
        return self._config.retention_by_kind.get(kind, Retention.MUST_KEEP)

    def _is_cache(self, kind: int) -> bool:
        """Whether records of `kind` are a cache (`StoreConfig.cache_kinds`)."""
        return kind in self._config.cache_kinds

    def _set_meta(self, meta: StateMeta, costs: Mapping[TierName, TierCost] | None = None) -> None:
        """Store the entry and refresh its eviction-queue membership in every tier (`costs`: the
        tiers' costs as they are now, when the caller has them)."""
        self._count_entry(self._index.get(meta.key), meta)
        self._index[meta.key] = meta
        if not meta.acked or meta.pinned:  # never evictable (`eviction_block_reason`): in no queue
            for queue in self._queues.values():
                queue.remove(meta.key)
            return
        held = [t for t, _ in meta.resident]  # not `meta.tiers`: no frozenset on every put and hit
        for name, queue in self._queues.items():
            if name in held and may_evict(meta, name):
                cost = costs[name] if costs is not None else self._tier_cost(name)
                queue.insert(meta.key, self._invoker.eviction_score(meta, cost), meta.resident_bytes(name))
            else:
                queue.remove(meta.key)

    def _add_copy(self, key: RecordKey, name: TierName, nbytes: int, reason: str) -> None:
        self._set_meta(self._index[key].with_copy(name, nbytes))
        self._event(EventKind.STORED, key, name, reason)

    def _drop_copy(self, key: RecordKey, name: TierName, reason: str) -> None:
        meta = self._index[key].without_copy(name)
        self._event(EventKind.REMOVED, key, name, reason)
        self._invoker.on_remove(meta, name)
        if meta.resident or not meta.acked:
            self._set_meta(meta)
        else:
            self._forget(key)

    def _forget(self, key: RecordKey) -> None:
        self._count_entry(self._index.pop(key, None), None)
        for queue in self._queues.values():
            queue.remove(key)

    def _counter(self, name: TierName, kind: int) -> _Counters:
        counters = self._counters.get((name, kind))
        if counters is None:  # not setdefault: that would build a _Counters on every hit
            counters = self._counters[(name, kind)] = _Counters()
        return counters

    def _event(self, kind: EventKind, key: RecordKey, tier: TierName, reason: str) -> None:
        if self._config.enable_events:
            self._events.append(StoreEvent(kind, key, tier, reason))

    def _tier_cost(self, name: TierName) -> TierCost:
        tier = self._tiers[name]
        budget, resident = tier.occupancy()
        profile = self._config.tier_profiles.get(name) or DEFAULT_TIER_PROFILES[name]
        return TierCost(name, profile.latency_s, profile.bandwidth_bytes_per_s, budget, resident, tier.healthy)

    def _costs(self) -> Mapping[TierName, TierCost]:
        """The present tiers' costs as they are now (read them before anything awaits)."""
        return _TierCosts(self._tiers, self._tier_cost)

    def load_time_s(self, name: TierName, nbytes: int) -> float:
        """Modeled seconds to read `nbytes` from tier `name` (its profile: calibrated or default)."""
        profile = self._config.tier_profiles.get(name) or DEFAULT_TIER_PROFILES[name]
        return profile.latency_s + nbytes / profile.bandwidth_bytes_per_s
