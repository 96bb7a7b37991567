"""LMCache as the baseline (issue 9): the same chunks through LMCache 0.5.6's own tiers and
through statestore behind LMCache (our plugin), in one run.

    .venv-lmcache/bin/python -m bench.lmcache_compare [--quick] [--chunks N] [--rounds R] [--models a,b]
    (make test-lmcache builds .venv-lmcache; Redis must answer on 127.0.0.1:6379)

Payloads: random bf16 LMCache chunks of 256 tokens, in LMCache's layout:
- `conventional`: `[2, 32 layers, 256, 8 heads x 128]` = 32 MiB (a Llama-8B-class GQA model);
- `v41-like`: MLA `[1, 61 layers, 256, 576]` = 17.2 MiB (DeepSeek-V3/V4-class latent KV as
  LMCache holds it under vLLM, 70,272 B/token; statestore's own V4.1 records keep 890 B/token).

Paths (each: one warm-up chunk put and got outside the figures (`first_put_ms`/`first_get_ms`:
memory a process touches first costs ~3 ms/MiB on the development VM, `Timings.measure`); then
put every chunk, one at a time, waiting for it to be stored; then get each. Then, except for the
full caches, every chunk as one request, as LMCache's engine moves a request's chunks
(`req_put_GBps`, `req_get_GBps`, `Timings.measure_request`): one `batched_submit_put_task` of
them all, until the backend reported each written, then one `StorageManager.batched_get`; after
a warm-up request of the same size):
- `lmcache-cpu`: LocalCPUBackend (keeps references: no copy, nothing durable);
- `lmcache-disk`, `lmcache-disk-odirect`: LocalDiskBackend (files without fsync; index in memory);
- `lmcache-redis`: LMCache's `redis://` connector (`remote_url`) on the local Redis. It writes two
  keys per chunk and hangs in `close()` in 0.5.6, so it runs in a child process that exits
  without closing (killed after a timeout);
- `statestore-host` / `-ssd` / `-redis`: LMCache's RemoteBackend with our plugin
  (`statestore.integrations.lmcache`) against `statestore serve` in a child process, at durability
  memory (host tier), local (SSD tier: fdatasync before the ack) and shared (Redis tier, the same
  Redis). For the SSD and Redis paths the server's host tier is smaller than one chunk, so the
  bytes go to the tier measured and gets read from it; the plugin moves them through same-host
  shared memory (statestore/shm.py);
- `statestore-ssd-grpc`: the SSD path with the plugin's shared memory off (gRPC frames: what a
  client on another host gets);
- the StorageManagers with our plugin keep LMCache's CPU buffer in /dev/shm (`shm_name`, one
  name per manager), as the plugin's documented config does: the plugin lends that buffer to
  the server, so chunks are not copied in the plugin (statestore/shm.py, "Lent memory").
  LMCache's own paths keep its default private buffer: its O_DIRECT reads into /dev/shm pages
  took ~2x as long on the development VM (4 KiB shmem pages split each request);
- `ref: ssd-tier-alone`: statestore's SSD tier in the bench process, the same bytes as records
  (no LMCache, plugin, RPC or shared memory): the ceiling of the SSD path on this machine;
- `ref: odirect+fdatasync`: plain file I/O of the same bytes, a new file per chunk written with
  O_DIRECT from an aligned buffer and fdatasynced (O_DIRECT reads back): the least any durable
  put costs on this disk. LMCache's O_DIRECT backend is this without the flush, so the ratios
  against it (`durable_put_ratios_by_round`, printed) split the SSD put floor's gap into what
  statestore adds and what durability adds;
- `lmcache-disk-odirect-full` / `statestore-ssd-full`: the two as full caches, the steady state
  of a cache in service. Each budget holds the warm-up and measured chunks and is filled with as
  many other chunks first (untimed), so every timed put evicts one: LMCache removes the file of
  its least recently used chunk inside the put and writes a new one; statestore (SSD budget,
  `storage.cache_kinds = ["opaque"]`) evicts its least recently used chunk, whose file is
  recycled for the new one (`tiers.ssd`). `fillers_left` counts the fill chunks still held
  (both should have evicted all). Their ratios are printed and kept in the params, not floors.

`restart_found` counts the chunks found again after a restart: a new LMCache StorageManager on the
same disk directory (or the same Redis), or a statestore server killed with SIGKILL and started on
the same data directory (SSD and Redis paths). `durable` says what a put waited for before it was
acknowledged (this machine's Redis keeps nothing on disk: "redis SET" survives restarts of
LMCache and statestore, not of Redis). Reads of files (LMCache's disk without O_DIRECT,
statestore's SSD tier) come from the page cache right after the write, for both. Figures on
the shared 2-core CPU are relative only.

Rounds (`--rounds`, default 2): every path runs once per round, LMCache's side first in even
rounds and ours first in odd ones. The machine is shared, its disk's speed swings up to 3x
within an hour and the local Redis keeps the memory state the previous path left, so one pass
in a fixed order measured order and drift as much as the paths (a floor pair swung from 0.66 to
1.4 between two runs). Each row carries its `round`; the `median` rows give each figure's
median over the rounds, and a floor is the median of the rounds' ratios (`ratios_by_round` in
the results' params).

Floors (issue 9): statestore's SSD path >= LMCache's local disk with O_DIRECT, put and get;
statestore over Redis >= LMCache's `redis://`, put and get; per chunk, as the issue's p50/p99
are. The request figures' ratios are printed and kept in the params (`request_ratios_by_round`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import Floor, print_floors, print_table, wait_until, write_results
from statestore.spawn import spawn_serve

ROOT = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 256
MODELS: dict[str, dict[str, Any]] = {
    "conventional": {"layers": 32, "heads": 8, "head_dim": 128, "use_mla": False},
    "v41-like": {"layers": 61, "heads": 1, "head_dim": 576, "use_mla": True},
}
PLUGIN = "statestore"
REDIS_URL = "redis://127.0.0.1:6379"
CHILD_TIMEOUT_S = 600


_SHM_NAMES = itertools.count()  # LMCache's CPU buffer in /dev/shm, one name per StorageManager


class Server:
    """`statestore serve` in a child process (a sidecar, as deployed), on a loopback port."""

    def __init__(self, data_dir: Path, *, host_budget_bytes: int, redis_prefix: str = "", port: int = 0,
                 settings: dict[str, str] | None = None) -> None:
        self.data_dir, self.port = data_dir, port
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    "STATESTORE_STORAGE_HOST_BUDGET_BYTES": str(host_budget_bytes),
                    "STATESTORE_SERVER_MAX_STREAM_BYTES": str(1 << 30), **(settings or {})}
        if redis_prefix:
            self.env.update(STATESTORE_STORAGE_REDIS_URL=REDIS_URL, STATESTORE_STORAGE_REDIS_PREFIX=redis_prefix)
        self.start()

    def start(self) -> None:
        self.proc, self.port = spawn_serve(self.data_dir, port=self.port, env=self.env, cwd=ROOT)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)


def make_manager(model: dict[str, Any], cpu_bytes: int, *, disk_dir: Path | None = None, odirect: bool = False,
                 target: str = "", durability: str = "local", shm_bytes: int = 256 << 20,
                 redis: bool = False, disk_bytes: int = 0) -> Any:
    """LMCache's StorageManager from a config dict, as a user's YAML gives it."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    doc: dict[str, Any] = {"chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": cpu_bytes / 1e9,
                           "remote_serde": "naive", "blocking_timeout_secs": 120, "extra_config": {}}
    if disk_dir is not None:
        # LMCache reads max_local_disk_size in GiB (x 1024**3); disk_bytes = 0: as large as the RAM tier
        doc.update(local_disk=f"file://{disk_dir}/", max_local_disk_size=(disk_bytes / 2**30) if disk_bytes
                   else cpu_bytes / 1e9)
        doc["extra_config"]["use_odirect"] = odirect
    if redis:
        doc["remote_url"] = REDIS_URL
    if target:  # our plugin's documented config: LMCache's buffer in /dev/shm, lent to the server
        doc["extra_config"]["shm_name"] = f"statestore-bench-{os.getpid()}-{next(_SHM_NAMES)}"
        p = f"remote_storage_plugin.{PLUGIN}."
        doc["remote_storage_plugins"] = [PLUGIN]
        doc["extra_config"].update({p + "module_path": "statestore.integrations.lmcache",
                                    p + "class_name": "StateStoreConnector", p + "target": target,
                                    p + "namespace": f"bench-{durability}", p + "durability": durability,
                                    p + "timeout_s": 120.0, p + "lookup_timeout_s": 10.0, p + "shm_bytes": shm_bytes})
    metadata = LMCacheMetadata(
        model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, use_mla=model["use_mla"],
        kv_shape=(model["layers"], 1 if model["use_mla"] else 2, CHUNK_TOKENS, model["heads"], model["head_dim"]))
    return StorageManager(LMCacheEngineConfig.from_dict(doc), metadata, EventManager())


