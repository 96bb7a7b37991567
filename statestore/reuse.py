"""How likely a record is to be read again, and when: learned per tenant from observed gaps.

`ReuseEstimator` is the learned half of the cost-aware policy's P(reuse). It sees accesses
only through the policy's hooks (no I/O, no clock: time is the records' own timestamps), and
keeps, per tenant:

- `P(next | n)`: the chance that a record accessed n times is accessed again, from counts of
  records that went on to n + 1 accesses and of those that stayed idle past the resolve
  time (the 95th-percentile gap) after their n-th (n capped at `max_rank`); accesses still
  inside that time are open, not failures, so early estimates are not biased low. Frequency is what LRU ignores: a block read twice is far likelier to be read
  a third time than a block read once is to be read a second time.
- `P(next | n, chain context)`: the same counts split by where the record sat in the key
  chain a reader last looked up (`chain_context`: the chain's length in 16-block buckets, and the
  record's distance from its end). A long chain's inner blocks are a shared document that
  readers come back to; the last block of a chain is the reader's own tail, rarely read
  again. Each context's estimate is shrunk towards the count-only one (`context_weight`
  pseudo-counts), so a context seen rarely says little; one reader's chain counts as one
  sample of each context it spans (its blocks share their fate).
- `P(next | n, chain context, outcome)`: once the reader's request has finished, its context
  also says how many tokens the request generated (`with_outcome`: buckets by factors of 4,
  told by `TieredStore.request_done`). A turn that ends in a short generation (a tool call, a
  question back) is usually followed by another turn that reads the same blocks; a long answer
  usually ends the conversation. On the Mooncake trace, sessions whose first turn generated
  fewer than 10 tokens came back 73% of the time, those with 300 or more 2%.
- the gap distribution: the empirical CDF of the last `max_gaps` inter-access gaps, mixed
  with an exponential tail so that an idle time past every observed gap is unlikely, not
  impossible.

With both, P(reuse within H | n accesses, idle a) = p·(F(a+H) − F(a)) / (p·(1 − F(a)) + 1 − p):
Bayes on "another access is coming" given that none came for `a` seconds. That is what makes
a record's value fall while it sits idle (demotion and eviction over idle time).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ReuseConfig:
    prior_p_next: float = 0.5  # P(another access) before anything is learned
    prior_gap_s: float = 300.0  # mean gap before anything is learned
    prior_weight: float = 2.0  # pseudo-counts the prior is worth
    max_rank: int = 4  # access counts at or above this share one P(next)
    max_gaps: int = 2048  # gap samples kept per tenant
    max_keys: int = 1 << 18  # keys whose access history is remembered (live and removed)
    # Pseudo-counts (in readers' chains, see `observe`) of the count-only P(next) in a
    # context's estimate: a context is told apart after a few chains, which matters in the
    # first minutes of a workload.
    context_weight: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 < self.prior_p_next < 1.0:
            raise ValueError(f"prior_p_next must lie in (0, 1), got {self.prior_p_next}")
        if self.prior_gap_s <= 0 or self.prior_weight <= 0 or self.max_rank < 1 or self.max_gaps < 1:
            raise ValueError("ReuseConfig: prior_gap_s, prior_weight, max_rank and max_gaps must be positive")
        if self.context_weight <= 0 or self.max_keys < 1:
            raise ValueError("ReuseConfig: context_weight and max_keys must be positive")


NO_CONTEXT = -1  # a record no lookup placed in a chain
_LENGTH_STEP = 16  # chain lengths are bucketed in steps of 16 blocks (8K tokens at 512-token blocks) ...
_MAX_LENGTH_BUCKET = 8  # ... and chains of 128 blocks and more share one bucket
_MAX_FROM_END = 3  # 3 or more blocks before the chain's end share one bucket


_EXTENDS = (_MAX_LENGTH_BUCKET + 1) * (_MAX_FROM_END + 1)  # label offset of "new block after a known prefix"
_CHAIN_LABELS = 2 * _EXTENDS  # chain_context labels lie in [0, _CHAIN_LABELS)
# Outcome buckets of generated tokens, by factors of 4: < 16, < 64, < 256, < 1024, more.
_OUTCOME_EDGES = (16, 64, 256, 1024)
_OUTCOME_STRIDE = _CHAIN_LABELS + 1  # (1 + bucket) * stride + chain label (NO_CONTEXT: _CHAIN_LABELS)


def chain_context(length: int, position: int, extends_known: bool = False) -> int:
    """The context label of the record at `position` (0-based) in a looked-up chain of `length`.

    Observed facts of the reader's request, known when it arrives (no future): how long its
    chain is (buckets of 16 blocks up to 128), how far this record sits from the chain's end (0, 1, 2, 3+), and
    whether it is a new block appended to a prefix the store has seen (a conversation's new
    turn, as opposed to a new document).
    """
    if length < 1 or not 0 <= position < length:
        raise ValueError(f"position {position} is not in a chain of {length}")
    length_bucket = min(_MAX_LENGTH_BUCKET, length // _LENGTH_STEP)
    label = length_bucket * (_MAX_FROM_END + 1) + min(_MAX_FROM_END, length - 1 - position)
    return label + _EXTENDS if extends_known else label


def outcome_bucket(generated_tokens: int) -> int:
    """The bucket of a request's generated tokens: 0 for < 16, then one per factor of 4 up to 1024+."""
    if generated_tokens < 0:
        raise ValueError(f"generated_tokens must be >= 0, got {generated_tokens}")
    return bisect.bisect_right(_OUTCOME_EDGES, generated_tokens)


