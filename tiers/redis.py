"""The Redis tier: one record per key, shared by every node; outages degrade to misses.

Key layout::

    {prefix}:{<64 hex block key>}:<kind code>      value = the encoded record, whole

The `{...}` part is the Redis Cluster hash tag: only the block key decides the slot, so
every kind stored for one block (global KV, index K, SWA ring, compressor tail) lives on
the same shard. Loading a block is then one node round trip and multi-key commands over
its kinds are legal in a Cluster, while different blocks (and sessions) still spread over
all shards. The value is the self-describing record, so there is no metadata key that can
dangle without its data, and a value is verified (`decode_record(expect_key=...)`) on
every read: a corrupt one is deleted and reported as a miss.

Writes on standalone Redis send each SET themselves (`_send_sets`: RESP packed by hand on a
connection of the client's pool), so that the value goes out as two buffers, the encoded
header and the caller's payload, joined only by the socket write that joins every command
anyway: no header+payload copy of the record per put (a 4 MiB record paid ~1 ms for it).
On a Cluster, where the client must route every key, the value is concatenated and SET
through the client (pipelined for batches).

Reads go through the tier's own reader (`tiers.redis_bulk`; not on TLS URLs): GET and MGET on a
few connections of its own, each value landing in a buffer of exactly its size, which the
record keeps as its payload (a read-only view): no copy in the client. redis-py's reply path
copies a large value several times (32 MiB: ~80 ms against ~30 read in place on the
development VM). On a Cluster each node gets a reader; redis-py's slot map says which node
holds a key, and a redirect or an unreachable node sends that call through redis-py, which
follows it and refreshes the map.

Outages: every call goes through `_attempt`. A connection error or timeout (socket timeout
0.5 s by default, no client retries) turns into a miss / False, sets `healthy` to False and
starts a cooldown during which calls return at once without touching the network, so a dead
Redis costs nothing per call; the first call after the cooldown tries again, and the first
success sets `healthy` back to True. `probe` is such a call (a PING) for a node with no
traffic: the server probes tiers that are down once a second, so `healthy` comes back on its
own. Callers never see an exception from this tier.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from redis import exceptions as rex
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tiers import redis_bulk
from tiers.base import KindUsage, ScanResult, Tier, TierUsage
from tiers.record import (
    HEADER_SIZE,
    KEY_BYTES,
    RECORD_KEY_BYTES,
    HeaderCache,
    Record,
    RecordError,
    RecordHeader,
    RecordKey,
    decode_header,
    decode_record,
    encode_header,
    encode_record,
    make_record_key,
)

if TYPE_CHECKING:
    from tiers.registry import TierConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

CLUSTER_SCHEME = "redis+cluster://"
# Estimated Redis memory per key beyond the key and value bytes (dict entry, robj, sds
# headers, jemalloc rounding); an expiry adds an entry in the expires dict. An estimate:
# Redis memory is shared with every other client and we cannot see our share exactly.
PER_KEY_OVERHEAD_BYTES = 64
PER_EXPIRY_OVERHEAD_BYTES = 32
# Encode/verify values at least this large in a worker thread. Below it the work (a checksum
# and one copy: ~1 ms at 8 MiB) costs less than the thread hop, as redis-py's own parsing of
# the reply does on the loop; above it the loop is kept free.
OFFLOAD_BYTES = 8 << 20
# A SET batch larger than SEND_WHOLE_MAX_BYTES is written in groups of SEND_GROUP_BYTES, each
# drained before the next (`_write_groups`). One write of a large value left most of it in
# asyncio's transport buffer, trimmed from the front after every partial send (a memmove of the
# rest each time): on the development VM (Python 3.11, loopback Redis 7) a 32 MiB SET on a bare
# asyncio stream took 70 ms written whole and 26 ms in 1 MiB groups, and the tier's puts
# (`bench.tiers --sizes 16M,32M`, two alternations) went 0.87-0.90 -> 1.35-1.47 GB/s at 32 MiB
# and 0.96-1.03 -> 1.19-1.40 at 16 MiB (raw redis-py SETs: 0.83-1.22). Smaller batches are
# written at once: each group is a call with its own timeout task and drain, and 1 MiB groups
# cost a 4 MiB put up to a quarter (0.97 -> 0.70-0.72 of raw SET in two full runs).
SEND_GROUP_BYTES = 1 << 20
SEND_WHOLE_MAX_BYTES = 8 << 20
# Without the tier's own reader (`bulk_reads=False`, or a TLS URL), a GET of a value the tier
# knows to be at least RANGED_GET_MIN_BYTES long (standalone Redis) reads it as GETRANGE pieces of
# RANGE_BYTES in one MULTI/EXEC (`_get_ranged`): redis-py reads a bulk reply into an asyncio
# StreamReader buffer that grows by reallocation, copying what it holds each time, while
# pieces keep that buffer small. A 32 MiB value on the development VM:
# 81.7 -> 48.6 ms with glibc's default thresholds, 46.2 -> 26.9 ms with the server's
# (`statestore.allocator`, large buffers kept in the heap).
RANGED_GET_MIN_BYTES = 8 << 20
RANGE_BYTES = 1 << 20
BULK_CONNECTIONS = 16  # the own reader's connections at most (`tiers.redis_bulk`), per node on a Cluster
# On a Cluster, get_many reads values the tier knows to be at least this large through their
# nodes' readers (a call each); smaller ones go in one redis-py pipeline.
CLUSTER_READER_MIN_BYTES = 64 << 10
NAME_CACHE_ENTRIES = 1 << 16  # Redis key names kept per tier (`redis_key`): ~10 MB at most
SCAN_BATCH = 512

# Errors that mean "Redis is not there right now": cooldown, not a per-call warning.
_OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    rex.ConnectionError,  # includes BusyLoadingError (a restarting server loading its data)
    rex.TimeoutError,
    rex.ClusterError,  # includes ClusterDownError, MasterDownError
    rex.TryAgainError,
    rex.RedisClusterException,  # no reachable node, slot not covered
    OSError,
    asyncio.TimeoutError,
)

# Only deletes the value if it is still the corrupt one we read (a concurrent put wins).
_DELETE_IF_EQUAL = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


@dataclass(slots=True)
class _KindTally:
    num_records: int = 0
    payload_bytes: int = 0
    overhead_bytes: int = 0


class _Unavailable:
    """Result of a call that did not reach Redis (outage, cooldown or error)."""


UNAVAILABLE = _Unavailable()


class RedisTier(Tier):
    """Records in Redis (standalone or Cluster) under `prefix`.

    Args:
        url: `redis://host:port/db` (standalone) or `redis+cluster://host:port` (any node
            of a Cluster; `cluster=True` does the same with a `redis://` URL).
        prefix: key namespace; must not contain `{` or `}` (it would steal the hash tag).
        ttl_s: expiry of every record written (None: no expiry).
        budget_bytes: 0 = unbounded; else `put` refuses what would exceed the estimate.
        zstd_kinds: kind code -> zstd level (default none, see SSDTier).
        socket_timeout_s: per-operation socket timeout (connect and read).
        bulk_reads: read GET and MGET replies with the tier's own reader (`tiers.redis_bulk`:
            each value lands in a buffer of its own, no copies in the client) where the URL
            allows it (not TLS; on a Cluster, one reader per node); False: through redis-py
            like every other call.
        cooldown_s / max_cooldown_s: after a failure, skip calls this long; doubles per
            consecutive failure up to the maximum.

    `usage()` counts the records this client wrote, read or scanned (value bytes as payload;
    key length plus an estimated per-key overhead as overhead). It is an estimate: Redis
    memory is shared, and keys that expired or were written by other nodes are only
    learned when touched or scanned.
    """

    name = "redis"

    def __init__(self, url: str, *, prefix: str = "ss", ttl_s: int | None = None, budget_bytes: int = 0,
                 cluster: bool | None = None, zstd_kinds: dict[int, int] | None = None,
                 socket_timeout_s: float = 0.5, cooldown_s: float = 0.5, max_cooldown_s: float = 5.0,
                 max_connections: int = 64, bulk_reads: bool = True) -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"redis prefix {prefix!r} must be non-empty and free of '{{' and '}}'")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._budget_bytes = budget_bytes
        self._zstd_kinds = dict(zstd_kinds or {})
        self._cooldown_s = cooldown_s
        self._max_cooldown_s = max_cooldown_s
        self._cluster = url.startswith(CLUSTER_SCHEME) if cluster is None else cluster
        self._client = _make_client(url, self._cluster, socket_timeout_s, max_connections)
        self._url = _plain_url(url)
        readable = bulk_reads and redis_bulk.supports(self._url)
        self._reader_options = dict(socket_timeout_s=socket_timeout_s,
                                    max_connections=min(max_connections, BULK_CONNECTIONS))
        self._bulk = redis_bulk.BulkReader(self._url, **self._reader_options) if readable and not self._cluster else None
        # a Cluster's nodes, each read by a reader of its own (`_cluster_get`), made when first needed
        self._node_readers: dict[tuple[str, int], redis_bulk.BulkReader] | None = \
            {} if readable and self._cluster else None
        self._key_re = re.compile(rf"^{re.escape(prefix)}:\{{([0-9a-f]{{{2 * KEY_BYTES}}})\}}:(\d+)$")
        self._healthy = True
        self._current_cooldown_s = cooldown_s
        self._skip_until = 0.0
        self._known: dict[RecordKey, tuple[int, int]] = {}  # key -> (kind, value bytes)
        # hot records' headers, decoded once (gets of the same records skip the header parse)
        self._headers = HeaderCache()
        self._names: dict[bytes, str] = {}  # record key -> Redis key name (`redis_key`)
        self._tally: dict[int, _KindTally] = {}
        self._resident_bytes = 0

    @classmethod
    def from_config(cls, config: TierConfig) -> RedisTier:
        if not config.url:
            raise ValueError(f"tier {config.name!r}: the redis tier needs a url")
        return cls(config.url, prefix=config.prefix, ttl_s=config.ttl_s, budget_bytes=config.budget_bytes,
                   zstd_kinds=config.zstd_kinds, **config.options)

    async def aclose(self) -> None:
        readers = [self._bulk] if self._bulk is not None else []
        readers += (self._node_readers or {}).values()
        for reader in readers:
            await reader.aclose()
        await self._client.aclose()

    @property
    def bulk_reads(self) -> bool:
        """Whether GETs go through the tier's own reader (`tiers.redis_bulk`)."""
        return self._bulk is not None or self._node_readers is not None

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def cluster(self) -> bool:
        return self._cluster

    # ----- keys -------------------------------------------------------------------------

    def redis_key(self, key: RecordKey) -> str:
        """`{prefix}:{<64 hex block key>}:<kind>` (what split_record_key would give, without
        building its parts: this runs for every key of every call, so names are kept for the
        keys seen last, up to NAME_CACHE_ENTRIES)."""
        name = self._names.get(key)
        if name is None:
            if len(key) != RECORD_KEY_BYTES:
                raise ValueError(f"record key must be {RECORD_KEY_BYTES} bytes, got {len(key)}")
            name = f"{self._prefix}:{{{key[2:].hex()}}}:{(key[0] << 8) | key[1]}"
            if len(self._names) >= NAME_CACHE_ENTRIES:
                self._names.clear()  # a crude bound: the hot keys come back at once
            self._names[bytes(key)] = name
        return name

    def record_key(self, redis_key: str | bytes) -> RecordKey | None:
        """Inverse of `redis_key`; None for a key name that is not one of ours."""
        name = redis_key.decode("ascii", "replace") if isinstance(redis_key, bytes) else redis_key
        m = self._key_re.match(name)
        if m is None or int(m[2]) > 0xFFFF:
            return None
        return make_record_key(int(m[2]), bytes.fromhex(m[1]))

    # ----- the outage boundary ----------------------------------------------------------

    async def _attempt(self, op: str, call: Callable[[], Awaitable[T]]) -> T | _Unavailable:
        """Run one Redis call; any Redis trouble becomes UNAVAILABLE, never an exception."""
        if not self._healthy and time.monotonic() < self._skip_until:
            return UNAVAILABLE
        try:
            result = await call()
        except _OUTAGE_ERRORS as exc:
            self._mark_down(op, exc)
            return UNAVAILABLE
        except rex.RedisError as exc:  # e.g. OOM on a full Redis: an answer, not an outage
            logger.warning("redis %s refused: %s", op, exc, exc_info=True)
            self._mark_up()
            return UNAVAILABLE
        self._mark_up()
        return result

    def _mark_down(self, op: str, exc: BaseException) -> None:
        if self._healthy:
            logger.warning("redis unavailable (%s: %s); degrading to misses, retry in %.2fs",
                           op, exc, self._cooldown_s)
            self._current_cooldown_s = self._cooldown_s
        else:
            self._current_cooldown_s = min(self._max_cooldown_s, 2 * self._current_cooldown_s)
        logger.debug("redis %s failed", op, exc_info=True)
        self._healthy = False
        self._skip_until = time.monotonic() + self._current_cooldown_s

    def _mark_up(self) -> None:
        if not self._healthy:
            logger.warning("redis answers again; tier healthy")
        self._healthy = True

    async def probe(self) -> bool:
        """PING once the cooldown after the last failure has passed (before it: no call)."""
        if not self._healthy:
            await self._attempt("ping", self._client.ping)
        return self._healthy

    async def check_health(self) -> bool:
        """PING now, ignoring the cooldown; updates and returns `healthy`."""
        self._skip_until = 0.0
        await self._attempt("ping", self._client.ping)
        return self._healthy

    # ----- accounting -------------------------------------------------------------------

    def _overhead(self, key: RecordKey) -> int:
        """Key length plus the per-key estimate; the length of `redis_key(key)`, computed
        without building it (this runs for every record read or written)."""
        kind = (key[0] << 8) | key[1]
        key_len = len(self._prefix) + 4 + 2 * KEY_BYTES + len(str(kind))  # "p:{hex}:kind"
        expiry = PER_EXPIRY_OVERHEAD_BYTES if self._ttl_s is not None else 0
        return key_len + PER_KEY_OVERHEAD_BYTES + expiry

    def footprint(self, record: Record) -> int:
        level = self._zstd_kinds.get(record.header.kind)
        value_bytes = HEADER_SIZE + len(record.payload) if level is None else len(
            encode_record(record, zstd_level=level))
        return value_bytes + self._overhead(record.key)

    def _track(self, key: RecordKey, kind: int, value_bytes: int) -> None:
        if self._known.get(key) == (kind, value_bytes):
            return  # a re-read of what we already count
        self._untrack(key)
        self._known[key] = (kind, value_bytes)
        self._count(key, kind, value_bytes, +1)

    def _untrack(self, key: RecordKey) -> None:
        known = self._known.pop(key, None)
        if known is not None:
            self._count(key, *known, -1)

    def _count(self, key: RecordKey, kind: int, value_bytes: int, sign: int) -> None:
        tally = self._tally.setdefault(kind, _KindTally())
        overhead = self._overhead(key)
        tally.num_records += sign
        tally.payload_bytes += sign * value_bytes
        tally.overhead_bytes += sign * overhead
        self._resident_bytes += sign * (value_bytes + overhead)
        if not tally.num_records:
            del self._tally[kind]

    def usage(self) -> TierUsage:
        by_kind = {kind: KindUsage(t.num_records, t.payload_bytes, t.overhead_bytes)
                   for kind, t in self._tally.items()}
        return TierUsage(self.name, self._budget_bytes, by_kind, healthy=self._healthy)

    def _fits(self, record_key: RecordKey, value_bytes: int) -> bool:
        if not self._budget_bytes:
            return True
        old = self._known.get(record_key)
        freed = old[1] + self._overhead(record_key) if old else 0
        need = value_bytes + self._overhead(record_key)
        return self._resident_bytes - freed + need <= self._budget_bytes

    # ----- encode / decode --------------------------------------------------------------

    def _encode_parts_sync(self, record: Record) -> tuple[bytes, bytes]:
        """(header, stored payload): the value is their concatenation."""
        level = self._zstd_kinds.get(record.header.kind)
        if level is not None:
            value = encode_record(record, zstd_level=level)
            return value[:HEADER_SIZE], value[HEADER_SIZE:]
        payload = record.payload
        return encode_header(record.header, stored_length=len(payload), flags=0,
                             checksum=record.payload_sum()), payload

    async def _encode_parts(self, record: Record) -> tuple[bytes, bytes]:
        if len(record.payload) >= OFFLOAD_BYTES:
            return await asyncio.to_thread(self._encode_parts_sync, record)
        return self._encode_parts_sync(record)

    async def _decode(self, value: bytes | memoryview, key: RecordKey) -> Record:
        keep_view = type(value) is memoryview  # read in place (`redis_bulk`): the payload stays a view
        if len(value) >= OFFLOAD_BYTES:  # off the loop; the header cache stays on it
            return await asyncio.to_thread(decode_record, value, expect_key=key, keep_view=keep_view)
        return decode_record(value, expect_key=key, headers=self._headers, keep_view=keep_view)

    async def _verified(self, key: RecordKey, value: bytes | memoryview | None) -> Record | None:
        """Decode a value read from Redis; a corrupt one is deleted and becomes a miss."""
        if value is None:
            self._untrack(key)
            return None
        try:
            record = await self._decode(value, key)
        except RecordError as exc:
            logger.warning("redis value of %s is corrupt (%s): deleted, reported as a miss", key.hex(), exc)
            rkey = self.redis_key(key)
            await self._attempt("delete corrupt", lambda: self._client.eval(_DELETE_IF_EQUAL, 1, rkey, value))
            self._untrack(key)
            return None
        self._track(key, record.header.kind, len(value))
        return record

    # ----- operations -------------------------------------------------------------------

    async def put(self, record: Record) -> bool:
        return (await self.put_many([record]))[0]

    async def put_many(self, records: Sequence[Record]) -> list[bool]:
        """The records that fit the budget, SET in one round trip (see `_send_sets`)."""
        parts = [await self._encode_parts(r) for r in records]
        sizes = [len(head) + len(stored) for head, stored in parts]
        fits = [self._fits(r.key, n) for r, n in zip(records, sizes)]
        todo = [(self.redis_key(r.key), head, stored) for r, (head, stored), ok in zip(records, parts, fits) if ok]
        if len(todo) < len(records):
            logger.debug("redis put refused %d of %d records: they do not fit the budget of %d",
                         len(records) - len(todo), len(records), self._budget_bytes)
        if not todo:
            return [False] * len(records)
        replies = await self._attempt("put", lambda: self._send_sets(todo))
        if replies is UNAVAILABLE:
            return [False] * len(records)
        stored_ok = iter(replies)
        out = []
        for r, n, ok in zip(records, sizes, fits):
            done = ok and bool(next(stored_ok))
            if done:
                self._track(r.key, r.header.kind, n)
            out.append(done)
        return out

    async def _send_sets(self, items: Sequence[tuple[str, bytes, bytes]]) -> list[Any]:
        """SET name = header + payload for each item; the replies in order.

        Standalone: every command packed here (RESP) and written on one pooled connection, at
        once or, for a batch over `SEND_WHOLE_MAX_BYTES`, in groups of about `SEND_GROUP_BYTES`
        (the header and the payload as separate buffers, a large payload sliced, no copy made
        here), then one reply read per command. A failure anywhere disconnects the connection
        (replies may be left unread) and propagates to `_attempt`. Cluster: a pipeline of SETs
        of the concatenated value.
        """
        if self._cluster:
            pipe = self._client.pipeline(transaction=False)
            for name, head, stored in items:
                pipe.set(name, head + stored, ex=self._ttl_s)
            return await pipe.execute()
        pool = self._client.connection_pool
        conn = await pool.get_connection()
        try:
            chunks: list[bytes | memoryview] = []
            for name, head, stored in items:
                chunks += _pack_set(name.encode(), head, stored, self._ttl_s)
            total = sum(len(chunk) for chunk in chunks)
            groups = [chunks] if total <= SEND_WHOLE_MAX_BYTES else _write_groups(chunks, SEND_GROUP_BYTES)
            for i, group in enumerate(groups):
                await conn.send_packed_command(group, check_health=i == 0)
            return [await conn.read_response() for _ in items]
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    async def get(self, key: RecordKey) -> Record | None:
        name = self.redis_key(key)
        bulk = self._bulk
        if bulk is not None:
            value = await self._attempt("get", lambda: bulk.get(name))
        elif self._node_readers is not None:
            value = await self._attempt("get", lambda: self._cluster_get(name))
        elif not self._cluster and self._known.get(key, (0, 0))[1] >= RANGED_GET_MIN_BYTES:
            size = self._known[key][1]
            value = await self._attempt("get", lambda: self._get_ranged(name, size))
        else:
            value = await self._attempt("get", lambda: self._client.get(name))
        if value is UNAVAILABLE:
            return None
        return await self._verified(key, value)

    async def _cluster_get(self, name: str) -> Any:
        """GET on a Cluster through the reader of the node that redis-py's slot map names. A node
        that redirects (MOVED / ASK: the slot moved since the map was read) or cannot be reached
        (a failover) sends the call through redis-py, which follows the redirect or finds the new
        owner and refreshes its map, so the next call goes straight to the right node."""
        client = self._client
        await client.initialize()  # the slot map, read once (a no-op afterwards)
        node = client.get_node_from_key(name)
        readers = self._node_readers
        assert readers is not None
        reader = readers.get((node.host, node.port))
        if reader is None:
            reader = readers[(node.host, node.port)] = redis_bulk.BulkReader(
                self._url, host=node.host, port=node.port, **self._reader_options)
        try:
            return await reader.get(name)
        except rex.ResponseError as exc:
            if not str(exc).startswith(("MOVED ", "ASK ")):
                raise
            logger.debug("redis cluster: %s:%s answered %s; reading through redis-py", node.host, node.port, exc)
        except rex.ConnectionError as exc:
            logger.debug("redis cluster: %s:%s unreachable (%s); reading through redis-py", node.host, node.port, exc)
        return await client.get(name)

    async def _cluster_get_many(self, keys: Sequence[RecordKey], names: Sequence[str]) -> list[Any]:
        """GETs on a Cluster: values the tier knows to be CLUSTER_READER_MIN_BYTES or larger
        through their nodes' readers, all at once (`_cluster_get`); the rest in one pipeline of
        GETs through redis-py, where the replies of small values cost less than a call each."""
        is_large = [self._known.get(k, (0, 0))[1] >= CLUSTER_READER_MIN_BYTES for k in keys]
        large = [i for i, big in enumerate(is_large) if big]
        small = [i for i, big in enumerate(is_large) if not big]
        reads = [self._cluster_get(names[i]) for i in large]
        if small:
            pipe = self._client.pipeline(transaction=False)
            for i in small:
                pipe.get(names[i])
            reads.append(pipe.execute())
        results = await asyncio.gather(*reads, return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:  # every read finished: the first failure fails the call
            raise failed
        values = dict(zip(large, results))
        if small:
            values.update(zip(small, results[-1]))
        return [values[i] for i in range(len(keys))]

    async def _get_ranged(self, name: str, size: int) -> bytes | None:
        """The value of `name`, expected `size` bytes long, read as GETRANGE pieces and its
        STRLEN in one transaction (so the pieces are of one value); None if the key is gone.
        A value of another length (replaced since the tier learned its size) is read whole."""
        pipe = self._client.pipeline(transaction=True)
        for offset in range(0, size, RANGE_BYTES):
            pipe.getrange(name, offset, min(size, offset + RANGE_BYTES) - 1)
        pipe.strlen(name)
        *pieces, length = await pipe.execute()
        if length == size:
            return b"".join(pieces)
        return None if length == 0 else await self._client.get(name)

    async def get_many(self, keys: Sequence[RecordKey]) -> list[Record | None]:
        """MGET on standalone Redis; on a Cluster (keys span slots) GETs, large values through
        their nodes' readers and the rest in a pipeline (`_cluster_get_many`)."""
        if not keys:
            return []
        rkeys = [self.redis_key(k) for k in keys]
        bulk = self._bulk
        if bulk is not None:
            async def run() -> list[Any]:
                return await bulk.mget(rkeys)
        elif self._node_readers is not None:
            async def run() -> list[Any]:
                return await self._cluster_get_many(keys, rkeys)
        elif self._cluster:
            async def run() -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for rk in rkeys:
                    pipe.get(rk)
                return await pipe.execute()
        else:
            async def run() -> list[Any]:
                return await self._client.mget(rkeys)
        values = await self._attempt("get_many", run)
        if values is UNAVAILABLE:
            return [None] * len(keys)
        out: list[Record | None] = []
        known = self._known.get
        small = [v if v is None or len(v) < OFFLOAD_BYTES else None for v in values]  # decoded on the loop
        for k, v, got in zip(keys, values, self._headers.decode_many(small, keys)):
            if type(got) is Record:  # the common case, without a coroutine per value
                if known(k) != (got.header.kind, len(v)):  # `_track`'s test, without its call
                    self._track(k, got.header.kind, len(v))
                out.append(got)
            else:  # a miss, a large value (decoded off the loop), or one that did not decode
                out.append(await self._verified(k, v))  # logs and deletes a corrupt value
        return out

    async def delete(self, key: RecordKey) -> bool:
        removed = await self._attempt("delete", lambda: self._client.delete(self.redis_key(key)))
        if removed is UNAVAILABLE:
            return False
        self._untrack(key)
        return bool(removed)

    async def contains(self, keys: Sequence[RecordKey]) -> list[bool]:
        """One pipeline of EXISTS. During an outage every key is reported absent."""
        if not keys:
            return []

        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.redis_key(k))
            return await pipe.execute()

        replies = await self._attempt("contains", run)
        if replies is UNAVAILABLE:
            return [False] * len(keys)
        present = [bool(n) for n in replies]
        for k, there in zip(keys, present):
            if not there:
                self._untrack(k)  # expired or deleted by another node
        return present

    async def scan(self) -> ScanResult:
        """SCAN our prefix, read each header (GETRANGE) and value size (STRLEN), learn them.

        Values whose header is corrupt, foreign to the key name, or whose size disagrees
        with the header are deleted and reported.
        """
        pattern = _glob_escape(self._prefix) + ":{*}:*"

        async def list_keys() -> list[bytes]:
            return [k async for k in self._client.scan_iter(match=pattern, count=1000)]

        names = await self._attempt("scan", list_keys)
        if names is UNAVAILABLE:
            return ScanResult([], ["redis unavailable: scan skipped"])
        headers, discarded = [], []
        for start in range(0, len(names), SCAN_BATCH):
            batch = names[start: start + SCAN_BATCH]
            found = await self._scan_batch(batch, discarded)
            if found is None:
                discarded.append("redis became unavailable during the scan; it is incomplete")
                break
            headers.extend(found)
        return ScanResult(headers, discarded)

    async def _scan_batch(self, names: list[bytes], discarded: list[str]) -> list[RecordHeader] | None:
        async def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.getrange(name, 0, HEADER_SIZE - 1)
                pipe.strlen(name)
            return await pipe.execute()

        replies = await self._attempt("scan", run)
        if replies is UNAVAILABLE:
            return None
        headers = []
        for i, name in enumerate(names):
            head, size = replies[2 * i], replies[2 * i + 1]
            key = self.record_key(name)
            if key is None:
                discarded.append(f"{name!r}: not a record key of prefix {self._prefix!r} (left alone)")
                continue
            header, problem = _check_header(head, size, key)
            if header is None:
                discarded.append(f"{name.decode()}: {problem} (deleted)")
                await self._attempt("delete corrupt", lambda: self._client.delete(name))
                continue
            self._track(key, header.kind, size)
            headers.append(header)
        return headers