def chunk_shape(model: dict[str, Any]) -> torch.Size:
    return torch.Size([1 if model["use_mla"] else 2, model["layers"], CHUNK_TOKENS, model["heads"] * model["head_dim"]])


def make_payloads(model: dict[str, Any], num_chunks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(chunk_shape(model), generator=gen).to(torch.bfloat16) for _ in range(num_chunks)]


def make_keys(num_chunks: int, salt: int) -> list[Any]:
    from lmcache.utils import CacheEngineKey

    return [CacheEngineKey("bench", 1, 0, (salt << 32) + i, torch.bfloat16) for i in range(num_chunks)]


def fill(manager: Any, model: dict[str, Any], payload: torch.Tensor) -> Any:
    from lmcache.v1.memory_management import MemoryFormat

    obj = manager.allocate(chunk_shape(model), torch.bfloat16,
                           fmt=MemoryFormat.KV_MLA_FMT if model["use_mla"] else MemoryFormat.KV_2LTD)
    assert obj is not None, "LMCache's CPU buffer is full"
    obj.tensor.copy_(payload)
    return obj


class Timings:
    """Per-chunk put and get seconds of one path."""

    def __init__(self) -> None:
        self.put_s: list[float] = []
        self.get_s: list[float] = []
        self.first_s: tuple[float, float] = (0.0, 0.0)  # the untimed warm-up chunk's put and get
        self.request_s: tuple[float, float] | None = None  # every chunk as one request: batched put, batched get
        self.exact = True  # every chunk a get returned was the one put
        self.misses = 0  # gets that returned nothing (reported apart from wrong bytes)

    def measure(self, keys: list[Any], payloads: Sequence[torch.Tensor], put: Callable[[Any, torch.Tensor], float],
                get: Callable[[Any, torch.Tensor], float], between: Callable[[list[Any]], None] | None = None, *,
                warm_up_key: Any) -> tuple[Timings, list[Any]]:
        """One chunk put and got first, outside the figures (`first_s`), then every chunk put, then
        every chunk got. Why the warm-up: on the development VM memory a process touches for the
        first time costs ~3 ms per MiB (the hypervisor backs fresh guest pages on first touch), so
        a path's first chunk measured its buffers' page faults (~100-300 ms) more than its I/O;
        the same for every path. The figures are a path's steady state, as a long-running cache
        serves; the first chunk's times are reported beside them."""
        self.first_s = (put(warm_up_key, payloads[0]), 0.0)
        if between is not None:
            between([warm_up_key])
        self.first_s = (self.first_s[0], get(warm_up_key, payloads[0]))
        self.put_s = [put(key, payload) for key, payload in zip(keys, payloads)]
        if between is not None:
            between(keys)
        self.get_s = [get(key, payload) for key, payload in zip(keys, payloads)]
        return self, keys

    def measure_request(self, manager: Any, model: dict[str, Any], location: str, payloads: Sequence[torch.Tensor],
                        salt: int, *, release: bool, between: Callable[[list[Any]], None] | None = None) -> None:
        """Every chunk as one request, as LMCache's engine moves a request's chunks: one batched put
        (`batched_submit_put_task`, the store path's call), waited for until the backend reported
        each chunk written, then one `StorageManager.batched_get` (the retrieve path's call). Twice,
        on other keys each time; the first is a warm-up outside the figures, as in `measure`: its
        chunks are the first to use that much of LMCache's buffer at once, and on the development
        VM memory touched first costs ~3 ms per MiB."""
        for i in range(2):
            keys = make_keys(len(payloads), salt + i)
            put_s = put_request(manager, model, location, keys, payloads, release=release)
            if between is not None:
                between(keys)
            t0 = time.perf_counter()
            objs = manager.batched_get(keys, location=location)
            get_s = time.perf_counter() - t0
            for obj, payload in zip(objs, payloads):
                self.check(obj, payload)
            self.request_s = (put_s, get_s)

    def check(self, obj: Any, payload: torch.Tensor) -> None:
        if obj is None:
            self.misses += 1
            return
        self.exact = self.exact and torch.equal(obj.tensor, payload)
        if obj is not None:
            obj.ref_count_down()

    def row(self, model: str, path: str, chunk_bytes: int, **extra: Any) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            return sorted(xs)[min(len(xs) - 1, round(q * (len(xs) - 1)))] * 1e3

        return {"model": model, "path": path, "chunks": len(self.put_s), "chunk_MiB": round(chunk_bytes / 2**20, 2),
                "put_GBps": chunk_bytes * len(self.put_s) / sum(self.put_s) / 1e9,
                "get_GBps": chunk_bytes * len(self.get_s) / sum(self.get_s) / 1e9,
                "put_p50_ms": statistics.median(self.put_s) * 1e3, "put_p99_ms": pct(self.put_s, 0.99),
                "get_p50_ms": statistics.median(self.get_s) * 1e3, "get_p99_ms": pct(self.get_s, 0.99),
                "first_put_ms": self.first_s[0] * 1e3, "first_get_ms": self.first_s[1] * 1e3,
                **({} if self.request_s is None else {
                    "req_put_GBps": chunk_bytes * len(self.put_s) / self.request_s[0] / 1e9,
                    "req_get_GBps": chunk_bytes * len(self.get_s) / self.request_s[1] / 1e9}),
                "bit_exact": self.exact, "misses": self.misses, **extra}


