"""statestore as a remote backend of LMCache 0.5.6 (`pip install "statestore[lmcache]"`).

LMCache keeps its RAM tier (LocalCPUBackend) and hands every chunk to this connector, which
stores it in a statestore server over gRPC as one `StateKind.OPAQUE` record: durable (fsynced
on the server's SSD tier by default), restart-safe (the server re-indexes its records at
start, where LMCache's LocalDiskBackend keeps its index in memory only), shared by every
LMCache process that talks to the same server, and checksummed end to end.

The LMCache config a user writes (YAML; `LMCACHE_CONFIG_FILE=lmcache.yaml`)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5            # GB; the connector allocates its read buffers here
    remote_serde: naive
    remote_storage_plugins: ["statestore"]
    extra_config:
      shm_name: "lmcache-worker0"    # LMCache's CPU buffer in /dev/shm: lent to a same-host statestore,
                                     # chunks move with no copy in the connector (one name per worker)
      remote_storage_plugin.statestore.module_path: statestore.integrations.lmcache
      remote_storage_plugin.statestore.class_name: StateStoreConnector
      remote_storage_plugin.statestore.target: "127.0.0.1:7450"    # the statestore server
      remote_storage_plugin.statestore.token: "s3cret-tenant-token" # tenant bearer token (optional)
      remote_storage_plugin.statestore.namespace: "deepseek-v4.1"  # model namespace (optional)
      remote_storage_plugin.statestore.durability: local           # memory | local | shared
      # and on the server: storage.cache_kinds = ["opaque"] with an ssd_budget_bytes, so that a
      # full SSD evicts the least recently used chunks instead of refusing new ones
      remote_storage_plugin.statestore.timeout_s: 5.0              # data calls
      remote_storage_plugin.statestore.lookup_timeout_s: 0.5       # contains / prefix lookups
      remote_storage_plugin.statestore.frame_bytes: 1048576        # bytes per gRPC message: below the
                                                                   # server's max_message_bytes (4 MiB)
      remote_storage_plugin.statestore.shm_bytes: 268435456        # same-host shared memory (0: off)

Every process that should share chunks must run with the same `PYTHONHASHSEED` (without
vLLM, LMCache hashes token chunks with Python's `hash`). The plugin name (`statestore`
above) may be anything; the connector finds its settings under the name whose
`module_path` is this module. Defaults: target `127.0.0.1:7450`, no token, namespace
`lmcache`, durability `local`.

How a chunk is stored:

- block key = BLAKE2b-256, keyed by a secret derived from the tenant token, over
  (namespace, LMCache key string `model@world_size@worker_id@<chunk hash>@dtype`). A tenant
  without the token can neither compute nor probe another tenant's keys; two namespaces never
  share a key. Record key = (OPAQUE, block key).
- model fingerprint = fingerprint of ("lmcache", namespace), registered with the server.
- payload = `b"LMC1"`, key length, metadata length (u16 each), the LMCache key string (so
  `list` can return it and a hash collision is detected), LMCache's `RemoteMetadata`
  (length, shapes, dtypes, format), then the chunk bytes.

Data path: only the public client API (`StateStoreClient.put_payloads`, `get_payloads_into`,
`read_head`, `count_prefix`, `lend_shared_memory`; statestore/payloads.py). A put hands the
prefix and `memory_obj.byte_array` as they are; a get allocates the buffer from LMCache's
LocalCPUBackend once the record's header and prefix are read, and the rest lands straight in
it. When the server runs on the same host the bytes move through a shared-memory region
(`shm_bytes`, statestore/shm.py: one copy in, one copy out; the server still fsyncs before
acknowledging a `local` put), else as gRPC frames sliced from / copied into those buffers.

With LMCache's `shm_name` set, its CPU buffer is a file under /dev/shm, and the connector
lends that file to the server (`LentBuffer`; statestore/shm.py, "Lent memory"): a put names
where the chunk lies in it and the server copies it out while it writes it; a get allocates a
full chunk's buffer before the call and the server delivers the chunk into it as it reads it
(a partial chunk, another shape, comes through its slot as above). The connector then never
copies or hashes the chunk: the server takes its checksum as it copies it out on a put and
verifies it as it delivers it on a get (statestore/shm.py). On the development VM the
connector's own work on a 32 MiB chunk went from ~5 ms (copy and hash) to ~0.02 ms a put, and
from ~3.7 ms to nothing a get.
A record whose checksum, key or shape does not match is released and reported as a miss.

Failure model: a statestore that is down, slow or refusing gives misses (`exists` False,
prefix length 0, `get` None) and dropped puts, never an exception into LMCache. After a
failure the connector backs off (0.5 s doubling to 10 s) and answers misses at once until
the next probe succeeds. `put` never calls `ref_count_down` (LMCache's RemoteBackend owns
the reference). The connector's coroutines run on LMCache's storage event loop, which
owns the gRPC channel; the synchronous methods (`exists_sync`, `batched_contains`,
`remove_sync`) submit to that loop and wait.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import struct
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from engine_adapter.base import Codec, StateKind
from engine_adapter.fingerprint import make_model_fingerprint
from statestore.client import ClientOptions, ServiceError, StateStoreClient
from statestore.payloads import PayloadPut
from statestore.shm import LENT_DIR, LentSpan, ShmUnavailable
from statestore.types import Durability
from tiers.record import HEADER_SIZE, KEY_BYTES, TENANT_BYTES, RecordError, RecordHeader, make_record_key

logger = logging.getLogger(__name__)
T = TypeVar("T")

PLUGIN_MAGIC = b"LMC1"
_PREFIX = struct.Struct("<4sHH")  # magic, key string length, RemoteMetadata length
_PERSON_KEY = b"ss.lmcache-key1"
_PERSON_SECRET = b"ss.lmcache-sec1"
_LAYOUT_VERSION = 1
_KIND = int(StateKind.OPAQUE)
_LIST_CONCURRENCY = 16  # first-frame reads in flight while listing
_HEAD_BYTES = 4096  # payload bytes read before a chunk's buffer is allocated: the whole prefix


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What `extra_config` says under `remote_storage_plugin.<name>.`; validated here."""

    target: str = "127.0.0.1:7450"
    token: str | None = None
    namespace: str = "lmcache"
    durability: Durability = Durability.LOCAL
    timeout_s: float = 5.0
    lookup_timeout_s: float = 0.5
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    frame_bytes: int = 1 << 20  # data bytes per gRPC message (the server's default limit is 4 MiB)
    max_batch_bytes: int = 64 << 20  # records per PutRecords stream (the server's default is 256 MiB)
    shm_bytes: int = 256 << 20  # same-host shared-memory region (statestore/shm.py); 0: gRPC frames only

    def __post_init__(self) -> None:
        if ":" not in self.target:
            raise ValueError(f"statestore connector: target {self.target!r} is not HOST:PORT")
        if not self.namespace:
            raise ValueError("statestore connector: namespace must not be empty")
        if min(self.timeout_s, self.lookup_timeout_s, self.backoff_s) <= 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("statestore connector: timeouts and backoff must be > 0 (max_backoff_s >= backoff_s)")
        if not 64 << 10 <= self.frame_bytes <= 3 << 20:
            raise ValueError(f"statestore connector: frame_bytes {self.frame_bytes} outside [64 KiB, 3 MiB]")
        if self.shm_bytes and not 8 << 20 <= self.shm_bytes <= 64 << 30:
            raise ValueError(f"statestore connector: shm_bytes {self.shm_bytes} is neither 0 nor in [8 MiB, 64 GiB]")
        if self.max_batch_bytes < 1:
            raise ValueError(f"statestore connector: max_batch_bytes {self.max_batch_bytes} < 1")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, plugin_name: str) -> ConnectorSettings:
        extra = extra or {}
        prefix = f"remote_storage_plugin.{plugin_name}."
        values: dict[str, Any] = {}
        for name, field_type in (("target", str), ("token", str), ("namespace", str), ("timeout_s", float),
                                 ("lookup_timeout_s", float), ("backoff_s", float), ("max_backoff_s", float),
                                 ("frame_bytes", int), ("max_batch_bytes", int), ("shm_bytes", int)):
            if prefix + name in extra and extra[prefix + name] is not None:
                values[name] = field_type(extra[prefix + name])
        if prefix + "durability" in extra:
            level = str(extra[prefix + "durability"]).upper()
            if level not in Durability.__members__:
                raise ValueError(f"statestore connector: durability {level.lower()!r} is not memory, local or shared")
            values["durability"] = Durability[level]
        return cls(**values)


