"""Value types of the store: what the mechanism tracks and what policies see. No I/O here.

Policies only ever see these frozen values (kvcr's `types.py` habit): a policy cannot
mutate the store's index, it can only return decisions, which the invoker validates.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine_adapter.base import Retention
from tiers.record import RecordKey


class Durability(enum.IntEnum):
    """How safe a put must be before it is acknowledged. Ordered: a higher level implies the lower."""

    MEMORY = 1  # in host RAM (or the fastest tier present): lost with the process
    LOCAL = 2  # fsynced on the local SSD: survives kill -9 and power loss of this node
    SHARED = 3  # acknowledged by Redis: survives this node and is readable from any node


class TierName(str, enum.Enum):
    """The tiers, fastest first; the value is the `Tier.name` of the implementation."""

    HBM = "hbm"
    HOST = "host"
    SSD = "ssd"
    REDIS = "redis"


TIER_ORDER: tuple[TierName, ...] = (TierName.HBM, TierName.HOST, TierName.SSD, TierName.REDIS)
"""Search order of `get` and the meaning of "faster": earlier is faster."""

TIER_DURABILITY: Mapping[TierName, Durability] = {
    TierName.HBM: Durability.MEMORY,
    TierName.HOST: Durability.MEMORY,
    TierName.SSD: Durability.LOCAL,
    TierName.REDIS: Durability.SHARED,
}
"""The durability a copy in each tier gives."""

SHARED_TIERS: frozenset[TierName] = frozenset({TierName.REDIS})
"""Tiers other nodes write to: the store's index of them is a cache, never authoritative."""


def faster_tiers(than: TierName, present: Mapping[TierName, object] | frozenset[TierName]) -> list[TierName]:
    """The present tiers faster than `than`, fastest first."""
    return [t for t in TIER_ORDER[: TIER_ORDER.index(than)] if t in present]


@dataclass(frozen=True, slots=True)
class PutHints:
    """What the caller knows about reuse (an agent saying when it will be back)."""

    expected_return_s: float | None = None  # seconds until the next expected access
    ttl_s: float | None = None  # after this long the state is worthless


@dataclass(frozen=True, slots=True)
class StateMeta:
    """The store's index entry for one record, as policies see it.

    Invariants (maintained by `statestore.store.TieredStore`):
    - `resident` lists each tier holding a copy with the bytes that copy costs there;
    - `acked` is False exactly while a put of this key is in flight and has not reached
      `durability`; such a record is never evicted;
    - `durability` is the highest level any acknowledged put asked for.
    """

    key: RecordKey
    kind: int
    size_bytes: int  # header + raw payload: the record as encoded without compression
    retention: Retention
    durability: Durability = Durability.MEMORY
    acked: bool = False
    pinned: bool = False
    cache: bool = False  # a cache kind (`StoreConfig.cache_kinds`): its only durable copy may be evicted
    resident: tuple[tuple[TierName, int], ...] = ()  # (tier, resident bytes there), fastest first
    created: float = 0.0  # wall-clock seconds
    last_access: float = 0.0  # wall-clock seconds
    access_count: int = 0
    hints: PutHints | None = None
    model_fingerprint: bytes = b""
    tenant_id: bytes = b""
    # The record's token range (from its header): what a cost-aware policy prices a rebuild
    # by. (0, 0) = unknown (a per-sequence record or an index built before these fields).
    token_start: int = 0
    token_end: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens the record covers (0 when unknown or per sequence)."""
        return self.token_end - self.token_start

    @property
    def tiers(self) -> frozenset[TierName]:
        return frozenset(t for t, _ in self.resident)

    def resident_bytes(self, tier: TierName) -> int:
        """Bytes this record's copy costs in `tier` (0 when not resident there)."""
        for t, n in self.resident:
            if t is tier:
                return n
        return 0

    def evolve(self, **changes: Any) -> StateMeta:
        """`dataclasses.replace` at half its cost (no per-call field introspection, no __init__):
        the store makes several of these per put and get. `changes` must name fields."""
        new = _new_meta(StateMeta)
        for name, set_field in _META_SETTERS:
            set_field(new, changes.pop(name) if name in changes else getattr(self, name))
        if changes:
            raise TypeError(f"StateMeta has no fields {sorted(changes)}")
        return new

    def with_copy(self, tier: TierName, nbytes: int) -> StateMeta:
        if not self.resident:
            return self.evolve(resident=((tier, nbytes),))
        rest = [(t, n) for t, n in self.resident if t is not tier]
        rest.append((tier, nbytes))
        return self.evolve(resident=tuple(sorted(rest, key=lambda tn: TIER_ORDER.index(tn[0]))))

    def without_copy(self, tier: TierName) -> StateMeta:
        return self.evolve(resident=tuple((t, n) for t, n in self.resident if t is not tier))


_new_meta = object.__new__
_META_SETTERS = tuple((name, getattr(StateMeta, name).__set__) for name in StateMeta.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class TierCost:
    """What a policy knows about a tier: its measured costs and how full it is."""

    tier: TierName
    latency_s: float
    bandwidth_bytes_per_s: float
    budget_bytes: int = 0  # 0 = unbounded
    resident_bytes: int = 0
    healthy: bool = True

    @property
    def fill(self) -> float:
        return min(1.0, self.resident_bytes / self.budget_bytes) if self.budget_bytes else 0.0

    def load_time_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class TierProfile:
    """Measured (by `statestore calibrate`) or default cost constants of one tier."""

    latency_s: float
    bandwidth_bytes_per_s: float


DEFAULT_TIER_PROFILES: Mapping[TierName, TierProfile] = {
    TierName.HBM: TierProfile(2e-6, 1e12),
    TierName.HOST: TierProfile(5e-6, 1e10),
    TierName.SSD: TierProfile(1e-4, 2e9),
    TierName.REDIS: TierProfile(5e-4, 1e9),
}
"""Placeholders until a calibration profile is loaded; only their order matters to LRU."""

PlacementDecision = frozenset[TierName]
"""Where a record should be held: a set of tiers."""


@dataclass(frozen=True, slots=True)
class PutResult:
    """An acknowledged put: the level reached and where the record now lives."""

    key: RecordKey
    durability: Durability
    tiers: frozenset[TierName]
    evicted: tuple[tuple[RecordKey, TierName], ...] = ()  # copies dropped to make room


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest stored prefix of a key chain: per tier, and across tiers (key by key, any tier)."""

    per_tier: dict[TierName, int] = field(default_factory=dict)
    combined: int = 0


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """A residency change, drained by `TieredStore.take_events()` (vLLM BlockPool's habit)."""

    kind: EventKind
    key: RecordKey
    tier: TierName
    reason: str  # stored: "put" | "promoted" | "scan"; removed: "evicted" | "explicit" | "missing"


@dataclass(frozen=True, slots=True)
class KindStats:
    num_records: int = 0
    resident_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    promotions: int = 0


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's occupancy (from its own `usage()`) and the store's counters, per kind."""

    tier: TierName
    budget_bytes: int
    resident_bytes: int
    fill: float
    healthy: bool
    by_kind: dict[int, KindStats] = field(default_factory=dict)
    reserve_bytes: int = 0  # held for reuse beyond the records (`tiers.base.TierUsage`)


@dataclass(frozen=True, slots=True)
class OpenReport:
    """What `TieredStore.open()` re-indexed, and what the tiers' scans discarded."""

    indexed: dict[TierName, int] = field(default_factory=dict)
    discarded: dict[TierName, list[str]] = field(default_factory=dict)