def put_local(manager: Any, model: dict[str, Any], location: str, key: Any, payload: torch.Tensor) -> float:
    """One chunk into LMCache's own backend at `location`, until it holds it; seconds taken."""
    backend = manager.storage_backends[location]
    obj = fill(manager, model, payload)
    t0 = time.perf_counter()
    manager.batched_put([key], [obj], location=location)
    wait_until(lambda: backend.contains(key), "a put did not complete", timeout_s=300.0, poll_s=0.0005)
    return time.perf_counter() - t0  # the backend took our reference (CPU: keeps the object)


def put_remote(manager: Any, model: dict[str, Any], location: str, key: Any, payload: torch.Tensor) -> float:
    """One chunk through a RemoteBackend, waiting for its future; seconds taken."""
    obj = fill(manager, model, payload)
    t0 = time.perf_counter()
    manager.storage_backends[location].submit_put_task(key, obj).result(300)
    took = time.perf_counter() - t0
    obj.ref_count_down()
    return took


def put_request(manager: Any, model: dict[str, Any], location: str, keys: list[Any], payloads: Sequence[torch.Tensor],
                *, release: bool) -> float:
    """All chunks through the backend's `batched_submit_put_task` at once, until its completion
    callback has fired for each (a backend calls it once a chunk is written); seconds taken.
    `release`: drop our references afterwards (a RemoteBackend holds its own while it writes;
    a local backend took ours, as in `put_local`)."""
    backend = manager.storage_backends[location]
    objs = [fill(manager, model, p) for p in payloads]
    written = threading.Semaphore(0)
    t0 = time.perf_counter()
    backend.batched_submit_put_task(keys, objs, on_complete_callback=lambda _key: written.release())
    for _ in keys:
        if not written.acquire(timeout=300):
            raise TimeoutError(f"{location}: a batched put did not complete")
    took = time.perf_counter() - t0
    if release:
        for obj in objs:
            obj.ref_count_down()
    return took