def _write_groups(chunks: Sequence[bytes | memoryview], limit: int) -> Iterator[list[bytes | memoryview]]:
    """`chunks` as consecutive groups of at most `limit` bytes each, in order: their concatenation
    is the concatenation of `chunks`. A chunk that does not fit the group being filled is sliced
    into views (no copy); chunks that fit are passed as they are."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    group: list[bytes | memoryview] = []
    size = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B") if len(chunk) > limit - size else chunk
        while len(view) > limit - size:
            take = limit - size
            if take:
                group.append(view[:take])
            yield group
            group, size, view = [], 0, view[take:]
        if len(view):
            group.append(view)
            size += len(view)
    if group:
        yield group


def _pack_set(name: bytes, head: bytes, stored: bytes, ttl_s: int | None) -> list[bytes]:
    """RESP for `SET name <head + stored> [EX ttl_s]`, the value as two buffers."""
    size = len(head) + len(stored)
    if ttl_s is None:
        return [b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(name), name, size), head, stored, b"\r\n"]
    ex = b"%d" % ttl_s
    return [b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(name), name, size), head, stored,
            b"\r\n$2\r\nEX\r\n$%d\r\n%b\r\n" % (len(ex), ex)]


def _check_header(head: bytes, size: int, key: RecordKey) -> tuple[RecordHeader | None, str]:
    """(the verified header, "") or (None, what is wrong with this value)."""
    try:
        header, _ = decode_header(head)
    except RecordError as exc:
        return None, str(exc)
    if header.key != key:
        return None, "header key does not match the key name"
    if size != HEADER_SIZE + header.stored_length:
        return None, f"value is {size} bytes but the header says {HEADER_SIZE + header.stored_length}"
    return header, ""


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def _plain_url(url: str) -> str:
    """`redis+cluster://...` as the `redis://...` URL redis-py and the reader parse."""
    return "redis://" + url.removeprefix(CLUSTER_SCHEME) if url.startswith(CLUSTER_SCHEME) else url


def _make_client(url: str, cluster: bool, socket_timeout_s: float, max_connections: int) -> Redis | RedisCluster:
    """A client that owns its pool, fails fast (short timeouts, no retries: the tier's cooldown
    is the retry policy) and never connects in the constructor."""
    common: dict[str, Any] = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
                                  retry=Retry(NoBackoff(), 0), max_connections=max_connections)
    if cluster:
        return RedisCluster.from_url(_plain_url(url), **common)
    return Redis.from_pool(ConnectionPool.from_url(url, **common))
