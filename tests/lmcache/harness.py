"""Helpers of the LMCache interop tests: a real statestore server in a child process, and
LMCache 0.5.6's own StorageManager configured with our plugin through its config mechanism.

These tests run in `.venv-lmcache` (`make test-lmcache`, which sets PYTHONHASHSEED=0 and
STATESTORE_REQUIRE_LMCACHE=1). In the main venv lmcache is absent and every test module
skips; with STATESTORE_REQUIRE_LMCACHE=1 a missing lmcache fails instead. Nothing here imports
lmcache at module level.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from statestore.spawn import spawn_serve

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "statestore"
CHUNK_TOKENS = 256
# A small conventional model: chunks of [2, layers, 256, heads * head_dim] bf16 = 256 KiB.
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 4, 2, 32


def require_lmcache() -> None:
    """Import lmcache or skip; in CI (STATESTORE_REQUIRE_LMCACHE=1) a missing lmcache fails."""
    # "lmcache.v1", not "lmcache": pytest puts tests/ on sys.path, where this folder would pass
    # for a namespace package named lmcache.
    if os.environ.get("STATESTORE_REQUIRE_LMCACHE") == "1":
        import lmcache.v1  # noqa: F401 - must be importable here: fail loudly
    else:
        pytest.importorskip("lmcache.v1", reason="lmcache is not installed here: `make test-lmcache` runs these")


class ServerProcess:
    """`statestore serve` in a child process; `start` again on the same data dir is a restart."""

    def __init__(self, data_dir: Path, port: int = 0, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = port
        self.env = env or {}  # STATESTORE_* settings of this server
        self.proc: subprocess.Popen[str] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.proc, self.port = spawn_serve(self.data_dir, port=self.port,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env}, cwd=ROOT)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None


def make_lmcache_config(target: str, *, local_disk: str | None = None, remote: bool = True,
                        max_local_cpu_gb: float = 0.25, shm_name: str | None = None, **plugin: Any) -> Any:
    """LMCacheEngineConfig as a user's YAML would give it (same keys, through `from_dict`);
    `shm_name`: LMCache's CPU buffer in /dev/shm under that name."""
    from lmcache.v1.config import LMCacheEngineConfig

    doc: dict[str, Any] = {"chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": max_local_cpu_gb,
                           "remote_serde": "naive", "save_unfull_chunk": True}
    if remote:
        extra = {f"remote_storage_plugin.{PLUGIN}.module_path": "statestore.integrations.lmcache",
                 f"remote_storage_plugin.{PLUGIN}.class_name": "StateStoreConnector",
                 f"remote_storage_plugin.{PLUGIN}.target": target}
        # Generous lookup deadline: CI's 2 shared cores can stall a loopback call past the 0.5 s default,
        # and a timed-out lookup is (by design) a miss plus a backoff.
        plugin = {"lookup_timeout_s": 5.0, **plugin}
        extra.update({f"remote_storage_plugin.{PLUGIN}.{k}": v for k, v in plugin.items()})
        doc.update(remote_storage_plugins=[PLUGIN], extra_config=extra)
    if shm_name is not None:
        doc.setdefault("extra_config", {})["shm_name"] = shm_name
    if local_disk is not None:
        doc.update(local_disk=local_disk, max_local_disk_size=1.0)
    return LMCacheEngineConfig.from_dict(doc)


def make_lmcache_metadata(model_name: str = "tiny-test", *, layers: int = NUM_LAYERS, heads: int = NUM_HEADS,
                          head_dim: int = HEAD_DIM, use_mla: bool = False, dtype: Any = None) -> Any:
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name=model_name, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=dtype or torch.bfloat16,
                           kv_shape=(layers, 1 if use_mla else 2, CHUNK_TOKENS, heads, head_dim), use_mla=use_mla)


class LMCacheHarness:
    """LMCache's StorageManager and token database, as the engine drives them, minus the GPU."""

    def __init__(self, config: Any, metadata: Any) -> None:
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.storage_backend.storage_manager import StorageManager
        from lmcache.v1.token_database import ChunkedTokenDatabase

        self.config, self.metadata = config, metadata
        self.manager = StorageManager(config, metadata, EventManager())
        self.tokens_db = ChunkedTokenDatabase(config, metadata)

    @property
    def remote_name(self) -> str:
        return f"RemoteBackend-{PLUGIN}"

    @property
    def connector(self) -> Any:
        return self.manager.storage_backends[self.remote_name].connection._connector

    def keys(self, token_ids: list[int]) -> list[Any]:
        return [key for _, _, key in self.tokens_db.process_tokens(tokens=token_ids)]

    def make_chunk(self, num_tokens: int, seed: int) -> Any:
        """A memory object holding a chunk of `num_tokens` tokens of seeded random bf16 values."""
        import torch

        shape = self.metadata.get_shapes()[0]
        shape = torch.Size([*shape[:2], num_tokens, *shape[3:]])
        obj = self.manager.allocate(shape, self.metadata.get_dtypes()[0], fmt=self._fmt())
        assert obj is not None and obj.tensor is not None
        gen = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(shape, generator=gen).to(obj.tensor.dtype))
        return obj

    def _fmt(self) -> Any:
        from lmcache.v1.memory_management import MemoryFormat

        return MemoryFormat.KV_MLA_FMT if self.metadata.use_mla else MemoryFormat.KV_2LTD

    def store(self, token_ids: list[int], seed: int = 0) -> dict[Any, bytes]:
        """Put every chunk of `token_ids` (the last may be partial); returns key -> chunk bytes."""
        keys, objs, expect = [], [], {}
        for (start, end, key) in self.tokens_db.process_tokens(tokens=token_ids):
            obj = self.make_chunk(end - start, seed + start)
            keys.append(key)
            objs.append(obj)
            expect[key] = bytes(obj.byte_array)
        self.manager.batched_put(keys, objs)
        return expect

    def wait_stored(self, keys: list[Any], timeout_s: float = 30.0) -> None:
        """Until statestore holds every key (LMCache's remote puts are asynchronous)."""
        import time

        backend = self.manager.storage_backends[self.remote_name]
        deadline = time.monotonic() + timeout_s
        while backend.batched_contains(keys) < len(keys):
            assert time.monotonic() < deadline, "LMCache's puts did not reach statestore"
            time.sleep(0.05)

    def close(self) -> None:
        self.manager.close()
