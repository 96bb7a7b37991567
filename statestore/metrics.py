"""Prometheus metrics of one server, in a `CollectorRegistry` the server owns (no globals).

Occupancy, hits, misses, evictions and promotions are read from `TieredStore.stats()` at
scrape time by `_StoreCollector`, so they can never drift from the store's own counters;
what only the service sees (bytes moved over the wire, replay tokens, resume latency, calls
by method and status code and how long each took) is counted here as the calls happen, and the
event loop's lag is sampled while the server runs (`sample_loop_lag`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine_adapter.base import StateKind
from statestore.sessions import MANIFEST_KIND
from statestore.types import TierName, TierStats

RESUME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# A Lookup takes ~0.1-0.5 ms, a 32 MiB PutRecords tens of ms, a resume seconds.
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
               5.0, 10.0, 30.0)
# How late the event loop ran a timer: every handler's Python runs on that one loop, so a lag of
# milliseconds is every call waiting that long (a saturated sidecar, or a step that blocks it).
LOOP_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LOOP_LAG_INTERVAL_S = 0.1


def kind_name(kind: int) -> str:
    """Human name of a record kind code (model kinds, the session manifest, or the number)."""
    if kind == MANIFEST_KIND:
        return "MANIFEST"
    try:
        return StateKind(kind).name
    except ValueError:
        return f"KIND_{kind}"


class _StoreCollector(Collector):
    """Per tier and kind: occupancy and the store's hit/miss/eviction counters, at scrape time."""

    def __init__(self, stats: Callable[[], dict[TierName, TierStats]]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []  # families are known only at scrape time (tiers and kinds present)

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        budget = GaugeMetricFamily("statestore_tier_budget_bytes", "Tier byte budget (0 = unbounded)", labels=["tier"])
        resident = GaugeMetricFamily("statestore_tier_resident_bytes", "Bytes resident per tier and kind",
                                     labels=["tier", "kind"])
        records = GaugeMetricFamily("statestore_tier_records", "Records per tier and kind", labels=["tier", "kind"])
        healthy = GaugeMetricFamily("statestore_tier_healthy", "1 when the tier serves", labels=["tier"])
        reserve = GaugeMetricFamily("statestore_tier_reserve_bytes",
                                    "Bytes held for reuse beyond the records (recycled SSD files)", labels=["tier"])
        counters = {name: CounterMetricFamily(f"statestore_{name}", f"Store {name} per tier and kind",
                                              labels=["tier", "kind"])
                    for name in ("hits", "misses", "evictions", "promotions")}
        for tier, ts in stats.items():
            budget.add_metric([tier.value], ts.budget_bytes)
            healthy.add_metric([tier.value], 1.0 if ts.healthy else 0.0)
            reserve.add_metric([tier.value], ts.reserve_bytes)
            for kind, ks in ts.by_kind.items():
                labels = [tier.value, kind_name(kind)]
                resident.add_metric(labels, ks.resident_bytes)
                records.add_metric(labels, ks.num_records)
                for name, family in counters.items():
                    family.add_metric(labels, getattr(ks, name))
        yield from (budget, resident, records, healthy, reserve, *counters.values())


class ServiceMetrics:
    """The server's metrics and, optionally, its `/metrics` HTTP endpoint."""

    def __init__(self, stats: Callable[[], dict[TierName, TierStats]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StoreCollector(stats))
        self.calls = Counter("statestore_rpc_calls", "RPCs by method and status code", ["method", "code"],
                             registry=self.registry)
        self.bytes_moved = Counter("statestore_bytes_moved", "Record bytes over the wire", ["direction"],
                                   registry=self.registry)
        self.replay_tokens = Counter("statestore_replay_tokens", "Tokens replayed by resumes", ["mode"],
                                     registry=self.registry)
        self.resume_seconds = Histogram("statestore_resume_seconds", "Session resume latency (load + replay)",
                                        ["mode"], buckets=RESUME_BUCKETS, registry=self.registry)
        self.rpc_seconds = Histogram("statestore_rpc_seconds", "RPC handling time by method, from the handler's "
                                     "start to its last response (any status code)", ["method"],
                                     buckets=RPC_BUCKETS, registry=self.registry)
        self.loop_lag_seconds = Histogram("statestore_event_loop_lag_seconds", "How late the server's event "
                                          "loop ran a timer (sampled every LOOP_LAG_INTERVAL_S)",
                                          buckets=LOOP_LAG_BUCKETS, registry=self.registry)
        self._rpc_children: dict[str, Any] = {}
        self._http: Any = None
        self._thread: threading.Thread | None = None

    def took(self, method: str, seconds: float) -> None:
        """One call of `method` took `seconds` (children cached: `labels` costs a lock and a lookup)."""
        child = self._rpc_children.get(method)
        if child is None:
            child = self._rpc_children[method] = self.rpc_seconds.labels(method)
        child.observe(seconds)

    async def sample_loop_lag(self, interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
        """Until cancelled: sleep `interval_s` on the running loop and record how much later than
        asked it woke (the selector rounds a timeout up to the millisecond: lags under ~1 ms are
        that rounding)."""
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + interval_s
            await asyncio.sleep(interval_s)
            self.loop_lag_seconds.observe(max(0.0, loop.time() - asked))

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start the `/metrics` endpoint (its own thread); returns the bound port."""
        result = start_http_server(port, addr=addr, registry=self.registry)
        if isinstance(result, tuple):  # prometheus_client >= 0.17 returns (server, thread)
            self._http, self._thread = result
            return int(self._http.server_port)
        return port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
