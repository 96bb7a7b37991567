"""The service in one object (`StateStoreServer`): it opens the store and the engine, serves
`statestore.v1.StateStore` (`statestore.store_service`) and `statestore.v1.Sessions`
(`statestore.sessions_service`) with health and reflection on one gRPC server, exports metrics,
and stops gracefully (in-flight calls, checkpoints among them, finish within the grace period).
`serve` runs it until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.statestore.v1 import sessions_pb2
from statestore import sessions as ss
from statestore.allocator import keep_large_buffers_in_heap
from statestore.auth import TokenAuth
from statestore.collector import collector_paused
from statestore.config import ServiceConfig
from statestore.metrics import ServiceMetrics
from statestore.quotas import TenantQuotas
from statestore.rpc import Calls, add_servicer
from statestore.sessions_service import SessionsServicer
from statestore.shm import ShmAttachments
from statestore.store import StoreConfig, TieredStore, make_page_sizes
from statestore.store_service import StateStoreServicer, add_statestore_servicer
from statestore.types import Durability, OpenReport

logger = logging.getLogger(__name__)

SERVICE_NAMES = ("statestore.v1.StateStore", "statestore.v1.Sessions")
TIER_PROBE_S = 1.0  # how often tiers that are down are probed (each tier paces its own retries too)


def load_secret(path: Path) -> bytes:
    """The service secret (tenant key salts derive from it), created once per data dir (0600).

    It must survive restarts: block keys and session manifests are found again only with it.
    """
    try:
        secret = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        secret = path.read_bytes()
    if not 16 <= len(secret) <= 64:
        raise ValueError(f"service secret {path} must hold 16..64 bytes, has {len(secret)}")
    return secret


def build_adapter(preset: str, seed: int) -> Any:
    """The bundled CED engine behind its adapter (torch: call off the event loop)."""
    from engine_adapter.ced import CEDEngine, get_preset
    from engine_adapter.ced.adapter import CEDAdapter

    return CEDAdapter(CEDEngine(get_preset(preset), seed=seed))


class StateStoreServer:
    """The service in one object: store, sessions, engine, gRPC server, health, metrics.

    `await start()` opens the tiers, builds the engine, binds (`port` tells where) and marks
    health SERVING; `await stop(grace)` marks NOT_SERVING, lets in-flight calls (checkpoints)
    finish within `grace` seconds, then closes the sessions and the tiers.
    """

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.port = 0
        self.started_at = time.monotonic()
        self.models: set[bytes] = set()
        self.store: TieredStore
        self.ssd: Any = None  # the SSD tier, whose aligned buffers stage large records (`Stager`)
        self.host: Any = None  # the host tier, which takes a stream's MEMORY records as they are verified (`Stager`)
        self.sessions: ss.SessionManager
        self.adapter: Any = None
        self.metrics = ServiceMetrics(lambda: self.store.stats())
        self.calls = Calls(TokenAuth(config.tokens), self.metrics)
        self.quotas = TenantQuotas.from_config(config)
        self.metrics_port = 0
        self.open_report = OpenReport({}, {})  # what the start-up scans indexed and discarded
        self._server: grpc.aio.Server | None = None
        self.shm = ShmAttachments()  # clients' shared-memory regions (statestore/shm.py)
        self._health = health.aio.HealthServicer()
        self._stopped = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []  # housekeeping, the loop-lag sampler

    def live_sessions(self) -> int:
        return len(getattr(self.sessions, "_live", {}))

    async def _open_store(self) -> TieredStore:
        from tiers.host import HostTier
        from tiers.ssd import SSDTier

        c = self.config
        specs = self.adapter.state_specs()
        retention = {int(s.kind): s.retention for s in specs}
        policy, store_config = None, StoreConfig(retention_by_kind=retention, cache_kinds=c.cache_kind_codes)
        if c.policy == "cost":  # before any tier opens: a missing profile leaves nothing locked
            from statestore.cost_policy import CostAwarePolicy
            from statestore.profile import CostProfile

            profile = await asyncio.to_thread(CostProfile.load, c.profile)
            policy = CostAwarePolicy(profile)  # its measured tier costs price loads for the store too
            store_config = StoreConfig(retention_by_kind=retention, tier_profiles=profile.tier_profiles(),
                                       cache_kinds=c.cache_kind_codes)
        host = HostTier(c.host_budget_bytes, make_page_sizes(specs, c.block_size))
        ssd = await SSDTier.create(c.ssd_dir, budget_bytes=c.ssd_budget_bytes,
                                   recycle_bytes=None if c.ssd_recycle_bytes < 0 else c.ssd_recycle_bytes,
                                   loop_reads=c.ssd_loop_reads, read_poll_s=c.ssd_read_poll_us / 1e6,
                                   index_snapshot=c.ssd_index_snapshot)
        redis = None
        if c.redis_url:
            from tiers.redis import RedisTier

            redis = RedisTier(c.redis_url, prefix=c.redis_prefix, bulk_reads=c.redis_bulk_reads)
        store = TieredStore(host=host, ssd=ssd, redis=redis, policy=policy, config=store_config)
        self.ssd, self.host = ssd, host
        self.open_report = report = await store.open()  # the SSD's open-time scan, not a second walk
        for tier, reasons in report.discarded.items():
            for reason in reasons:
                logger.warning("%s scan discarded %s", tier.value, reason)
        return store

    async def start(self) -> int:
        """Open everything and bind; on any failure, close what was opened (the SSD lock included)."""
        c = self.config
        keep_large_buffers_in_heap()  # see statestore/allocator.py: record buffers without page faults
        secret = await asyncio.to_thread(load_secret, c.secret_path)
        self.adapter = await asyncio.to_thread(build_adapter, c.engine_preset, c.engine_seed)
        self.models.add(self.adapter.model_fingerprint)
        with collector_paused():  # the index of every record held is built: nothing of it is garbage
            self.store = await self._open_store()
        self.sessions = ss.SessionManager(self.quotas.guard(self.store), self.adapter, ss.SessionConfig(
            secret=secret, block_size=c.block_size, durability=Durability[c.durability.upper()],
            default_mode=c.default_mode, keep_rings_ttl_s=c.keep_rings_ttl_s or None))
        server = self._build_grpc_server()
        try:
            self.port = self._bind(server)
            await server.start()
            self._server = server
            self.started_at = time.monotonic()
            for name in ("", *SERVICE_NAMES):
                await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
            if c.metrics_port:
                self.metrics_port = self.metrics.serve_http(c.metrics_port, c.metrics_addr)
            self._background = [asyncio.create_task(self._housekeeping(), name="statestore-housekeeping"),
                                asyncio.create_task(self.metrics.sample_loop_lag(), name="statestore-loop-lag")]
        except BaseException:
            self._server = None
            await server.stop(0)
            await self._close_layers()
            raise
        logger.info("statestore serving on %s (port %d), engine %s", c.listen, self.port, self.adapter.model_name)
        return self.port

    def _build_grpc_server(self) -> grpc.aio.Server:
        c = self.config
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", c.max_message_bytes),
                                          ("grpc.max_send_message_length", c.max_message_bytes),
                                          ("grpc.so_reuseport", 0)])
        add_statestore_servicer(StateStoreServicer(self), server)
        add_servicer(SessionsServicer(self), server, sessions_pb2.DESCRIPTOR.services_by_name["Sessions"])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        return server

    def _bind(self, server: grpc.aio.Server) -> int:
        c = self.config
        try:
            if c.tls_cert is not None and c.tls_key is not None:
                creds = grpc.ssl_server_credentials([(c.tls_key.read_bytes(), c.tls_cert.read_bytes())])
                port = server.add_secure_port(c.listen, creds)
            else:
                port = server.add_insecure_port(c.listen)
        except RuntimeError as exc:  # grpc raises when the address is taken or unusable
            raise OSError(f"cannot bind {c.listen}: {exc}") from None
        if not port:
            raise OSError(f"cannot bind {c.listen}")
        return port

    async def _housekeeping(self) -> None:
        """Once per `TIER_PROBE_S`: probe the tiers that are down (a Redis that came back is
        healthy again within a probe and its retry pacing, whether or not traffic reaches for
        it), and drop the shared-memory regions of clients that are gone (`ShmAttachments`),
        whose pages the server's mapping would otherwise keep until another client attaches."""
        while True:
            await asyncio.sleep(TIER_PROBE_S)
            try:
                for name, healthy in (await self.store.probe_unhealthy()).items():
                    logger.debug("tier %s probed: %s", name.value, "healthy" if healthy else "still down")
            except Exception:  # noqa: BLE001 - a background loop: a failed probe must not end the probing
                logger.warning("probing the tiers that are down failed; trying again", exc_info=True)
            if dropped := self.shm.drop_stale():
                logger.debug("dropped %d shared-memory region(s) of clients that are gone", dropped)

    async def _close_layers(self) -> None:
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._background = []
        await self.sessions.aclose()
        await self.store.aclose()
        self.metrics.close()
        self.shm.close()

    async def stop(self, grace: float | None = None) -> None:
        """Idempotent graceful stop: health NOT_SERVING, in-flight calls get `grace` seconds."""
        if self._server is None:
            return
        server, self._server = self._server, None
        await self._health.enter_graceful_shutdown()
        await server.stop(self.config.grace_s if grace is None else grace)
        await self._close_layers()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> StateStoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(0)


async def serve(config: ServiceConfig, ready: Callable[[StateStoreServer], None] | None = None) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully (health NOT_SERVING, in-flight calls finish)."""
    server = StateStoreServer(config)
    await server.start()
    if ready is not None:
        ready(server)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await server.stop()