def run_local(manager: Any, model: dict[str, Any], payloads: Sequence[torch.Tensor], location: str,
              salt: int, *, request: bool = True) -> tuple[Timings, list[Any]]:
    """LMCache's own LocalCPUBackend or LocalDiskBackend: put (until contained), then get; then
    (`request`) the chunks as one request (`Timings.measure_request`)."""
    t = Timings()

    def put(key: Any, payload: torch.Tensor) -> float:
        return put_local(manager, model, location, key, payload)

    def get(key: Any, payload: torch.Tensor) -> float:
        t0 = time.perf_counter()
        obj = manager.get(key, location=location)
        took = time.perf_counter() - t0
        t.check(obj, payload)
        return took

    _, keys = t.measure(make_keys(len(payloads), salt), payloads, put, get, warm_up_key=make_keys(1, salt + 1000)[0])
    if request:
        t.measure_request(manager, model, location, payloads, salt + 2000, release=False)
    return t, keys


def run_remote(manager: Any, model: dict[str, Any], payloads: Sequence[torch.Tensor], location: str, salt: int,
               before_get: Callable[[list[Any]], None] | None = None, *,
               request: bool = True) -> tuple[Timings, list[Any]]:
    """A RemoteBackend (our plugin or LMCache's redis://): each put waits for its future; then
    (`request`) the chunks as one request (`Timings.measure_request`)."""
    remote = manager.storage_backends[location]
    t = Timings()

    def put(key: Any, payload: torch.Tensor) -> float:
        return put_remote(manager, model, location, key, payload)

    def get(key: Any, payload: torch.Tensor) -> float:
        t0 = time.perf_counter()
        obj = remote.get_blocking(key)
        took = time.perf_counter() - t0
        t.check(obj, payload)
        return took

    def between(keys: list[Any]) -> None:
        assert remote.batched_contains(keys) == len(keys), f"{location}: not every put was stored"
        if before_get is not None:
            before_get(keys)

    _, keys = t.measure(make_keys(len(payloads), salt), payloads, put, get, between,
                        warm_up_key=make_keys(1, salt + 1000)[0])
    if request:
        t.measure_request(manager, model, location, payloads, salt + 2000, release=True, between=between)
    return t, keys


def cpu_bytes_for(model: dict[str, Any], num_chunks: int) -> int:
    """LMCache's CPU buffer: room for every chunk four times over (it keeps what it reads back
    from another tier: the per-chunk gets and a request's gets, beside a request's puts)."""
    return 4 * num_chunks * chunk_shape(model).numel() * 2 + (256 << 20)


def run_lmcache_paths(name: str, num_chunks: int, work: Path) -> list[dict[str, Any]]:
    model, payloads = MODELS[name], make_payloads(MODELS[name], num_chunks)
    chunk_bytes = payloads[0].numel() * 2
    rows = []
    for odirect in (False, True):
        disk = work / f"lmcache-disk-{name}-{int(odirect)}"
        manager = make_manager(model, cpu_bytes_for(model, num_chunks), disk_dir=disk, odirect=odirect)
        try:
            if not odirect:
                t, _ = run_local(manager, model, payloads, "LocalCPUBackend", 1)
                rows.append(t.row(name, "lmcache-cpu", chunk_bytes, durable="no", restart_found=0))
            t, keys = run_local(manager, model, payloads, "LocalDiskBackend", 2)
        finally:
            manager.close()
        again = make_manager(model, cpu_bytes_for(model, 1), disk_dir=disk, odirect=odirect)
        try:  # a restart: a new StorageManager on the same directory
            found = again.storage_backends["LocalDiskBackend"].batched_contains(keys)
        finally:
            again.close()
        rows.append(t.row(name, "lmcache-disk-odirect" if odirect else "lmcache-disk", chunk_bytes,
                          durable="no (no fsync)", restart_found=found))
        shutil.rmtree(disk, ignore_errors=True)
    return rows


