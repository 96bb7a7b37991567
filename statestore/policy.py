"""Placement policy: where records go, what is evicted first (kvcr's policy/mechanism split).

A policy is a pure function of frozen values (`StateMeta`, `TierCost`) that returns
decisions; it never touches storage. The store calls it only through `_PolicyInvoker`,
which validates every decision and falls back to LRU-safe behaviour when a policy raises
or returns something invalid, logging a warning with the reason.

Safety rules no policy can override (`eviction_block_reason`):
- a pinned record is never evicted;
- a record whose put is still in flight (not acknowledged) is never evicted;
- the only copy of a record at or above its durability level is never evicted (the only
  SSD copy of a LOCAL record, the only Redis copy of a SHARED one). MEMORY-level records
  are a cache: any copy may go.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence

from statestore.types import (
    TIER_DURABILITY,
    TIER_ORDER,
    Durability,
    PlacementDecision,
    StateMeta,
    TierCost,
    TierName,
)
from tiers.record import RecordKey

logger = logging.getLogger(__name__)

_DURABLE_TIER = {Durability.LOCAL: TierName.SSD, Durability.SHARED: TierName.REDIS}


def required_tier(durability: Durability, present: Collection[TierName]) -> TierName | None:
    """The tier a put must reach before it is acknowledged (None: no such tier is present).

    MEMORY: the host tier, else the fastest tier present; LOCAL: ssd; SHARED: redis.
    """
    if durability in _DURABLE_TIER:
        tier = _DURABLE_TIER[durability]
        return tier if tier in present else None
    if TierName.HOST in present:
        return TierName.HOST
    return next((t for t in TIER_ORDER if t in present), None)


def may_evict(meta: StateMeta, tier: TierName) -> bool:
    """Whether the copy of `meta` in `tier` may be evicted: not pinned, acknowledged, and not
    the only copy at its durability level (unless its kind is a cache). The store asks on every
    change of its index (`eviction_block_reason` says why not, for messages)."""
    if meta.pinned or not meta.acked:
        return False
    durability = meta.durability
    if durability > Durability.MEMORY and not meta.cache and TIER_DURABILITY[tier] >= durability:
        return any(t is not tier and TIER_DURABILITY[t] >= durability for t, _ in meta.resident)
    return True


def eviction_block_reason(meta: StateMeta, tier: TierName) -> str | None:
    """Why the copy of `meta` in `tier` must not be evicted (`may_evict`), or None if it may be."""
    if may_evict(meta, tier):
        return None
    if meta.pinned:
        return "pinned"
    if not meta.acked:
        return "not yet acknowledged"
    return f"the only {meta.durability.name} copy"


def take_until_covered(ordered: Sequence[StateMeta], need_bytes: int, tier: TierName) -> list[RecordKey]:
    """The shortest prefix of `ordered` whose copies in `tier` free at least `need_bytes`."""
    keys: list[RecordKey] = []
    freed = 0
    for meta in ordered:
        if freed >= need_bytes:
            break
        keys.append(meta.key)
        freed += meta.resident_bytes(tier)
    return keys


class PlacementPolicy:
    """Base class: three required decisions, one overridable default, optional hooks.

    Policies see only frozen values: `StateMeta` (size, retention, durability, residency,
    access history, hints) and `TierCost` (latency, bandwidth, budget, fill, health) per
    tier, which is what a cost-aware policy needs to price load against rebuild.
    """

    name = "policy"
    # How many candidates `decide_eviction` wants to see (at least those that free the bytes
    # needed): None = the store's `StoreConfig.eviction_window`. A policy whose choice within
    # the window can differ from the queue's order (its `eviction_score`) wants a window; one
    # that always takes the queue's order needs only the candidates that cover the need (1).
    eviction_window: int | None = None

    # ----- required decisions -----------------------------------------------------------

    def decide_put(self, meta: StateMeta, tiers: Mapping[TierName, TierCost]) -> PlacementDecision:
        """Tiers to hold a new record. Must include `required_tier(meta.durability, tiers)`."""
        raise NotImplementedError

    def eviction_score(self, meta: StateMeta, tier: TierCost) -> float:
        """Order of eviction from `tier`: lower is evicted first. Must be a finite number."""
        raise NotImplementedError

    def decide_eviction(self, candidates: Sequence[StateMeta], need_bytes: int, tier: TierCost) -> list[RecordKey]:
        """Keys to evict from `tier` to free `need_bytes`, chosen among `candidates`.

        `candidates` are evictable (see `eviction_block_reason`) and come in ascending
        `eviction_score` order; together they free at least `need_bytes`.
        """
        raise NotImplementedError

    # ----- overridable default ------------------------------------------------------------

    def decide_promote(self, meta: StateMeta, source: TierName,
                       tiers: Mapping[TierName, TierCost]) -> PlacementDecision:
        """Faster tiers to copy a record into after a hit in `source`. Default: host."""
        if TierName.HOST in tiers and TIER_ORDER.index(TierName.HOST) < TIER_ORDER.index(source):
            return frozenset({TierName.HOST})
        return frozenset()

    # ----- optional hooks for policies that keep state --------------------------------------

    def on_put(self, meta: StateMeta, tiers: frozenset[TierName]) -> None:
        """An acknowledged put; `tiers` hold it now."""

    def on_access(self, meta: StateMeta, tier: TierName) -> None:
        """A hit served from `tier`."""

    def on_remove(self, meta: StateMeta, tier: TierName) -> None:
        """The copy in `tier` is gone (evicted, deleted or found missing)."""

    def on_lookup(self, keys: Sequence[RecordKey]) -> None:
        """A reader looked up this key chain (a request's blocks, in order), before its gets and puts."""

    def on_request_end(self, keys: Sequence[RecordKey], generated_tokens: int) -> None:
        """The reader's request over `keys` finished, having generated `generated_tokens` tokens
        (after its gets and puts; the store re-scores the keys' copies right after)."""


class LRUPolicy(PlacementPolicy):
    """Least recently used: cache every put in host RAM, evict the oldest access first."""

    name = "lru"
    # Its eviction order is its queue order (`eviction_score` is the last access, the tie the
    # queue's insertion order), so the candidates beyond those that cover the need would never
    # be chosen: collecting the store's default window of 32 cost a full tier ~60 us per put.
    eviction_window = 1

    def decide_put(self, meta: StateMeta, tiers: Mapping[TierName, TierCost]) -> PlacementDecision:
        chosen = {t for t in (required_tier(meta.durability, tiers), TierName.HOST) if t in tiers}
        return frozenset(chosen)

    def eviction_score(self, meta: StateMeta, tier: TierCost) -> float:
        return meta.last_access

    def decide_eviction(self, candidates: Sequence[StateMeta], need_bytes: int, tier: TierCost) -> list[RecordKey]:
        # sorted() is stable: equal timestamps keep the queue order, which follows recency.
        return take_until_covered(sorted(candidates, key=lambda m: m.last_access), need_bytes, tier.tier)


class _PolicyInvoker:
    """Calls the policy, validates what it returns, and falls back to LRU-safe behaviour.

    Every fallback logs a warning naming the policy and what was wrong (with exc_info when
    the policy raised). The fallback never evicts anything `eviction_block_reason` protects.
    """

    def __init__(self, policy: PlacementPolicy) -> None:
        self.policy = policy
        self._fallback = LRUPolicy()

    def eviction_window(self, default: int) -> int:
        """The candidates to collect per eviction: the policy's `eviction_window`, or `default`
        where it names none (or names something other than a positive int: a warning)."""
        window = getattr(self.policy, "eviction_window", None)
        if window is None:
            return default
        if type(window) is not int or window < 1:
            logger.warning("policy %s: eviction_window %r is not a positive int; using %d",
                           self.policy.name, window, default)
            return default
        return window

    def _warn(self, what: str, problem: object, *, exc_info: bool = False) -> None:
        logger.warning("policy %s: %s %s; falling back to LRU", self.policy.name, what, problem,
                       exc_info=exc_info)

    def decide_put(self, meta: StateMeta, tiers: Mapping[TierName, TierCost]) -> PlacementDecision:
        try:
            decision = self.policy.decide_put(meta, tiers)
        except Exception:  # noqa: BLE001 - the policy boundary: a bad policy must not fail a put
            self._warn("decide_put", "raised", exc_info=True)
            return self._fallback.decide_put(meta, tiers)
        required = required_tier(meta.durability, tiers)
        problem = self._placement_problem(decision, tiers)
        if problem is None and required is not None and required not in decision:
            problem = f"omits {required.value}, which {meta.durability.name} durability requires"
        if problem is not None:
            self._warn("decide_put", f"returned {decision!r}: {problem}")
            return self._fallback.decide_put(meta, tiers)
        return frozenset(decision)

    def decide_promote(self, meta: StateMeta, source: TierName,
                       tiers: Mapping[TierName, TierCost]) -> PlacementDecision:
        try:
            decision = self.policy.decide_promote(meta, source, tiers)
        except Exception:  # noqa: BLE001 - the policy boundary
            self._warn("decide_promote", "raised", exc_info=True)
            return self._fallback.decide_promote(meta, source, tiers)
        problem = self._placement_problem(decision, tiers)
        if problem is None and any(TIER_ORDER.index(t) >= TIER_ORDER.index(source) for t in decision):
            problem = f"is not faster than {source.value}"
        if problem is not None:
            self._warn("decide_promote", f"returned {decision!r}: {problem}")
            return self._fallback.decide_promote(meta, source, tiers)
        return frozenset(decision)

    @staticmethod
    def _placement_problem(decision: object, tiers: Mapping[TierName, TierCost]) -> str | None:
        if not isinstance(decision, (set, frozenset)) or not all(isinstance(t, TierName) for t in decision):
            return "is not a set of TierName"
        missing = [t.value for t in decision if t not in tiers]
        return f"names absent tiers {missing}" if missing else None

    def eviction_score(self, meta: StateMeta, tier: TierCost) -> float:
        try:
            score = self.policy.eviction_score(meta, tier)
        except Exception:  # noqa: BLE001 - the policy boundary
            self._warn("eviction_score", "raised", exc_info=True)
            return self._fallback.eviction_score(meta, tier)
        if type(score) not in (int, float) or not math.isfinite(score):
            self._warn("eviction_score", f"returned {score!r}, not a finite number")
            return self._fallback.eviction_score(meta, tier)
        return float(score)

    def decide_eviction(self, candidates: Sequence[StateMeta], need_bytes: int, tier: TierCost) -> list[RecordKey]:
        """Validated victims: known candidates, each evictable, together freeing `need_bytes`
        (or every evictable candidate, if they cannot)."""
        by_key = {m.key: m for m in candidates}
        evictable = [m for m in candidates if eviction_block_reason(m, tier.tier) is None]
        try:
            keys = self.policy.decide_eviction(evictable, need_bytes, tier)
        except Exception:  # noqa: BLE001 - the policy boundary
            self._warn("decide_eviction", "raised", exc_info=True)
            return self._fallback.decide_eviction(evictable, need_bytes, tier)
        problem = self._eviction_problem(keys, by_key, evictable, need_bytes, tier.tier)
        if problem is not None:
            self._warn("decide_eviction", problem)
            return self._fallback.decide_eviction(evictable, need_bytes, tier)
        return list(dict.fromkeys(keys))

    @staticmethod
    def _eviction_problem(keys: object, by_key: Mapping[RecordKey, StateMeta], evictable: Sequence[StateMeta],
                          need_bytes: int, tier: TierName) -> str | None:
        if not isinstance(keys, (list, tuple)):
            return f"returned {type(keys).__name__}, not a list of keys"
        for key in keys:
            meta = by_key.get(key) if isinstance(key, bytes) else None
            if meta is None:
                return f"chose {key!r}, which is not a candidate"
            reason = eviction_block_reason(meta, tier)
            if reason is not None:
                return f"tried to evict {bytes(meta.key).hex()} from {tier.value}: it is {reason}"
        freed = sum(by_key[k].resident_bytes(tier) for k in set(keys))  # type: ignore[index]
        possible = sum(m.resident_bytes(tier) for m in evictable)
        if freed < min(need_bytes, possible):
            return f"frees {freed} B of the {need_bytes} B needed"
        return None

    def on_put(self, meta: StateMeta, tiers: frozenset[TierName]) -> None:
        self._hook("on_put", meta, tiers)

    def on_access(self, meta: StateMeta, tier: TierName) -> None:
        self._hook("on_access", meta, tier)

    def on_remove(self, meta: StateMeta, tier: TierName) -> None:
        self._hook("on_remove", meta, tier)

    def on_lookup(self, keys: Sequence[RecordKey]) -> None:
        self._hook("on_lookup", keys)

    @property
    def learns_outcomes(self) -> bool:
        """Whether the policy overrides `on_request_end` (else reporting outcomes to it is a no-op)."""
        return type(self.policy).on_request_end is not PlacementPolicy.on_request_end

    def on_request_end(self, keys: Sequence[RecordKey], generated_tokens: int) -> None:
        self._hook("on_request_end", keys, generated_tokens)

    def _hook(self, name: str, *args: object) -> None:
        try:
            getattr(self.policy, name)(*args)
        except Exception:  # noqa: BLE001 - the policy boundary: hooks only observe
            logger.warning("policy %s: %s raised; ignored", self.policy.name, name, exc_info=True)
