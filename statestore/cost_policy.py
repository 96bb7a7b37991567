"""The cost-aware placement policy: recompute versus store (DESIGN.md §5).

For a record r and a tier X the policy prices what a copy in X is worth:

    value_X(r)   = P(reuse within H_X) x (fallback_X(r) - load_X(r))     seconds saved
    density_X(r) = value_X(r) / bytes_X(r)                             seconds per byte held

- load_X = latency_X + bytes / bandwidth_X (the `TierCost`, from the calibration profile);
- fallback_X = what a reader pays without this copy: the fastest other copy's load, else the
  rebuild. Rebuild of a REBUILDABLE record (SWA rings, tails) = a bounded replay of R rows; of
  a MUST_KEEP global block = an encoder pass over its tokens plus the W - 1 lead-in, given its
  predecessors (`EngineProfile.block_rebuild_s`);
- P(reuse): pinned = 1; session hints (`PutHints.expected_return_s`, `ttl_s`) when given;
  otherwise learned per tenant (`statestore.reuse.ReuseEstimator`: P(next | accesses so far,
  where the record sat in the key chain its reader looked up) and the gap distribution,
  conditioned on the idle time). The chain context comes from `on_lookup`, which the store
  calls with each reader's key chain before its gets and puts: a chain's last block (the
  reader's own tail) and the blocks of short one-off chains are rarely read again, the inner
  blocks of long shared documents often; LRU treats them alike and lets a stream of tails
  flush the documents. A hit is priced with the access it brings (the store prices a copy
  before the hook reports the access);
- H_X, the holding horizon of X: how long a byte stays in X before the tier turns over
  (budget / observed inflow, Che's characteristic time); the shadow price of a full tier is
  the value of what it last evicted.

Decisions: admit into a tier only where the copy saves time (and, for SSD, more than its
write costs); evict lowest density first. The eviction score is time-invariant so the
store's heap can cache it: score = last_access + tau x ln(density / D_REF), the time at which
the record's value per byte, decaying with the tenant's mean gap tau, falls to a reference.
With equal densities this is exactly LRU; a record worth k times more per byte is kept
tau x ln(k) seconds longer. Demotion is eviction of the copy that saves least: a host copy
of a record also on SSD only saves the SSD load, so it goes before host-only records.

The policy is a pure function of `StateMeta`, `TierCost` and what it learned through its
hooks; it never reads a clock or touches storage ("now" is the latest access it has seen).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_adapter.base import Retention, StateKind
from statestore.policy import PlacementPolicy, required_tier, take_until_covered
from statestore.profile import CostProfile, EngineProfile
from statestore.reuse import NO_CONTEXT, ReuseConfig, ReuseEstimator, chain_context, describe_context
from statestore.types import TIER_ORDER, PlacementDecision, StateMeta, TierCost, TierName
from tiers.record import RecordKey

D_REF = 1e-9  # reference density (seconds saved per byte) of the score's zero point
PINNED_SCORE = 1e30  # finite, above every real score (pinned copies are never candidates anyway)
_LOG_CLAMP = 60.0
_NO_CHAIN = (NO_CONTEXT, 1.0)


@dataclass(frozen=True, slots=True)
class CostPolicyConfig:
    """Knobs of the cost-aware policy (the cost constants come from the `CostProfile`)."""

    hint_confidence: float = 0.9  # P(the session comes back when its hint says)
    min_horizon_s: float = 1.0
    max_horizon_s: float = 86_400.0  # also the horizon of an unbounded tier
    admit_fill: float = 0.9  # above this fill a new copy must beat the tier's shadow price
    # SSD write seconds count this much against admitting a copy: a write is background work
    # (it delays no reader) whose cost is wear. At 1.0 the Mooncake trace refused ~960 SSD
    # copies of chain tails (1.8% fewer bytes written) and paid 0.4% mean TTFT for the ~200
    # of their reads that then missed: a quarter keeps wear in the balance without that.
    ssd_write_weight: float = 0.25
    shadow_decay: float = 0.05  # EWMA weight of each removed copy's score in the shadow price
    # Seconds of recency that an e-fold of value per byte buys in the eviction score: twice the
    # tier's turnover time, at most score_tau_s. Bounded on purpose: the heap caches scores, and
    # a tau that drifts far would leave records scored under an old tau out of order (early
    # records then squat in the cache). What is learned (P(next) per access count and chain
    # context, the gap distribution, the tier horizons) enters through the value itself.
    # (On the Mooncake trace, 1-8 GiB host: 2x the turnover beat 1x and 4x; 400 s beat 300 s and 1,000 s.)
    score_tau_s: float = 400.0
    tau_per_horizon: float = 2.0
    reuse: ReuseConfig = ReuseConfig()

    def __post_init__(self) -> None:
        if not 0.0 < self.hint_confidence <= 1.0:
            raise ValueError(f"hint_confidence must lie in (0, 1], got {self.hint_confidence}")
        if not 0 < self.min_horizon_s <= self.max_horizon_s:
            raise ValueError("need 0 < min_horizon_s <= max_horizon_s")
        if self.score_tau_s <= 0 or self.tau_per_horizon <= 0:
            raise ValueError("score_tau_s and tau_per_horizon must be positive")


@dataclass(frozen=True, slots=True)
class TierValue:
    """The priced view of one record in one tier (what `explain` reports)."""

    tier: TierName
    p_reuse: float
    horizon_s: float
    load_s: float
    fallback_s: float
    bytes: int
    value_s: float  # P(reuse) x (fallback - load)
    density: float  # value per byte
    score: float  # the eviction score (time-invariant; lower goes first)
    fill: float


class CostAwarePolicy(PlacementPolicy):
    """Admission, tier choice, demotion and eviction by value per byte (module docstring).

    Args:
        profile: the engine and tier costs (`statestore calibrate`); tier latency and
            bandwidth reach the policy through the store's `TierCost`s, built from the same
            profile via `StoreConfig(tier_profiles=profile.tier_profiles())`.
        config: `CostPolicyConfig`.
    """

    name = "cost"

    def __init__(self, profile: CostProfile, config: CostPolicyConfig | None = None) -> None:
        self.profile = profile
        self.engine: EngineProfile = profile.engine
        self.config = config or CostPolicyConfig()
        self.reuse = ReuseEstimator(self.config.reuse)
        self._now = 0.0
        self._inflow_total: tuple[float, int] = (0.0, 0)  # (first put time, bytes put since)
        self._shadow: dict[TierName, float] = {}  # tier -> EWMA of removed copies' scores
        self._seen_costs: dict[TierName, TierCost] = {}  # the latest TierCost of each tier
        # (key, tier) -> (last_access, score, tau) of each scored copy: a memo of this policy's
        # own outputs, dropped with the copy (on_remove), so it never outgrows the index.
        self._scores: dict[tuple[RecordKey, TierName], tuple[float, float, float]] = {}
        # key -> chain context of the latest lookup that named it, until its access consumes it
        # (and the key's share of that context's sample: 1 / the chain's keys in that context)
        self._chain: OrderedDict[RecordKey, tuple[int, float]] = OrderedDict()
        self.decisions: Counter[str] = Counter()  # "host admitted", "ssd refused", ...: what explain reports

    # ----- costs ---------------------------------------------------------------------------

    def rebuild_s(self, meta: StateMeta) -> float:
        """Seconds to rebuild the record if no tier held it."""
        e = self.engine
        end = meta.token_end or e.block_tokens
        if meta.retention is Retention.REBUILDABLE:
            return e.ring_rebuild_s(end)
        if meta.kind == StateKind.TOKENS:
            return end * e.prefill_s(end)  # token ids cannot be derived: the client re-sends, we re-prefill
        start = meta.token_start if meta.token_end else 0
        return e.block_rebuild_s(start, end)

    def horizon_s(self, tier: TierCost) -> float:
        """How long a byte would stay in `tier` if every put entered it: budget / put inflow (clamped).

        The inflow is of all puts, not of what the tier admitted: a horizon from admitted
        bytes alone would start infinite for a tier that admitted nothing yet, price its
        marginal value at zero, and so never admit anything (it did, on the trace).
        """
        c = self.config
        first, nbytes = self._inflow_total
        elapsed = max(1.0, self._now - first)  # a burst at one instant: as if it took a second
        if not tier.budget_bytes or nbytes <= 0:
            return c.max_horizon_s
        return min(c.max_horizon_s, max(c.min_horizon_s, tier.budget_bytes / (nbytes / elapsed)))

    def p_reuse(self, meta: StateMeta, horizon_s: float, idle_s: float) -> tuple[float, str]:
        """P(read again within `horizon_s`, after `idle_s` idle) and where the estimate comes from."""
        hints = meta.hints
        if meta.pinned:
            return 1.0, "pinned"
        if hints is not None and hints.ttl_s is not None and idle_s >= hints.ttl_s:
            return 0.0, f"hint: ttl {hints.ttl_s:g} s expired"
        if hints is not None and hints.expected_return_s is not None:
            r = hints.expected_return_s
            remaining = r - idle_s
            conf = self.config.hint_confidence
            if remaining >= 0:
                p = conf * min(1.0, horizon_s / max(remaining, 1e-9))
            else:  # overdue: the longer late, the less likely
                p = conf * math.exp(-(-remaining) / max(r, 60.0))
            return p, f"hint: returns {r:g} s after its last access"
        count, context = self._count_and_context(meta)
        p = self.reuse.p_reuse_within(meta.tenant_id, count, idle_s, horizon_s, context)
        gaps = self.reuse.num_gaps(meta.tenant_id)
        p_next = self.reuse.p_next(meta.tenant_id, count, context)
        return p, (f"learned: {count} access(es), last in {describe_context(context)}, P(next)={p_next:.2f}, "
                   f"{gaps} tenant gaps, mean {self.reuse.mean_gap_s(meta.tenant_id):.3g} s")

    def _count_and_context(self, meta: StateMeta) -> tuple[int, int]:
        """Accesses of the record and the chain context of the latest, counting the access the
        store is recording now (it prices a copy before the hook that reports the access)."""
        count, last, context = self.reuse.latest(meta.key)
        if meta.last_access > last:  # an access the hooks have not reported yet
            count, context = count + 1, self._chain.get(meta.key, _NO_CHAIN)[0]
        return max(1, count), context

    def price(self, meta: StateMeta, tier: TierCost, tiers: Mapping[TierName, TierCost] | None = None,
              *, idle_s: float = 0.0) -> TierValue:
        """Value of holding `meta` in `tier`; `tiers` (all present tiers) finds the fallback copy."""
        self._seen_costs[tier.tier] = tier
        nbytes = meta.resident_bytes(tier.tier) or meta.size_bytes
        load = tier.load_time_s(meta.size_bytes)
        fallback = self.rebuild_s(meta)
        for other in (tiers or self._seen_costs).values():
            if other.tier is not tier.tier and other.tier in meta.tiers and other.healthy:
                fallback = min(fallback, other.load_time_s(meta.size_bytes))
        horizon = self.horizon_s(tier)
        p, _ = self.p_reuse(meta, horizon, idle_s)
        value = p * max(0.0, fallback - load)
        density = value / max(1, nbytes)
        return TierValue(tier.tier, p, horizon, load, fallback, nbytes, value, density,
                         self._score(meta, density, horizon), tier.fill)

    def _tau(self, horizon_s: float) -> float:
        """Seconds of recency an e-fold of value per byte buys: `tau_per_horizon` x the tier's
        turnover time, at most `score_tau_s`. A small tier turns over in seconds, where a value
        difference must not outweigh recency for long; a large one keeps what is worth more for longer."""
        return min(self.config.score_tau_s, max(1.0, self.config.tau_per_horizon * horizon_s))

    def _score(self, meta: StateMeta, density: float, horizon_s: float) -> float:
        if meta.pinned:
            return PINNED_SCORE
        tau = self._tau(horizon_s)
        log_ratio = math.log(density / D_REF) if density > 0 else -_LOG_CLAMP
        score = meta.last_access + tau * max(-_LOG_CLAMP, min(_LOG_CLAMP, log_ratio))
        if meta.hints is not None and meta.hints.ttl_s is not None:
            score = min(score, meta.last_access + meta.hints.ttl_s)
        return score

    # ----- decisions ------------------------------------------------------------------------

    def decide_put(self, meta: StateMeta, tiers: Mapping[TierName, TierCost]) -> PlacementDecision:
        """The durability tier, then host and SSD where a copy pays for itself.

        Tiers are priced fastest first, each by its marginal value: an SSD copy next to a host
        copy only helps if the record is read after the host copy has turned over, i.e. with
        P(reuse within H_ssd) - P(reuse within H_host).
        """
        self._see(meta)
        self._seen_costs.update(tiers)
        required = required_tier(meta.durability, tiers)
        chosen: set[TierName] = {required} if required is not None else set()
        covered = 0.0
        for name in (TierName.HOST, TierName.SSD):
            if name not in tiers:
                continue
            v = self.price(meta, tiers[name], tiers)
            if name in chosen or self._admits(v, tiers[name], meta.size_bytes, covered):
                self.decisions[f"{name.value} {'admitted' if name not in chosen else 'required'}"] += 1
                chosen.add(name)
                covered = max(covered, v.p_reuse)
            else:
                self.decisions[f"{name.value} refused"] += 1
        return frozenset(chosen)

    def decide_promote(self, meta: StateMeta, source: TierName,
                       tiers: Mapping[TierName, TierCost]) -> PlacementDecision:
        self._see(meta)
        host = tiers.get(TierName.HOST)
        if host is None or TIER_ORDER.index(TierName.HOST) >= TIER_ORDER.index(source):
            return frozenset()
        v = self.price(meta, host, tiers)
        if not self._admits(v, host, meta.size_bytes, 0.0):
            self.decisions["host promotion refused"] += 1
            return frozenset()
        self.decisions["host promoted"] += 1
        self._add_inflow(meta)  # a promotion turns the host over like a put does
        return frozenset({TierName.HOST})

    def _admits(self, v: TierValue, tier: TierCost, size_bytes: int, covered: float) -> bool:
        """Admit where the copy's value is positive, pays for an SSD write, and beats the shadow
        price of a full tier (the score of what it has been evicting).

        Below `admit_fill` a copy is priced on its own: the room is free and the faster copy's
        stay is only an estimate (budget / inflow), so a copy that pays for its write goes in.
        In a full tier only its marginal value over the faster copies counts.
        """
        if not tier.healthy:
            return False
        full = tier.fill >= self.config.admit_fill
        marginal = max(0.0, v.p_reuse - (covered if full else 0.0)) * max(0.0, v.fallback_s - v.load_s)
        if marginal <= 0:
            return False
        if tier.tier is TierName.SSD and marginal < self.config.ssd_write_weight * size_bytes / tier.bandwidth_bytes_per_s:
            return False
        if full and tier.tier in self._shadow:
            return v.score >= self._shadow[tier.tier]
        return True

    def eviction_score(self, meta: StateMeta, tier: TierCost) -> float:
        """The time-invariant score; remembered per copy so `decide_eviction` re-ranks cheaply."""
        v = self.price(meta, tier)
        self._scores[meta.key, tier.tier] = (meta.last_access, v.score, self._tau(v.horizon_s))
        return v.score

    def decide_eviction(self, candidates: Sequence[StateMeta], need_bytes: int, tier: TierCost) -> list[RecordKey]:
        """Lowest value per byte now first (idle time included); ties by score, i.e. LRU.

        The store's heap orders by the cached, time-invariant score; that picks the window.
        Within it the policy prices each candidate as of now, which also orders records of
        tenants whose values decay at different rates correctly.
        """
        def now_value(m: StateMeta) -> tuple[float, float]:
            cached = self._scores.get((m.key, tier.tier))
            if cached is None or cached[0] != m.last_access:
                v = self.price(m, tier)
                cached = (m.last_access, v.score, self._tau(v.horizon_s))
            _, score, tau = cached
            # score = t + tau ln(d / D_REF) with d decaying as exp(-idle / tau): the log of the
            # value per byte now, relative to D_REF, is (score - now) / tau.
            return (score - self._now) / tau, score

        return take_until_covered(sorted(candidates, key=now_value), need_bytes, tier.tier)

    # ----- hooks (the learned state) -----------------------------------------------------------

    def on_put(self, meta: StateMeta, tiers: frozenset[TierName]) -> None:
        self._see(meta)
        self.reuse.observe(meta.key, meta.tenant_id, meta.last_access, *self._chain.pop(meta.key, _NO_CHAIN))
        self._add_inflow(meta)

    def _add_inflow(self, meta: StateMeta) -> None:
        first, nbytes = self._inflow_total
        self._inflow_total = (first if nbytes else meta.last_access, nbytes + meta.size_bytes)

    def on_access(self, meta: StateMeta, tier: TierName) -> None:
        self._see(meta)
        self.reuse.observe(meta.key, meta.tenant_id, meta.last_access, *self._chain.pop(meta.key, _NO_CHAIN))

    def on_lookup(self, keys: Sequence[RecordKey]) -> None:
        """Remember where each key sits in the reader's chain: its access prices and learns by it."""
        known_root = bool(keys) and self.reuse.access_count(keys[0]) > 0
        labels = [chain_context(len(keys), i, known_root and i > 0 and self.reuse.access_count(k) == 0)
                  for i, k in enumerate(keys)]
        per_label = Counter(labels)
        for k, label in zip(keys, labels):
            self._chain[k] = (label, 1.0 / per_label[label])
            self._chain.move_to_end(k)
        while len(self._chain) > self.config.reuse.max_keys:
            self._chain.popitem(last=False)

    def on_request_end(self, keys: Sequence[RecordKey], generated_tokens: int) -> None:
        """The request's outcome refines the context of each key's latest access (`ReuseEstimator.refine`)."""
        for k in keys:
            self.reuse.refine(k, generated_tokens)

    def on_remove(self, meta: StateMeta, tier: TierName) -> None:
        """The removed copy's score moves the tier's shadow price (what a new copy must beat)."""
        cached = self._scores.pop((meta.key, tier), None)
        if cached is None:
            return
        score = cached[1]
        old = self._shadow.get(tier)
        a = self.config.shadow_decay
        self._shadow[tier] = score if old is None else (1 - a) * old + a * score

    def _see(self, meta: StateMeta) -> None:
        self._now = max(self._now, meta.last_access)

    # ----- explanations ---------------------------------------------------------------------------

    def explain_dict(self, meta: StateMeta, tiers: Mapping[TierName, TierCost]) -> dict[str, Any]:
        """Why `meta` is where it is: per present tier, P(reuse), load vs fallback, value, fill."""
        idle = max(0.0, self._now - meta.last_access)
        per_tier = {}
        for name, cost in tiers.items():
            v = self.price(meta, cost, tiers, idle_s=idle)
            per_tier[name.value] = {
                "resident": name in meta.tiers, "p_reuse": v.p_reuse, "horizon_s": v.horizon_s,
                "load_s": v.load_s, "fallback_s": v.fallback_s, "bytes": v.bytes, "value_s": v.value_s,
                "value_per_byte": v.density, "score": v.score, "fill": v.fill,
                "shadow_price": self._shadow.get(name),
            }
        _, source = self.p_reuse(meta, self.config.max_horizon_s, idle)
        return {"policy": self.name, "now": self._now, "idle_s": idle, "rebuild_s": self.rebuild_s(meta),
                "retention": meta.retention.name, "reuse_source": source, "tiers": per_tier,
                "summary": self._summary(meta, per_tier, idle, source)}

    def explain(self, meta: StateMeta, tiers: Mapping[TierName, TierCost]) -> str:
        """One paragraph a person can read (`explain_dict(...)["summary"]`)."""
        return str(self.explain_dict(meta, tiers)["summary"])

    def _summary(self, meta: StateMeta, per_tier: Mapping[str, Mapping[str, Any]], idle: float, source: str) -> str:
        where = ", ".join(t.value for t in sorted(meta.tiers, key=TIER_ORDER.index)) or "no tier"
        parts = [f"{meta.retention.name} record of {meta.size_bytes} B in {where}; idle {idle:.3g} s; "
                 f"rebuild {self.rebuild_s(meta) * 1e3:.3g} ms; reuse from {source}."]
        if meta.pinned:
            parts.append("Pinned: never evicted.")
        for name, v in per_tier.items():
            verdict = "held" if v["resident"] else "not held"
            parts.append(f"{name}: {verdict}; P(reuse within {v['horizon_s']:.3g} s)={v['p_reuse']:.3f}, "
                         f"load {v['load_s'] * 1e3:.3g} ms vs without it {v['fallback_s'] * 1e3:.3g} ms, "
                         f"value {v['value_s'] * 1e3:.3g} ms = {v['value_per_byte']:.3g} s/B, fill {v['fill']:.0%}.")
        return " ".join(parts)