def run_lmcache_full(name: str, num_chunks: int, work: Path) -> dict[str, Any]:
    """LMCache's O_DIRECT disk backend as a full cache: its budget holds the warm-up and measured
    chunks, and it is filled with as many others first (untimed), so that every timed put evicts
    one (LMCache removes its file inside the put call, then writes a new one)."""
    model, payloads = MODELS[name], make_payloads(MODELS[name], num_chunks)
    chunk_bytes = payloads[0].numel() * 2
    disk = work / f"lmcache-full-{name}"
    manager = make_manager(model, cpu_bytes_for(model, num_chunks), disk_dir=disk, odirect=True,
                           disk_bytes=(num_chunks + 1) * chunk_bytes + chunk_bytes // 2)
    try:
        fillers = make_keys(num_chunks + 1, 5)
        for key, payload in zip(fillers, itertools.cycle(payloads)):
            put_local(manager, model, "LocalDiskBackend", key, payload)
        t, keys = run_local(manager, model, payloads, "LocalDiskBackend", 6, request=False)
        held = sum(manager.storage_backends["LocalDiskBackend"].contains(k) for k in fillers)
    finally:
        manager.close()
    shutil.rmtree(disk, ignore_errors=True)
    return t.row(name, "lmcache-disk-odirect-full", chunk_bytes, durable="no (no fsync)", restart_found=None,
                 fillers_left=held)


def run_statestore_full(name: str, num_chunks: int, work: Path) -> dict[str, Any]:
    """statestore's SSD path as a full cache (`storage.cache_kinds = ["opaque"]`): an SSD budget
    of the warm-up and measured chunks, filled with as many others first (untimed), so that every
    timed put evicts one; the evicted files are recycled for the next chunks (`tiers.ssd`)."""
    model, payloads = MODELS[name], make_payloads(MODELS[name], num_chunks)
    chunk_bytes = payloads[0].numel() * 2
    per_chunk = chunk_bytes + 12288  # header, LMCache's key prefix, block rounding, the index entry
    data_dir = work / f"statestore-full-{name}"
    server = Server(data_dir, host_budget_bytes=16 << 20, settings={
        "STATESTORE_STORAGE_SSD_BUDGET_BYTES": str((num_chunks + 1) * per_chunk + chunk_bytes // 2),
        "STATESTORE_STORAGE_CACHE_KINDS": "opaque"})
    manager = make_manager(model, cpu_bytes_for(model, num_chunks), target=server.target, durability="local")
    try:
        location = f"RemoteBackend-{PLUGIN}"
        remote = manager.storage_backends[location]
        connector = remote.connection._connector
        fillers = make_keys(num_chunks + 1, 7)
        for key, payload in zip(fillers, itertools.cycle(payloads)):
            put_remote(manager, model, location, key, payload)
        t, keys = run_remote(manager, model, payloads, location, 8, request=False)
        assert connector.num_failures == 0, "statestore-ssd-full: the connector reported failures (see the log)"
        held = sum(remote.contains(k) for k in fillers)
    finally:
        manager.close()
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    return t.row(name, "statestore-ssd-full", chunk_bytes, durable="fdatasync", restart_found=None,
                 fillers_left=held, read_from="ssd")


def evict_from(target: str, loop: asyncio.AbstractEventLoop, connector: Any,
               tiers: Sequence[str]) -> Callable[[list[Any]], None]:
    """Drop the chunks' copies in `tiers` on the server, so gets read the tier measured."""
    from statestore.client import StateStoreClient

    def run(keys: list[Any]) -> None:
        async def go() -> None:
            async with StateStoreClient(target) as c:
                await c.evict([connector.record_key(k) for k in keys], list(tiers), force=True)

        asyncio.run_coroutine_threadsafe(go(), loop).result(120)
    return run


def resident_tiers(target: str, loop: asyncio.AbstractEventLoop) -> str:
    """The server's tiers that hold OPAQUE (LMCache chunk) bytes, with MiB."""
    from statestore.client import StateStoreClient

    async def go() -> str:
        async with StateStoreClient(target) as c:
            kinds = (await c.stats()).kinds
        return " ".join(f"{k.tier}:{k.resident_bytes >> 20}" for k in kinds if k.kind == 6 and k.resident_bytes)

    return asyncio.run_coroutine_threadsafe(go(), loop).result(60)


def run_statestore_paths(name: str, num_chunks: int, work: Path, redis_prefix: str,
                         only: Sequence[str] = ()) -> list[dict[str, Any]]:
    model, payloads = MODELS[name], make_payloads(MODELS[name], num_chunks)
    chunk_bytes = payloads[0].numel() * 2
    small_host = 16 << 20  # below one chunk: the SSD / Redis paths write and read their own tier
    rows = []
    cases = [("statestore-host", "memory", 6 << 30, "", 256 << 20, (), "host"),
             ("statestore-ssd", "local", small_host, "", 256 << 20, ("host",), "ssd"),
             ("statestore-ssd-grpc", "local", small_host, "", 0, ("host",), "ssd"),
             ("statestore-redis", "shared", small_host, redis_prefix, 256 << 20, ("host", "ssd"), "redis")]
    for i, (path, durability, host_bytes, prefix, shm_bytes, evict, read_from) in enumerate(cases):
        if only and path not in only:
            continue
        server = Server(work / f"statestore-{name}-{path}", host_budget_bytes=host_bytes, redis_prefix=prefix)
        manager = make_manager(model, cpu_bytes_for(model, num_chunks), target=server.target, durability=durability,
                               shm_bytes=shm_bytes)
        try:
            location = f"RemoteBackend-{PLUGIN}"
            connector = manager.storage_backends[location].connection._connector
            manager.storage_backends[location].contains(make_keys(1, 999)[0])  # the channel (the warm-up chunk: shm)
            evict_copies = evict_from(server.target, manager.loop, connector, evict) if evict else None
            where: list[str] = []

            def before_get(keys: list[Any]) -> None:
                where.append(resident_tiers(server.target, manager.loop))
                if evict_copies is not None:
                    evict_copies(keys)

            t, keys = run_remote(manager, model, payloads, location, 10 + i, before_get)
            assert connector.num_failures == 0, f"{path}: the connector reported failures (see the log)"
            shm = connector._client is not None and connector._client.shm_active
            found = 0
            if durability != "memory":  # kill -9, start again on the same data dir
                server.stop(signal.SIGKILL)
                server.start()
                found = restart_count(manager.storage_backends[location], keys)
            acked = {"memory": "no", "local": "fdatasync", "shared": "redis SET"}[durability]
            rows.append(t.row(name, path, chunk_bytes, durable=acked, restart_found=found, shm=shm,
                              stored_MiB=where[0], read_from=read_from))
            if prefix:  # Redis is shared with everything on this machine: leave nothing there. (After the
                # restart, Evict does not reach records that only Redis holds: they are not in the index.)
                drop_redis_keys(f"{prefix}:*")
        finally:
            manager.close()
            server.stop()
            shutil.rmtree(work / f"statestore-{name}-{path}", ignore_errors=True)
    return rows


def run_ssd_tier_alone(name: str, num_chunks: int, work: Path) -> dict[str, Any]:
    """Reference for where the SSD path's time goes: statestore's SSD tier in this process, the
    same bytes as records (no LMCache, no plugin, no RPC, no shared memory)."""
    from statestore.allocator import keep_large_buffers_in_heap
    from tiers.record import Record, make_record
    from tiers.ssd import SSDTier

    keep_large_buffers_in_heap()  # as the server does
    payloads = make_payloads(MODELS[name], num_chunks)
    records = [make_record(6, 0, p.view(torch.uint8).numpy().tobytes(), model_fingerprint=bytes(16),
                           tenant_id=bytes(16), block_key=i.to_bytes(32, "big")) for i, p in enumerate(payloads)]
    warm_up = make_record(6, 0, records[0].payload, model_fingerprint=bytes(16), tenant_id=bytes(16),
                          block_key=(1 << 255).to_bytes(32, "big"))
    t = Timings()

    async def put(tier: SSDTier, r: Record) -> float:
        t0 = time.perf_counter()
        assert await tier.put(r)
        return time.perf_counter() - t0

    async def get(tier: SSDTier, r: Record) -> float:
        t0 = time.perf_counter()
        got = await tier.get(r.key)
        took = time.perf_counter() - t0
        if got is None:
            t.misses += 1
        else:
            t.exact = t.exact and got.payload == r.payload
        return took

    async def go() -> None:
        tier = await SSDTier.create(work / f"ssd-alone-{name}")
        try:
            t.first_s = (await put(tier, warm_up), await get(tier, warm_up))  # as Timings.measure: outside the figures
            t.put_s = [await put(tier, r) for r in records]
            t.get_s = [await get(tier, r) for r in records]
        finally:
            await tier.aclose()

    asyncio.run(go())
    shutil.rmtree(work / f"ssd-alone-{name}", ignore_errors=True)
    return t.row(name, "ref: ssd-tier-alone", len(records[0].payload), durable="fdatasync", restart_found=None)


def run_durable_plain(name: str, num_chunks: int, work: Path) -> dict[str, Any]:
    """Reference for what durability costs on this disk: plain file I/O of the same chunk bytes,
    each put a new file written with O_DIRECT from an aligned huge-page buffer (as LMCache's
    backend writes) and then fdatasynced, which LMCache's backend never does; each get an
    O_DIRECT read into a buffer of the same kind (`bench.tiers`' SSD references). No header,
    checksum, index, RPC or copy: the least a durable put of a chunk costs here, which puts the
    SSD floor's gap between what statestore adds and what the flush adds."""
    from bench.tiers import _aligned, ref_get_direct, ref_put_direct

    payloads = make_payloads(MODELS[name], num_chunks)
    chunks = [p.view(torch.uint8).numpy().tobytes() for p in payloads]
    src, padded = _aligned(chunks[0])
    dst, _ = _aligned(bytes(len(chunks[0])))  # zeros: a read that lands nothing cannot pass for chunk 0
    folder = work / f"durable-plain-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    t = Timings()

    def put(i: int, chunk: bytes) -> float:
        src[:len(chunk)] = chunk  # untimed, as LMCache's `fill`
        t0 = time.perf_counter()
        ref_put_direct(folder / f"{i}.chunk", src, padded, len(chunk))
        return time.perf_counter() - t0

    def get(i: int, chunk: bytes) -> float:
        t0 = time.perf_counter()
        ref_get_direct(folder / f"{i}.chunk", dst, padded)
        took = time.perf_counter() - t0
        t.exact = t.exact and dst[:len(chunk)] == chunk
        return took

    t.first_s = (put(-1, chunks[0]), get(-1, chunks[0]))  # as Timings.measure: outside the figures
    t.put_s = [put(i, c) for i, c in enumerate(chunks)]
    t.get_s = [get(i, c) for i, c in enumerate(chunks)]
    shutil.rmtree(folder, ignore_errors=True)
    return t.row(name, "ref: odirect+fdatasync", len(chunks[0]), durable="fdatasync", restart_found=None)


def drop_redis_keys(pattern: str) -> int:
    """Delete this bench's keys from the local Redis."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        names = list(client.scan_iter(match=pattern, count=1000))
        return client.delete(*names) if names else 0
    finally:
        client.close()


def run_lmcache_redis_child(name: str, num_chunks: int) -> None:
    """Child process: LMCache's redis:// path; prints one JSON row and exits without close()."""
    model, payloads = MODELS[name], make_payloads(MODELS[name], num_chunks)
    manager = make_manager(model, cpu_bytes_for(model, num_chunks), redis=True)
    t, keys = run_remote(manager, model, payloads, "RemoteBackend", 20)
    again = make_manager(model, cpu_bytes_for(model, 1), redis=True)  # a restart of LMCache (Redis keeps them)
    found = restart_count(again.storage_backends["RemoteBackend"], keys)
    drop_redis_keys("bench@1@0@*")  # LMCache's two keys per chunk (its remove() leaves them)
    print("ROW " + json.dumps(t.row(name, "lmcache-redis", payloads[0].numel() * 2, durable="redis SET",
                                    restart_found=found)), flush=True)
    os._exit(0)  # LMCache 0.5.6's RedisConnector.close() deadlocks


def restart_count(backend: Any, keys: list[Any], timeout_s: float = 30.0) -> int:
    """How many of `keys` a backend that just started finds, asking again (every 0.2 s, up to
    `timeout_s`) until it finds them all: a RemoteBackend connects in the background, and asked
    at once under load it answered 0 (LMCache's redis:// in 5 of 8 rounds of a full run). The
    restarted statestore server gets the same patience (`run_statestore_paths`)."""
    deadline = time.monotonic() + timeout_s
    while (found := backend.batched_contains(keys)) < len(keys) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def run_lmcache_redis(name: str, num_chunks: int) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "bench.lmcache_compare", "--child-redis", name, "--chunks", str(num_chunks)]
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"lmcache-redis child did not finish in {CHILD_TIMEOUT_S} s") from exc
    rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:  # (LMCache logs every step: what it said last, less its INFO lines)
        said = [line for line in (out.stdout + out.stderr).splitlines() if "LMCache INFO" not in line]
        raise RuntimeError(f"lmcache-redis child failed (exit {out.returncode}): " + "\n".join(said[-40:]))
    return rows


