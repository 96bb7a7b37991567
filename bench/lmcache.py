"""LMCache as the baseline (issue 9): the same chunks through LMCache 0.5.6's own tiers and
through statestore, in one run.

    .venv-lmcache/bin/python -m bench.lmcache [--quick] [--chunks N]      (make test-lmcache builds the venv)

Payloads: LMCache chunks of 256 tokens, random bf16, in LMCache's layout for two models:
- `v41-like`: MLA format `[1, 61 layers, 256, 576]` (DeepSeek-V3/V4-class latent KV as LMCache
  holds it under vLLM: bf16, 70,272 B/token; statestore's own V4.1 records keep 890 B/token);
- `conventional`: `[2, 32 layers, 256, 8 heads x 128]` (a Llama-8B-class GQA model, 131,072 B/token).

Paths, each put then get of every chunk:
- `lmcache-cpu`: LMCache's LocalCPUBackend (keeps references: no copy, not durable);
- `lmcache-disk`, `lmcache-disk-odirect`: LMCache's LocalDiskBackend (files, no fsync; index in
  memory only, so nothing is found after a restart), with and without O_DIRECT;
- `statestore-remote-{memory,ssd}`: LMCache's RemoteBackend with our plugin
  (`statestore.integrations.lmcache`) against a statestore server in a child process, put at
  durability memory (host tier) or local (fsynced SSD tier; host copies evicted before the get,
  so gets read the SSD tier);
- `statestore-native-{memory,ssd}`: the same bytes as statestore records through
  `SyncStateStoreClient` (no LMCache).

Bytes stored per token count what each medium holds: LMCache's allocations, LMCache's files,
statestore's resident bytes for the kind (records with headers, the connector's key/metadata
prefix). Reads of files (LMCache's disk without O_DIRECT, statestore's SSD tier) come from the
page cache right after the write, for both. Figures on the shared 2-core CPU are relative only.
Floors (issue 9): statestore's SSD path >= LMCache's local disk with O_DIRECT, put and get.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import Floor, print_floors, print_table, write_results

ROOT = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 256
MODELS: dict[str, dict[str, Any]] = {
    "v41-like": {"layers": 61, "heads": 1, "head_dim": 576, "use_mla": True},
    "conventional": {"layers": 32, "heads": 8, "head_dim": 128, "use_mla": False},
}
PLUGIN = "statestore"


class Server:
    """`statestore serve` in a child process (a sidecar, as deployed), on a free loopback port."""

    def __init__(self, data_dir: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "STATESTORE_STORAGE_HOST_BUDGET_BYTES": str(6 << 30),
               "STATESTORE_SERVER_MAX_STREAM_BYTES": str(1 << 30)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "statestore.cli", "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir),
             "--preset", "mini"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"serving on 127\.0\.0\.1:(\d+)", line)
        if match is None:
            self.proc.kill()
            raise RuntimeError(f"statestore did not start: {line}{self.proc.stdout.read()}")
        self.target = f"127.0.0.1:{match.group(1)}"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def make_manager(target: str, model: dict[str, Any], disk_dir: Path, *, odirect: bool, durability: str,
                 cpu_bytes: int) -> Any:
    """LMCache's StorageManager with LocalCPU, LocalDisk and our remote plugin, from its config."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    config = LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": cpu_bytes / 1e9,
        "local_disk": f"file://{disk_dir}/", "max_local_disk_size": cpu_bytes / 1e9, "remote_serde": "naive",
        "remote_storage_plugins": [PLUGIN],
        "extra_config": {"use_odirect": odirect,
                         f"remote_storage_plugin.{PLUGIN}.module_path": "statestore.integrations.lmcache",
                         f"remote_storage_plugin.{PLUGIN}.class_name": "StateStoreConnector",
                         f"remote_storage_plugin.{PLUGIN}.target": target,
                         f"remote_storage_plugin.{PLUGIN}.namespace": f"bench-{durability}",
                         f"remote_storage_plugin.{PLUGIN}.durability": durability,
                         f"remote_storage_plugin.{PLUGIN}.timeout_s": 60.0}})
    metadata = LMCacheMetadata(
        model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, use_mla=model["use_mla"],
        kv_shape=(model["layers"], 1 if model["use_mla"] else 2, CHUNK_TOKENS, model["heads"], model["head_dim"]))
    return StorageManager(config, metadata, EventManager())


def chunk_shape(model: dict[str, Any]) -> torch.Size:
    return torch.Size([1 if model["use_mla"] else 2, model["layers"], CHUNK_TOKENS, model["heads"] * model["head_dim"]])