def has_outcome(context: int) -> bool:
    """Whether `context` was refined by `with_outcome`."""
    return context >= _OUTCOME_STRIDE


def with_outcome(context: int, generated_tokens: int) -> int:
    """`context` (a `chain_context` label or NO_CONTEXT) refined by how many tokens the reader's
    request generated. A context that already carries an outcome is returned as it is."""
    if has_outcome(context):
        return context
    chain = _CHAIN_LABELS if context == NO_CONTEXT else context
    return (1 + outcome_bucket(generated_tokens)) * _OUTCOME_STRIDE + chain


def describe_context(context: int) -> str:
    """`chain 32-47, 1 from end` for a label of `chain_context`; `no chain` for NO_CONTEXT; with
    `, the request generated 16-63 tokens` once refined by `with_outcome`."""
    if has_outcome(context):
        bucket, chain = divmod(context, _OUTCOME_STRIDE)
        edges = (0, *_OUTCOME_EDGES)
        b = bucket - 1
        span = f"{edges[b]}+" if b == len(_OUTCOME_EDGES) else f"{edges[b]}-{edges[b + 1] - 1}"
        where = describe_context(NO_CONTEXT if chain == _CHAIN_LABELS else chain)
        return f"{where}, the request generated {span} tokens"
    if context == NO_CONTEXT:
        return "no chain"
    extends, rest = divmod(context, _EXTENDS)
    lb, fe = divmod(rest, _MAX_FROM_END + 1)
    low = lb * _LENGTH_STEP
    span = f"{low}+" if lb == _MAX_LENGTH_BUCKET else f"{max(1, low)}-{low + _LENGTH_STEP - 1}"
    end = "last" if fe == 0 else f"{fe}{'+' if fe == _MAX_FROM_END else ''} from end"
    return f"chain {span}, {end}" + (", new after a known prefix" if extends else "")


@dataclass(slots=True)
class _TenantStats:
    stopped: list[int]  # stopped[n]: records idle past the resolve time after their n-th access
    went_on: list[int]  # went_on[n]: records accessed again after their n-th access
    gaps: deque[float]
    # the same counts per (n, chain context of the n-th access)
    # (weighted: the blocks of one reader's chain in one context share one sample, see `observe`)
    stopped_ctx: dict[tuple[int, int], float] = field(default_factory=dict)
    went_on_ctx: dict[tuple[int, int], float] = field(default_factory=dict)
    sorted_gaps: list[float] = field(default_factory=list)
    gap_sum: float = 0.0
    # (time, key, n, weight) of recent accesses whose outcome (another access or not) is still
    # open: counting them as "not reused" would bias P(next) low early on (right-censoring).
    pending: deque[tuple[float, bytes, int, float]] = field(default_factory=deque)