def run_rounds(name: str, num_chunks: int, work: Path, rounds: int, only: Sequence[str]) -> list[dict[str, Any]]:
    """Every path of one model, `rounds` times: LMCache's side then ours in even rounds, ours then
    LMCache's in odd ones (as `bench.server` alternates), each row tagged with its round. The
    machine is shared and its disk swings within minutes; the two sides of a floor measured back
    to back in both orders let order and drift cancel in the median of the rounds' ratios."""
    def lmcache_side() -> list[dict[str, Any]]:
        return run_lmcache_paths(name, num_chunks, work) + run_lmcache_redis(name, num_chunks) + \
            [run_lmcache_full(name, num_chunks, work)]

    def statestore_side() -> list[dict[str, Any]]:
        rows = run_statestore_paths(name, num_chunks, work, redis_prefix=f"bench-{os.getpid()}-{name}", only=only)
        if not only or "statestore-ssd-full" in only:
            rows.append(run_statestore_full(name, num_chunks, work))
        return rows if only else rows + [run_ssd_tier_alone(name, num_chunks, work),
                                         run_durable_plain(name, num_chunks, work)]

    out: list[dict[str, Any]] = []
    for r in range(rounds):
        sides = [statestore_side] if only else [lmcache_side, statestore_side]
        for side in sides if r % 2 == 0 else sides[::-1]:
            out += [{**row, "round": r} for row in side()]
    return out