def make_keys(num_chunks: int, salt: int) -> list[Any]:
    from lmcache.utils import CacheEngineKey

    return [CacheEngineKey("bench", 1, 0, (salt << 32) + i, torch.bfloat16) for i in range(num_chunks)]


def fill(manager: Any, model: dict[str, Any], payloads: Sequence[torch.Tensor]) -> list[Any]:
    from lmcache.v1.memory_management import MemoryFormat

    fmt = MemoryFormat.KV_MLA_FMT if model["use_mla"] else MemoryFormat.KV_2LTD
    objs = []
    for payload in payloads:
        obj = manager.allocate(chunk_shape(model), torch.bfloat16, fmt=fmt)
        assert obj is not None, "LMCache's CPU buffer is full"
        obj.tensor.copy_(payload)
        objs.append(obj)
    return objs


def wait_until(done: Callable[[], bool], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("a put did not complete")
        time.sleep(0.001)


class LoopClient:
    """A blocking `StateStoreClient` on LMCache's event loop: grpc.aio in one process wants one loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target: str) -> None:
        from statestore.client import ClientOptions, StateStoreClient

        self.loop = loop
        self.client = StateStoreClient(target, options=ClientOptions(chunk_bytes=1 << 20, timeout_s=600.0))
        self._run(self._open())

    async def _open(self) -> None:
        self.client.open()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(600)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)
        return lambda *args, **kwargs: self._run(method(*args, **kwargs))

    def close(self) -> None:
        self._run(self.client.aclose())


def kind_bytes(client: Any, tier: str) -> int:
    return sum(k.resident_bytes for k in client.stats().kinds if k.tier == tier and k.kind == 6)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_model(name: str, model: dict[str, Any], num_chunks: int, server: Server, work: Path) -> list[dict[str, Any]]:
    from statestore.types import Durability
    from tiers.record import make_record

    gen = torch.Generator().manual_seed(0)
    payloads = [torch.randn(chunk_shape(model), generator=gen).to(torch.bfloat16) for _ in range(num_chunks)]
    chunk_bytes = payloads[0].numel() * 2
    total_bytes = chunk_bytes * num_chunks
    tokens = CHUNK_TOKENS * num_chunks
    cpu_bytes = total_bytes * 3 + (64 << 20)
    rows: list[dict[str, Any]] = []

    def row(path: str, put_s: float, get_s: float, stored_bytes: int, durable: bool, restart_safe: bool,
            ok: bool) -> None:
        rows.append({"model": name, "path": path, "chunks": num_chunks, "chunk_MiB": round(chunk_bytes / 2**20, 2),
                     "put_GBps": total_bytes / put_s / 1e9, "get_GBps": total_bytes / get_s / 1e9,
                     "bytes_per_token": stored_bytes / tokens, "durable": durable, "restart_safe": restart_safe,
                     "bit_exact": ok})

    def check(objs: Sequence[Any]) -> bool:
        good = all(o is not None and torch.equal(o.tensor, p) for o, p in zip(objs, payloads))
        for o in objs:
            if o is not None:
                o.ref_count_down()
        return good

    for odirect, durability in ((False, "local"), (True, "memory")):
        disk = work / f"lmcache-disk-{name}-{int(odirect)}"
        manager = make_manager(server.target, model, disk, odirect=odirect, durability=durability, cpu_bytes=cpu_bytes)
        client = LoopClient(manager.loop, server.target)
        try:
            backends = manager.storage_backends
            remote = backends[f"RemoteBackend-{PLUGIN}"]
            connector = remote.connection._connector
            on_loop: Callable[[Any], Any] = lambda c: asyncio.run_coroutine_threadsafe(c, manager.loop).result(600)
            on_loop(connector.exists(make_keys(1, 999)[0]))  # warm-up: channel up, namespace known

            if not odirect:  # LMCache's RAM tier: the same in both managers, measured once
                keys, objs = make_keys(num_chunks, 1), fill(manager, model, payloads)
                stored = sum(o.get_size() for o in objs)
                t0 = time.perf_counter()
                manager.batched_put(keys, objs, location="LocalCPUBackend")
                wait_until(lambda: backends["LocalCPUBackend"].batched_contains(keys) == len(keys))
                t1 = time.perf_counter()
                got = [manager.get(k, location="LocalCPUBackend") for k in keys]
                t2 = time.perf_counter()
                row("lmcache-cpu", t1 - t0, t2 - t1, stored, False, False, check(got))
                for k in keys:
                    backends["LocalCPUBackend"].remove(k)

            keys, objs = make_keys(num_chunks, 2), fill(manager, model, payloads)
            local = backends["LocalDiskBackend"]
            t0 = time.perf_counter()
            manager.batched_put(keys, objs, location="LocalDiskBackend")
            wait_until(lambda: local.batched_contains(keys) == len(keys))
            t1 = time.perf_counter()
            got = [manager.get(k, location="LocalDiskBackend") for k in keys]
            t2 = time.perf_counter()
            row("lmcache-disk-odirect" if odirect else "lmcache-disk", t1 - t0, t2 - t1, dir_bytes(disk), False,
                False, check(got))
            for k in keys:
                local.remove(k)

            tier = "ssd" if durability == "local" else "host"
            keys, objs = make_keys(num_chunks, 3), fill(manager, model, payloads)
            before = kind_bytes(client, tier)
            t0 = time.perf_counter()
            on_loop(connector.batched_put(keys, objs))
            t1 = time.perf_counter()
            for o in objs:
                o.ref_count_down()
            stored = kind_bytes(client, tier) - before
            record_keys = [connector.record_key(k) for k in keys]
            if tier == "ssd":
                client.evict(record_keys, ["host"], force=True)
            t2 = time.perf_counter()
            got = remote.batched_get_blocking(keys)
            t3 = time.perf_counter()
            row(f"statestore-remote-{tier}", t1 - t0, t3 - t2, stored, tier == "ssd", tier == "ssd", check(got))
            client.evict(record_keys, force=True)
            assert connector.num_failures == 0, "the connector reported failures: see the log"

            fingerprint = client.register_model(
                model_name=f"native-{name}", weights_id=f"native-{name}", config_json="{}", layout_version=1,
                specs=[{"kind": 6, "retention": 1, "codec": 0}])[0]
            records = [make_record(6, 0, p.view(torch.uint8).numpy().tobytes(), model_fingerprint=fingerprint,
                                   tenant_id=bytes(16),
                                   block_key=hashlib.blake2b(f"{name}/{tier}/{i}".encode(), digest_size=32).digest())
                       for i, p in enumerate(payloads)]
            before = kind_bytes(client, tier)
            level = Durability.LOCAL if tier == "ssd" else Durability.MEMORY
            t0 = time.perf_counter()
            for start in range(0, len(records), 4):
                client.put_records(records[start:start + 4], level)
            t1 = time.perf_counter()
            stored = kind_bytes(client, tier) - before
            native_keys = [r.key for r in records]
            if tier == "ssd":
                client.evict(native_keys, ["host"], force=True)
            t2 = time.perf_counter()
            fetched = client.get_records(native_keys)
            t3 = time.perf_counter()
            ok = all(f is not None and f.payload == r.payload for f, r in zip(fetched, records))
            row(f"statestore-native-{tier}", t1 - t0, t3 - t2, stored, tier == "ssd", tier == "ssd", ok)
            client.evict(native_keys, force=True)
            del records, fetched
        finally:
            client.close()
            manager.close()
            shutil.rmtree(disk, ignore_errors=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 chunks per model (about a minute on 2 cores)")
    parser.add_argument("--chunks", type=int, default=0, help="chunks per model (default 16, --quick 4)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    args = parser.parse_args(argv)
    num_chunks = args.chunks or (4 if args.quick else 16)
    work = Path(tempfile.mkdtemp(prefix="bench-lmcache-", dir=os.environ.get("BENCH_DIR")))
    server = Server(work / "statestore")
    rows: list[dict[str, Any]] = []
    try:
        for name in args.models.split(","):
            rows += run_model(name, MODELS[name], num_chunks, server, work)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    columns = ["model", "path", "chunks", "chunk_MiB", "put_GBps", "get_GBps", "bytes_per_token", "durable",
               "restart_safe", "bit_exact"]
    print_table(rows, columns)
    floors: dict[str, Floor] = {}
    for name in args.models.split(","):
        by_path = {r["path"]: r for r in rows if r["model"] == name}
        for op in ("put", "get"):
            ours, theirs = by_path["statestore-remote-ssd"][f"{op}_GBps"], by_path["lmcache-disk-odirect"][f"{op}_GBps"]
            floors[f"{name}_ssd_{op}_vs_lmcache_disk_odirect"] = Floor(ours / theirs, 1.0)
    print_floors(floors)
    from importlib import metadata

    path = write_results("lmcache", device="cpu", rows=rows, floors=floors, params={
        "chunks_per_model": num_chunks, "chunk_tokens": CHUNK_TOKENS, "models": {n: MODELS[n] for n in args.models.split(",")},
        "lmcache": metadata.version("lmcache"), "quick": args.quick})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