def find_plugin_name(remote_storage_plugins: Sequence[str] | None, extra: Mapping[str, Any] | None) -> str:
    """The plugin name this module is configured under (LMCache does not pass it to the class)."""
    extra = extra or {}
    for name in remote_storage_plugins or ():
        if extra.get(f"remote_storage_plugin.{name}.module_path") == __name__:
            return name
    return "statestore"


@dataclass(frozen=True, slots=True)
class LentBuffer:
    """LMCache's CPU buffer when it lies in a file under /dev/shm (LMCache's `shm_name`): the
    file, and the address and size of the buffer, which maps it from offset 0."""

    path: str
    base: int
    size: int

    def span(self, obj: MemoryObj, view: memoryview) -> LentSpan | None:
        """Where `obj`'s bytes (`view`) lie in the file, if they lie in the buffer."""
        offset = obj.data_ptr - self.base
        return LentSpan(offset, view) if 0 <= offset and offset + len(view) <= self.size else None


def find_lent_buffer(local_cpu_backend: Any, config: Any, maps: str = "/proc/self/maps") -> LentBuffer | None:
    """LMCache's CPU buffer as a `LentBuffer`, or None: only when `extra_config.shm_name` is set
    and this process's memory map shows the buffer mapped from that file, from its first byte."""
    name = (getattr(config, "extra_config", None) or {}).get("shm_name")
    buffer = getattr(getattr(local_cpu_backend, "memory_allocator", None), "buffer", None)
    if not name or buffer is None or not hasattr(buffer, "data_ptr"):
        return None
    path = LENT_DIR + str(name).lstrip("/")
    base, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if size <= 0 or not _maps_file(maps, path, base, size):
        return None
    return LentBuffer(path, base, size)