NUMERIC = ("put_GBps", "get_GBps", "put_p50_ms", "put_p99_ms", "get_p50_ms", "get_p99_ms", "first_put_ms",
           "first_get_ms")
REQUEST = ("req_put_GBps", "req_get_GBps")  # paths measured as one request too (`Timings.measure_request`)


def median_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, path): the median of each figure over the rounds (other fields from
    the first round; `bit_exact` only if every round was; `restart_found` the fewest any round
    found)."""
    by_path: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        by_path.setdefault((row["model"], row["path"]), []).append(row)
    out = []
    for runs in by_path.values():
        merged = {**runs[0], "round": "median", "rounds": len(runs)}
        for col in NUMERIC + REQUEST:
            if all(col in r for r in runs):
                merged[col] = statistics.median(r[col] for r in runs)
            else:  # (a request figure some round lacks: none, rather than one round's)
                merged.pop(col, None)
        merged["bit_exact"] = all(r["bit_exact"] for r in runs)
        merged["misses"] = sum(r.get("misses", 0) for r in runs)
        if all(isinstance(r.get("restart_found"), int) for r in runs):
            merged["restart_found"] = min(r["restart_found"] for r in runs)
        out.append(merged)
    return out


def round_ratios(rows: Sequence[dict[str, Any]], model: str, ours: str, theirs: str, op: str) -> list[float]:
    """ours / theirs GB/s of `op` in each round that measured both."""
    def by_round(path: str) -> dict[int, float]:
        return {r["round"]: r[f"{op}_GBps"] for r in rows if r["model"] == model and r["path"] == path
                and f"{op}_GBps" in r}

    a, b = by_round(ours), by_round(theirs)
    return [a[i] / b[i] for i in sorted(a) if i in b]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 chunks of the conventional model only, one round")
    parser.add_argument("--chunks", type=int, default=0, help="chunks per model (default 16, --quick 4)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds of every path, in alternating order "
                                                              "(default 2, --quick 1)")
    parser.add_argument("--models", default="", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--paths", default="", help="comma-separated statestore paths only (development)")
    parser.add_argument("--child-redis", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Fills (`fill`: a torch copy into LMCache's buffer) on one thread: with torch's default of
    # one per core, its OpenMP worker kept spinning after each fill, through the put timed next
    # (measured: 1.3 s of CPU over 128 puts, ~10 ms a put, on the 2-core development VM),
    # taking a core from whatever served the put (LMCache's writer, or the statestore server).
    torch.set_num_threads(1)
    # Start-up's objects out of the collector's walks, as `statestore serve` does and as serving
    # engines do once loaded: this process imports torch, LMCache and transformers, and a full
    # collection walked them all, in the middle of whichever chunk was timed then (134 ms, about
    # once every 50 puts through the plugin; measured with gc.callbacks), for either side.
    import lmcache.v1.storage_backend.storage_manager  # noqa: F401  (what make_manager imports, loaded first)
    gc.collect()
    gc.freeze()
    num_chunks = args.chunks or (4 if args.quick else 16)
    rounds = args.rounds or (1 if args.quick else 2)
    if num_chunks < 1 or rounds < 1:
        parser.error("--chunks and --rounds must be at least 1")
    if args.child_redis:
        run_lmcache_redis_child(args.child_redis, num_chunks)
        return
    models = [m for m in (args.models or ("conventional" if args.quick else ",".join(MODELS))).split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    only = [p for p in args.paths.split(",") if p]
    work = Path(tempfile.mkdtemp(prefix="bench-lmcache-", dir=os.environ.get("BENCH_DIR")))
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    try:
        for name in models:
            rows += run_rounds(name, num_chunks, work, rounds, only)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    columns = ["model", "path", "round", "chunks", "chunk_MiB", "put_GBps", "get_GBps", "put_p50_ms", "put_p99_ms",
               "get_p50_ms", "get_p99_ms", "first_put_ms", "first_get_ms", "req_put_GBps", "req_get_GBps", "durable",
               "restart_found", "bit_exact", "misses", "stored_MiB", "read_from", "fillers_left"]
    summary = median_rows(rows)
    if rounds > 1:
        print_table(rows, columns)
        print(f"\nMedian of {rounds} rounds")
    print_table(summary, columns)
    if only:
        return  # a development run: no floors, no results file
    floors: dict[str, Floor] = {}
    ratios: dict[str, list[float]] = {}
    for name in models:
        for ours, theirs in (("statestore-ssd", "lmcache-disk-odirect"), ("statestore-redis", "lmcache-redis")):
            for op in ("put", "get"):
                label = f"{name}_{ours}_{op}_vs_{theirs}"
                ratios[label] = round_ratios(rows, name, ours, theirs, op)
                floors[label] = Floor(statistics.median(ratios[label]), 1.0)
    request = {f"{name}_{ours}_{op}_vs_{theirs}": round_ratios(rows, name, ours, theirs, op)
               for name in models for ours, theirs in (("statestore-ssd", "lmcache-disk-odirect"),
                                                       ("statestore-redis", "lmcache-redis"))
               for op in ("req_put", "req_get")}
    full = {f"{name}_statestore-ssd-full_{op}_vs_lmcache-disk-odirect-full":
            round_ratios(rows, name, "statestore-ssd-full", "lmcache-disk-odirect-full", op)
            for name in models for op in ("put", "get")}
    durable = {f"{name}_{path}_put_vs_ref: odirect+fdatasync": round_ratios(rows, name, path, "ref: odirect+fdatasync", "put")
               for name in models for path in ("statestore-ssd", "ref: ssd-tier-alone", "lmcache-disk-odirect")}
    if rounds > 1:
        print("\nRatios per round (the floor is their median):")
        for label, values in ratios.items():
            print(f"  {label}: " + " ".join(f"{v:.2f}" for v in values))
    for title, ratios_of in (("Every chunk as one request, LMCache's batched calls", request),
                             ("Full caches, every put evicting", full),
                             ("Puts against the least a durable put costs here (plain O_DIRECT write + fdatasync; "
                              "LMCache's backend does not flush)", durable)):
        print(f"\n{title} (no floor; median of the rounds' ratios):")
        for label, values in ratios_of.items():
            print(f"  {label}: {statistics.median(values):.2f} (" + " ".join(f"{v:.2f}" for v in values) + ")")
    print_floors(floors)
    from importlib import metadata

    path = write_results("lmcache_compare", device="cpu", rows=summary + rows, floors=floors, params={
        "chunks_per_model": num_chunks, "rounds": rounds, "chunk_tokens": CHUNK_TOKENS,
        "models": {m: MODELS[m] for m in models}, "lmcache": metadata.version("lmcache"), "quick": args.quick,
        "ratios_by_round": {k: [round(v, 4) for v in vs] for k, vs in ratios.items()},
        "request_ratios_by_round": {k: [round(v, 4) for v in vs] for k, vs in request.items()},
        "full_cache_ratios_by_round": {k: [round(v, 4) for v in vs] for k, vs in full.items()},
        "durable_put_ratios_by_round": {k: [round(v, 4) for v in vs] for k, vs in durable.items()},
        "seconds": round(time.monotonic() - started, 1)})
    print(f"wrote {path} in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