@dataclass(slots=True)
class _History:
    count: int  # accesses seen, the put included
    last: float  # time of the latest one
    context: int = NO_CONTEXT  # chain context of the latest one
    weight: float = 1.0  # its share of a context sample (1 / its chain's blocks in that context)


class ReuseEstimator:
    """Per-tenant P(next access) by access count, and the inter-access gap distribution."""

    def __init__(self, config: ReuseConfig | None = None) -> None:
        self.config = config or ReuseConfig()
        self._tenants: dict[bytes, _TenantStats] = {}
        self._history: OrderedDict[bytes, _History] = OrderedDict()

    # ----- learning -------------------------------------------------------------------

    def observe(self, key: bytes, tenant: bytes, when: float, context: int = NO_CONTEXT,
                weight: float = 1.0) -> None:
        """An access (a put or a hit) of `key` at `when`: a reuse if the key was seen before.

        `context` is where the access's reader placed the key (`chain_context`), if known;
        `weight` is the access's share of one sample of that context: a reader's chain of k
        blocks in one context gives each 1/k. The blocks of one chain share their fate (a
        document is read again whole or not at all), so they are one observation, not k: a
        single 130-block document must not outweigh the shrinkage towards the count-only
        odds as if 130 readers had been seen.

        Keys are remembered after their records are gone (up to `max_keys`), so a block that
        is rebuilt and put again after an eviction still counts as a reuse. An access whose
        key stays idle for `resolve_s` counts as the last one of that key.
        """
        stats = self._stats(tenant)
        self._resolve(stats, when)
        h = self._history.get(key)
        if h is None:
            h = self._history[key] = _History(0, when)
            if len(self._history) > self.config.max_keys:
                self._history.popitem(last=False)
        else:
            self._history.move_to_end(key)
            rank = self._rank(h.count)
            stats.went_on[rank] += 1
            stats.went_on_ctx[rank, h.context] = stats.went_on_ctx.get((rank, h.context), 0.0) + h.weight
            self._add_gap(stats, max(0.0, when - h.last))
        h.count += 1
        h.last = max(h.last, when)
        h.context = context
        h.weight = weight
        stats.pending.append((when, key, h.count, weight))

    def refine(self, key: bytes, generated_tokens: int) -> bool:
        """The request behind `key`'s latest access finished, having generated `generated_tokens`:
        that access's context gains the outcome (`with_outcome`), so its fate (read again or
        not) is counted there, and its P(next) is read there from now on. False if the key is
        unknown or its latest access already has an outcome (another request's)."""
        h = self._history.get(key)
        if h is None or has_outcome(h.context):
            return False
        h.context = with_outcome(h.context, generated_tokens)
        return True

    def resolve_s(self, tenant: bytes) -> float:
        """Idle time after which an access counts as a key's last: the 95th-percentile gap, at least 60 s."""
        stats = self._tenants.get(tenant)
        return self._resolve_s(stats) if stats else max(60.0, 3 * self.config.prior_gap_s)

    def _resolve(self, stats: _TenantStats, now: float) -> None:
        horizon = now - self._resolve_s(stats)
        while stats.pending and stats.pending[0][0] <= horizon:
            _, key, count, weight = stats.pending.popleft()
            h = self._history.get(key)
            if h is not None and h.count == count:  # its last access: h.context is that access's (refined) context
                rank = self._rank(count)
                stats.stopped[rank] += 1
                stats.stopped_ctx[rank, h.context] = stats.stopped_ctx.get((rank, h.context), 0.0) + weight

    def _resolve_s(self, stats: _TenantStats) -> float:
        if not stats.sorted_gaps:
            return max(60.0, 3 * self.config.prior_gap_s)
        return max(60.0, stats.sorted_gaps[int(0.95 * (len(stats.sorted_gaps) - 1))])

    def _add_gap(self, stats: _TenantStats, gap: float) -> None:
        if len(stats.gaps) == stats.gaps.maxlen:
            old = stats.gaps.popleft()
            stats.gap_sum -= old
            del stats.sorted_gaps[bisect.bisect_left(stats.sorted_gaps, old)]
        stats.gaps.append(gap)
        stats.gap_sum += gap
        bisect.insort(stats.sorted_gaps, gap)

    # ----- estimates --------------------------------------------------------------------

    def access_count(self, key: bytes) -> int:
        """Accesses of `key` seen so far (0 if never seen or forgotten)."""
        h = self._history.get(key)
        return h.count if h else 0

    def latest(self, key: bytes) -> tuple[int, float, int]:
        """(accesses seen, time of the latest, its chain context); (0, -inf, NO_CONTEXT) if unknown."""
        h = self._history.get(key)
        return (h.count, h.last, h.context) if h else (0, -math.inf, NO_CONTEXT)

    def p_next(self, tenant: bytes, count: int, context: int = NO_CONTEXT) -> float:
        """P(a record of `tenant` accessed `count` times, the last in `context`, is accessed again)."""
        c = self.config
        stats = self._tenants.get(tenant)
        n = self._rank(max(1, count))
        went_on = stats.went_on[n] if stats else 0
        stopped = stats.stopped[n] if stats else 0
        base = (went_on + c.prior_p_next * c.prior_weight) / (went_on + stopped + c.prior_weight)
        if stats is None or context == NO_CONTEXT:
            return base
        went_on = stats.went_on_ctx.get((n, context), 0.0)
        stopped = stats.stopped_ctx.get((n, context), 0.0)
        return (went_on + base * c.context_weight) / (went_on + stopped + c.context_weight)

    def context_table(self, tenant: bytes) -> dict[tuple[int, int], tuple[float, float]]:
        """(n, context) -> (P(next), resolved samples, in chains) for every context seen: what explains a ranking."""
        stats = self._tenants.get(tenant)
        if stats is None:
            return {}
        cells = set(stats.went_on_ctx) | set(stats.stopped_ctx)
        return {cell: (self.p_next(tenant, cell[0], cell[1]),
                       stats.went_on_ctx.get(cell, 0) + stats.stopped_ctx.get(cell, 0)) for cell in sorted(cells)}

    def mean_gap_s(self, tenant: bytes) -> float:
        c = self.config
        stats = self._tenants.get(tenant)
        n = len(stats.gaps) if stats else 0
        total = stats.gap_sum if stats else 0.0
        return (total + c.prior_gap_s * c.prior_weight) / (n + c.prior_weight)

    def num_gaps(self, tenant: bytes) -> int:
        stats = self._tenants.get(tenant)
        return len(stats.gaps) if stats else 0

    def gap_cdf(self, tenant: bytes, t: float) -> float:
        """P(gap <= t): empirical, mixed with an exponential tail of weight prior/(n + prior)."""
        if t <= 0:
            return 0.0
        c = self.config
        stats = self._tenants.get(tenant)
        n = len(stats.gaps) if stats else 0
        w_prior = c.prior_weight / (n + c.prior_weight)
        tail_mean = max(self.mean_gap_s(tenant), stats.sorted_gaps[-1] if n else 0.0)
        expo = 1.0 - math.exp(-t / max(tail_mean, 1e-9))
        emp = bisect.bisect_right(stats.sorted_gaps, t) / n if n else 0.0
        return (1.0 - w_prior) * emp + w_prior * expo

    def p_reuse_within(self, tenant: bytes, count: int, idle_s: float, horizon_s: float,
                       context: int = NO_CONTEXT) -> float:
        """P(the next access comes within `horizon_s`, given `count` accesses (the last in
        `context`) and `idle_s` idle)."""
        p = self.p_next(tenant, count, context)
        f_a = self.gap_cdf(tenant, idle_s)
        f_ah = self.gap_cdf(tenant, idle_s + horizon_s)
        denom = p * (1.0 - f_a) + (1.0 - p)
        return max(0.0, min(1.0, p * (f_ah - f_a) / denom)) if denom > 0 else 0.0

    # ----- internals ------------------------------------------------------------------------

    def _rank(self, count: int) -> int:
        return min(count, self.config.max_rank)

    def _stats(self, tenant: bytes) -> _TenantStats:
        stats = self._tenants.get(tenant)
        if stats is None:
            size = self.config.max_rank + 1
            stats = self._tenants[tenant] = _TenantStats([0] * size, [0] * size, deque(maxlen=self.config.max_gaps))
        return stats