def _maps_file(maps: str, path: str, base: int, size: int) -> bool:
    """Whether [base, base + size) is mapped from `path` at file offset (address - base)."""
    covered = base
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[5].rstrip("\n").removesuffix(" (deleted)") != path:
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo == covered and int(fields[2], 16) == lo - base:
                    covered = hi
    except (OSError, ValueError):
        return False
    return covered >= base + size


def make_key_secret(token: str | None) -> bytes:
    """The MAC key of block keys: derived from the tenant token (a fixed public key without one)."""
    return hashlib.blake2b((token or "").encode("utf-8"), digest_size=32, person=_PERSON_SECRET).digest()


def make_lmcache_block_key(key_string: str, namespace: str, key_secret: bytes) -> bytes:
    """32-byte block key of one LMCache chunk: keyed BLAKE2b over (namespace, key string)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, key=key_secret, person=_PERSON_KEY)
    ns = namespace.encode("utf-8")
    h.update(len(ns).to_bytes(4, "little"))
    h.update(ns)
    h.update(key_string.encode("utf-8"))
    return h.digest()


def make_namespace_fingerprint(namespace: str) -> bytes:
    return make_model_fingerprint({"lmcache_namespace": namespace}, {_KIND: int(Codec.RAW)}, _LAYOUT_VERSION,
                                  f"lmcache:{namespace}")


def pack_prefix(key_string: str, metadata: bytes) -> bytes:
    key = key_string.encode("utf-8")
    return _PREFIX.pack(PLUGIN_MAGIC, len(key), len(metadata)) + key + metadata


def unpack_prefix(buf: bytes | bytearray | memoryview) -> tuple[int, str, bytes] | None:
    """(prefix length, key string, metadata bytes), or None while `buf` is too short."""
    if len(buf) < _PREFIX.size:
        return None
    magic, key_len, meta_len = _PREFIX.unpack_from(buf)
    if magic != PLUGIN_MAGIC:
        raise RecordError(f"payload magic {bytes(magic)!r} is not an LMCache chunk")
    end = _PREFIX.size + key_len + meta_len
    if len(buf) < end:
        return None
    key = bytes(buf[_PREFIX.size:_PREFIX.size + key_len]).decode("utf-8")
    return end, key, bytes(buf[_PREFIX.size + key_len:end])


class _ChunkSink:
    """Where `get_payloads_into` puts fetched chunks: buffers allocated from LMCache's
    LocalCPUBackend once a record's header and prefix (key string, RemoteMetadata) are read.

    With LMCache's buffer lent to the server (`LentBuffer`), a full chunk's buffer is allocated
    before the call instead (`lent_destination`), and the server delivers the chunk's bytes
    straight into it; a record that turns out to be another shape gets a buffer of its own as
    above, and the one allocated ahead is released."""

    def __init__(self, connector: StateStoreConnector, keys: Sequence[CacheEngineKey]) -> None:
        self.connector = connector
        self.key_strings = [k.to_string() for k in keys]
        self.objs: list[MemoryObj | None] = [None] * len(keys)
        self.ahead: dict[int, tuple[MemoryObj, memoryview]] = {}  # allocated before the call (lent memory)

    def lent_destination(self, index: int) -> tuple[int, LentSpan] | None:
        """A full chunk's buffer, allocated now in LMCache's lent buffer: where the server may
        deliver record `index` if it is a full chunk (its encoded length is then known)."""
        c = self.connector
        if c.lent is None:
            return None
        obj = c.local_cpu_backend.allocate(c.meta_shapes, c.meta_dtypes, c.meta_fmt, busy_loop=False)
        if obj is None:
            return None
        view = memoryview(obj.byte_array).cast("B")
        span = c.lent.span(obj, view)
        if span is None or len(view) != c.full_chunk_size_bytes:
            obj.ref_count_down()
            return None
        self.ahead[index] = (obj, view)
        prefix = pack_prefix(self.key_strings[index], c.full_chunk_metadata)
        return HEADER_SIZE + len(prefix) + len(view), span

    def open(self, index: int, header: RecordHeader, head: memoryview) -> tuple[int, memoryview] | None:
        try:
            return self._open(index, header, head)
        except (RecordError, ValueError, struct.error) as exc:
            logger.warning("statestore: chunk %s discarded: %s", self.key_strings[index], exc)
            return None

    def _open(self, index: int, header: RecordHeader, head: memoryview) -> tuple[int, memoryview] | None:
        if header.kind != _KIND or header.model_fingerprint != self.connector.fingerprint:
            raise RecordError("not an LMCache chunk of this namespace")
        parsed = unpack_prefix(head)
        if parsed is None:
            raise RecordError(f"chunk prefix longer than {_HEAD_BYTES} bytes")
        prefix_len, key_string, meta_bytes = parsed
        if key_string != self.key_strings[index]:
            raise RecordError(f"record holds key {key_string!r}, asked for {self.key_strings[index]!r}")
        meta = RemoteMetadata.deserialize(meta_bytes)
        data_len = header.raw_length - prefix_len
        if meta.length != data_len:
            raise RecordError(f"metadata says {meta.length} bytes, record carries {data_len}")
        if index in self.ahead and meta_bytes == self.connector.full_chunk_metadata:
            obj, dest = self.ahead.pop(index)  # a full chunk: the buffer allocated for it (it may hold it already)
            self.objs[index] = obj
            return prefix_len, dest
        # (a buffer allocated ahead for another shape stays allocated until the call is over: the
        # server may have delivered into it, and the rest is copied from there)
        obj = self.connector.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt, busy_loop=False)
        if obj is None:
            raise RecordError("LMCache's local CPU buffer is full")
        dest = memoryview(obj.byte_array).cast("B")
        if len(dest) != data_len:
            obj.ref_count_down()
            raise RecordError(f"LMCache allocated {len(dest)} bytes for a {data_len}-byte chunk")
        self.objs[index] = obj
        return prefix_len, dest

    def close(self, index: int, ok: bool) -> None:
        obj = self.objs[index]
        if not ok and obj is not None:
            self.objs[index] = None
            obj.ref_count_down()

    def release_all(self) -> None:
        for i in range(len(self.objs)):
            self.close(i, False)
        self.release_ahead()

    def release_ahead(self) -> None:
        """Buffers allocated ahead for records that were misses or never opened."""
        for obj, _ in self.ahead.values():
            obj.ref_count_down()
        self.ahead.clear()


class StateStoreConnector(RemoteConnector):
    """LMCache `RemoteConnector` over a statestore server (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any,
                 plugin_name: str | None = None) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = getattr(config, "extra_config", None) or {}
        self.plugin_name = plugin_name or find_plugin_name(getattr(config, "remote_storage_plugins", None), extra)
        self.settings = ConnectorSettings.from_extra_config(extra, self.plugin_name)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.fingerprint = make_namespace_fingerprint(self.settings.namespace)
        self._key_secret = make_key_secret(self.settings.token)
        self._client: StateStoreClient | None = None
        self._registered = False
        self.lent = find_lent_buffer(local_cpu_backend, config)  # LMCache's buffer in shared memory
        self.full_chunk_metadata = RemoteMetadata(self.full_chunk_size_bytes, self.meta_shapes, self.meta_dtypes,
                                                  self.meta_fmt).serialize()
        self._down_until = 0.0
        self._backoff_s = self.settings.backoff_s
        self.num_failures = 0  # calls that failed (each answered as a miss or a dropped put)
        logger.info("statestore connector %s: target %s, namespace %s, durability %s", self.plugin_name,
                    self.settings.target, self.settings.namespace, self.settings.durability.name.lower())

    # ----- keys ----------------------------------------------------------------------------------

    def record_key(self, key: CacheEngineKey) -> bytes:
        return make_record_key(_KIND, make_lmcache_block_key(key.to_string(), self.settings.namespace,
                                                             self._key_secret))

    # ----- connection, backoff ---------------------------------------------------------------------

    def _open(self) -> StateStoreClient:
        """The client, opened on the running (LMCache's) loop: grpc.aio binds a channel to its loop."""
        if self._client is None:
            s = self.settings
            client = StateStoreClient(s.target, s.token, ClientOptions(
                chunk_bytes=s.frame_bytes, max_message_bytes=s.frame_bytes + (64 << 10), timeout_s=s.timeout_s,
                shm_bytes=s.shm_bytes,
                extra_options=[("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                               ("grpc.max_reconnect_backoff_ms", 1000)]))
            client.open()
            if self.lent is not None:
                try:
                    client.lend_shared_memory(self.lent.path)
                except (OSError, ShmUnavailable) as exc:
                    logger.warning("statestore: LMCache's buffer %s cannot be lent (%s): chunks are copied",
                                   self.lent.path, exc)
                    self.lent = None
            self._client = client
        return self._client

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        self.num_failures += 1
        first = self.available()
        self._down_until = time.monotonic() + self._backoff_s
        if first:
            logger.warning("statestore %s at %s failed (%s); answering misses for %.1f s", what,
                           self.settings.target, _why(exc), self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, self.settings.max_backoff_s)

    def _ok(self) -> None:
        self._backoff_s = self.settings.backoff_s

    async def _guarded(self, what: str, call: Awaitable[T], default: T, timeout_s: float | None = None) -> T:
        """`call`'s result, or `default` (and a backoff) when statestore fails; never raises."""
        if not self.available():
            _close_unawaited(call)
            return default
        try:
            result = await (asyncio.wait_for(call, timeout_s) if timeout_s else call)
        except (ServiceError, grpc.aio.AioRpcError, asyncio.TimeoutError, OSError, ValueError) as exc:
            self._failed(what, exc)
            return default
        except Exception as exc:  # noqa: BLE001 - the LMCache boundary: a miss, never an exception
            logger.error("statestore %s: unexpected %s", what, _why(exc), exc_info=True)
            self._failed(what, exc)
            return default
        self._ok()
        return result

    async def _register(self) -> None:
        if not self._registered:
            await self._open().register_model(
                model_name=f"lmcache/{self.settings.namespace}", weights_id=f"lmcache:{self.settings.namespace}",
                config_json=json.dumps({"lmcache_namespace": self.settings.namespace}),
                layout_version=_LAYOUT_VERSION, specs=[{"kind": _KIND, "retention": 1, "codec": int(Codec.RAW)}])
            self._registered = True

    def _run_sync(self, coro: Awaitable[T], default: T, timeout_s: float) -> T:
        """Run one of our coroutines on LMCache's loop from another thread and wait."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # blocking here would deadlock the loop we wait on
            _close_unawaited(coro)
            logger.warning("statestore: synchronous call on LMCache's event loop thread; answering a miss")
            return default
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout_s + 1.0)
        except Exception as exc:  # noqa: BLE001 - the LMCache boundary: a miss, never an exception
            future.cancel()
            self._failed("synchronous call", exc)
            return default

    # ----- contains ------------------------------------------------------------------------------

    async def _prefix_hits(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many keys, from the first, statestore holds (one Lookup per 64K keys)."""
        block_keys = [self.record_key(k)[2:] for k in keys]
        lookup = self._open().count_prefix(block_keys, _KIND, model_fingerprint=self.fingerprint)
        return await self._guarded("lookup", lookup, 0, self.settings.lookup_timeout_s)

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._prefix_hits([key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._run_sync(self.exists(key), False, self.settings.lookup_timeout_s)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._run_sync(self._prefix_hits(keys), 0, self.settings.lookup_timeout_s)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        return await self._prefix_hits(keys)

    # ----- put -----------------------------------------------------------------------------------

    def _payload(self, key: CacheEngineKey, obj: MemoryObj) -> PayloadPut:
        """One chunk as a record: header, then the prefix and LMCache's buffer as they are (no copy)."""
        buf = memoryview(obj.byte_array).cast("B")
        meta = RemoteMetadata(len(buf), obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()).serialize()
        prefix = pack_prefix(key.to_string(), meta)
        header = RecordHeader(kind=_KIND, codec=int(Codec.RAW), model_fingerprint=self.fingerprint,
                              tenant_id=bytes(TENANT_BYTES), block_key=self.record_key(key)[2:],
                              entry_count=len(buf) // self.single_token_size if self.single_token_size else 0,
                              raw_length=len(prefix) + len(buf))
        span = self.lent.span(obj, buf) if self.lent is not None else None
        return PayloadPut(header, (prefix, span if span is not None else buf))

    async def _put_batch(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        items = [self._payload(k, o) for k, o in zip(keys, objs)]
        client = self._open()
        await self._register()
        try:
            await client.put_payloads(items, self.settings.durability)
        except ServiceError as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self._registered = False  # the server restarted and forgot the namespace: register, retry once
            await self._register()
            await client.put_payloads(items, self.settings.durability)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]) -> None:
        """Store chunks, several per PutRecords stream; a failure drops them (logged), never raises."""
        start, size = 0, 0
        for i, obj in enumerate(memory_objs):
            size += obj.get_size()
            if size >= self.settings.max_batch_bytes or i == len(memory_objs) - 1:
                await self._guarded("put", self._put_batch(keys[start:i + 1], memory_objs[start:i + 1]), None)
                start, size = i + 1, 0

    # ----- get -----------------------------------------------------------------------------------

    async def _fetch(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """The chunks (None for a miss); all None when statestore fails."""
        sink = _ChunkSink(self, keys)
        got = await self._guarded("get", self._fetch_into(keys, sink), None)
        sink.release_ahead()
        return sink.objs if got is not None else [None] * len(keys)

    async def _fetch_into(self, keys: Sequence[CacheEngineKey], sink: _ChunkSink) -> list[bool]:
        try:
            return await self._open().get_payloads_into([self.record_key(k) for k in keys], sink,
                                                          head_bytes=_HEAD_BYTES)
        except BaseException:
            sink.release_all()  # a failed call delivers nothing: no buffer stays allocated
            raise

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self._fetch([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self._fetch(keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The hit prefix; everything after the first miss is released."""
        prefix: list[MemoryObj] = []
        missed = False
        for obj in await self._fetch(keys):
            missed = missed or obj is None
            if obj is not None and missed:
                obj.ref_count_down()
            elif obj is not None:
                prefix.append(obj)
        return prefix

    # ----- list, remove, ping, close -------------------------------------------------------------

    async def _key_string(self, record_key: bytes) -> str | None:
        """The LMCache key inside one record: reads only its header and prefix."""
        head = await self._open().read_head(record_key, _HEAD_BYTES)
        parsed = unpack_prefix(head[1]) if head is not None else None
        return parsed[1] if parsed is not None else None

    async def _list(self) -> list[str]:
        infos, _ = await self._open().list_records(kind=_KIND, limit=100_000)
        mine = [i.key for i in infos if i.model_fingerprint == self.fingerprint]
        limit = asyncio.Semaphore(_LIST_CONCURRENCY)

        async def one(key: bytes) -> str | None:
            async with limit:
                return await self._key_string(key)

        names = await asyncio.gather(*(one(k) for k in mine))
        return [n for n in names if n is not None]

    async def list(self) -> list[str]:
        """The LMCache keys of this namespace that statestore holds (reads each record's first frame)."""
        return await self._guarded("list", self._list(), [])

    async def _remove(self, key: CacheEngineKey) -> bool:
        evicted = await self._open().evict([self.record_key(key)], force=True)
        return any(evicted.values())

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self._run_sync(self._guarded("remove", self._remove(key), False), False, self.settings.timeout_s)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when statestore answers SERVING, else 1."""
        status = await self._guarded("ping", self._open().health(), "", self.settings.lookup_timeout_s)
        return 0 if status == "SERVING" else 1

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def __repr__(self) -> str:
        return f"<StateStoreConnector {self.settings.target} namespace={self.settings.namespace}>"


def _why(exc: BaseException) -> str:
    if isinstance(exc, ServiceError):
        return f"{exc.code.name}: {exc.message}"
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _close_unawaited(call: Awaitable[Any]) -> None:
    close = getattr(call, "close", None)
    if close is not None:
        close()
