"""Typed Python client of the statestore service: `StateStoreClient` (async) and
`SyncStateStoreClient` (a blocking wrapper with the same methods).

Methods take and return plain values (`tiers.record.Record`, dataclasses, lists), never
protobuf messages; record chunking is hidden inside `put_records`/`get_records`, so records
larger than the message size limit need nothing from the caller. A failed call raises
`ServiceError` carrying the gRPC status code and the server's message::

    async with StateStoreClient("127.0.0.1:7450", token="...") as c:
        await c.create_session("agent-1")
        await c.append("agent-1", [1, 2, 3])
        print(await c.generate("agent-1", 8))
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc

from proto.statestore.v1 import common_pb2, sessions_pb2, sessions_pb2_grpc, statestore_pb2, statestore_pb2_grpc
from statestore.payloads import PayloadPut, PayloadSink, PayloadTransport, StartInfo
from statestore.types import Durability
from statestore.wire import PartsChecksum, encoded_size, join_parts_off_loop, record_frames, split_data_frame
from tiers.record import TENANT_BYTES, Record, RecordHeader

DEFAULT_CHUNK_BYTES = 512 << 10
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
_FRAME_HEADROOM = 4096  # a data frame's header, tag and length beside its payload bytes
_ZERO_TENANT = bytes(TENANT_BYTES)
T = TypeVar("T")


class ServiceError(Exception):
    """A call the server refused or could not complete: `code` (grpc.StatusCode) and `message`."""

    def __init__(self, code: grpc.StatusCode, message: str, method: str = "") -> None:
        super().__init__(f"{method}: {code.name}: {message}" if method else f"{code.name}: {message}")
        self.code, self.message, self.method = code, message, method


# ----- plain results ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordInfo:
    key: bytes
    kind: int
    kind_name: str
    size_bytes: int
    tiers: dict[str, int]  # tier -> resident bytes, fastest first
    pinned: bool
    durability: Durability | None
    created_at: float
    last_access: float
    access_count: int
    model_fingerprint: bytes
    token_start: int = 0
    token_end: int = 0
    retention: str = ""
    explain: dict[str, Any] | None = None  # `inspect` only: residency, protection, the policy's reasoning


@dataclass(frozen=True, slots=True)
class PutInfo:
    key: bytes
    durability: Durability
    tiers: tuple[str, ...]
    evicted: int


@dataclass(frozen=True, slots=True)
class ReplayInfo:
    mode: str
    num_tokens: int
    persisted_tokens: int
    replay_tokens: int
    row_layers: int
    est_seconds: float


@dataclass(frozen=True, slots=True)
class LookupInfo:
    combined_blocks: int
    per_tier: dict[str, int]
    bytes_to_load: dict[str, int]
    persisted_tokens: int
    replay: ReplayInfo | None
    est_load_seconds: float
    est_seconds: float


@dataclass(frozen=True, slots=True)
class KindStats:
    tier: str
    kind: int
    kind_name: str
    num_records: int
    resident_bytes: int
    hits: int
    misses: int
    evictions: int
    promotions: int


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: str
    budget_bytes: int
    resident_bytes: int
    fill: float
    healthy: bool
    reserve_bytes: int = 0  # held for reuse beyond the records (the SSD tier's recycled spares)


@dataclass(frozen=True, slots=True)
class StatsInfo:
    tiers: list[TierStats]
    kinds: list[KindStats]
    num_records: int
    live_sessions: int
    model_fingerprint: bytes
    model_name: str
    uptime_seconds: float


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session_id: str
    num_tokens: int
    live: bool
    checkpoint_version: int  # 0 = never checkpointed
    checkpointed_tokens: int
    message_boundaries: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    version: int
    num_tokens: int
    new_blocks: int
    shared_blocks: int
    bytes_written: dict[str, int]
    total_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ResumeInfo:
    mode: str
    num_tokens: int
    persisted_tokens: int
    bytes_loaded: int
    replay_tokens: int
    row_layers: int
    load_seconds: float
    replay_seconds: float

    @property
    def seconds(self) -> float:
        return self.load_seconds + self.replay_seconds


@dataclass(frozen=True, slots=True)
class ResumePlanInfo:
    session_id: str
    num_tokens: int
    bytes_by_tier: dict[str, int]
    missing_blocks: int
    rings_available: bool
    replay: ReplayInfo
    est_load_seconds: float
    est_seconds: float


def _fields(msg: Any, names: Iterable[str]) -> dict[str, Any]:
    return {n: getattr(msg, n) for n in names}


def _tier_map(items: Iterable[Any]) -> dict[str, int]:
    return {t.tier: int(t.bytes) for t in items}


def _durability(value: int) -> Durability | None:
    return Durability(value) if value else None


def _record_info(m: Any) -> RecordInfo:
    return RecordInfo(key=bytes(m.key), kind=m.kind, kind_name=m.kind_name, size_bytes=m.size_bytes,
                      tiers=_tier_map(m.tiers), pinned=m.pinned, durability=_durability(m.durability),
                      created_at=m.created_at, last_access=m.last_access, access_count=m.access_count,
                      model_fingerprint=bytes(m.model_fingerprint), token_start=m.token_start, token_end=m.token_end,
                      retention=m.retention, explain=json.loads(m.explain_json) if m.explain_json else None)


def _replay(m: Any) -> ReplayInfo:
    return ReplayInfo(**_fields(m, ("mode", "num_tokens", "persisted_tokens", "replay_tokens", "row_layers",
                                    "est_seconds")))


def _session(m: Any) -> SessionInfo:
    return SessionInfo(m.session_id, m.num_tokens, m.live, m.checkpoint_version, m.checkpointed_tokens,
                       tuple(m.message_boundaries))


# ----- the async client ---------------------------------------------------------------------


@dataclass
class ClientOptions:
    """Channel knobs. `root_certificates` (PEM) switches to TLS."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    timeout_s: float | None = 600.0
    root_certificates: bytes | None = None
    shm_bytes: int = 0  # same-host shared-memory region of put_payloads/get_payloads_into (0: gRPC only)
    extra_options: list[tuple[str, Any]] = field(default_factory=list)


class StateStoreClient:
    """One channel to a statestore server; an async context manager.

    Args:
        target: "host:port".
        token: bearer token of the caller's tenant (None: no credentials, the "default" tenant).
        options: `ClientOptions`.
    """

    def __init__(self, target: str, token: str | None = None, options: ClientOptions | None = None) -> None:
        self.target = target
        self.options = options or ClientOptions()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel: grpc.aio.Channel | None = None
        self._transport: PayloadTransport | None = None
        self._store: statestore_pb2_grpc.StateStoreStub
        self._sessions: sessions_pb2_grpc.SessionsStub

    async def __aenter__(self) -> StateStoreClient:
        self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def open(self) -> None:
        o = self.options
        opts = [("grpc.max_receive_message_length", o.max_message_bytes),
                ("grpc.max_send_message_length", o.max_message_bytes), *o.extra_options]
        if o.root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=o.root_certificates)
            self._channel = grpc.aio.secure_channel(self.target, creds, options=opts)
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=opts)
        self._store = statestore_pb2_grpc.StateStoreStub(self._channel)
        # The record data path passes serialized RecordChunk frames (statestore.wire) to save copies.
        self._put = self._channel.stream_unary(
            "/statestore.v1.StateStore/PutRecords", request_serializer=_serialize_chunk,
            response_deserializer=statestore_pb2.PutRecordsResponse.FromString)
        # A PutRecords stream of one message (a shared-memory put of one record) sent as a unary
        # call: the same bytes on the wire (one message, then the half-close), without the task
        # grpc.aio runs to drain a request iterator (~0.2 ms of a 4 KiB put on the development VM).
        self._put_one = self._channel.unary_unary(
            "/statestore.v1.StateStore/PutRecords", request_serializer=_serialize_chunk,
            response_deserializer=statestore_pb2.PutRecordsResponse.FromString)
        self._get = self._channel.unary_stream(
            "/statestore.v1.StateStore/GetRecords", request_serializer=statestore_pb2.GetRecordsRequest.SerializeToString,
            response_deserializer=None)
        self._sessions = sessions_pb2_grpc.SessionsStub(self._channel)

    async def aclose(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _call(self, method: Callable[..., Any], request: Any) -> Any:
        try:
            return await method(request, metadata=self._metadata, timeout=self.options.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise ServiceError(exc.code(), exc.details() or "", _name(method)) from None

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the channel connects (the server is up)."""
        assert self._channel is not None
        await asyncio.wait_for(self._channel.channel_ready(), timeout_s)

    async def health(self, service: str = "") -> str:
        """The server's health status name (SERVING, NOT_SERVING, ...)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = await self._call(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # ----- StateStore ----------------------------------------------------------------------

    async def register_model(self, *, model_name: str, weights_id: str, config_json: str, layout_version: int,
                             specs: Sequence[dict[str, Any]]) -> tuple[bytes, bool]:
        """Returns (fingerprint, hosted). `specs`: dicts of StateSpecInfo fields."""
        request = statestore_pb2.RegisterModelRequest(
            model_name=model_name, weights_id=weights_id, config_json=config_json, layout_version=layout_version,
            specs=[statestore_pb2.StateSpecInfo(**s) for s in specs])
        reply = await self._call(self._store.RegisterModel, request)
        return bytes(reply.model_fingerprint), reply.hosted

    async def lookup(self, block_keys: Sequence[bytes], *, kinds: Sequence[int] = (), num_tokens: int = 0,
                     block_size: int = 0, mode: str = "", model_fingerprint: bytes = b"") -> LookupInfo:
        reply = await self._call(self._store.Lookup, statestore_pb2.LookupRequest(
            block_keys=list(block_keys), kinds=list(kinds), num_tokens=num_tokens, block_size=block_size,
            mode=mode, model_fingerprint=model_fingerprint))
        return LookupInfo(reply.combined_blocks, {t.tier: t.blocks for t in reply.per_tier},
                          _tier_map(reply.bytes_to_load), reply.persisted_tokens,
                          _replay(reply.replay) if reply.HasField("replay") else None,
                          reply.est_load_seconds, reply.est_seconds)

    async def request_done(self, block_keys: Sequence[bytes], generated_tokens: int, *,
                           kinds: Sequence[int] = ()) -> int:
        """Report that a request over this chain (as `lookup` named it) finished, having generated
        `generated_tokens` tokens; returns how many of its records the server holds. Call it when
        a request completes: the cost-aware policy keeps the blocks of turns likely to be
        continued (short answers, tool calls) over those of conversations that ended."""
        reply = await self._call(self._store.RequestDone, statestore_pb2.RequestDoneRequest(
            block_keys=list(block_keys), kinds=list(kinds), generated_tokens=generated_tokens))
        return reply.known_records

    async def _chunks(self, records: Sequence[Record], durability: Durability, pin: bool) -> AsyncIterator[Any]:
        # A frame carries up to `chunk_bytes` of payload plus, in the first, the record header:
        # keep it under the message limit whatever the options say.
        step = max(1, min(self.options.chunk_bytes, self.options.max_message_bytes - _FRAME_HEADROOM))
        for record in records:
            if record.header.tenant_id != _ZERO_TENANT:  # the server stamps the caller's tenant
                record = Record(replace(record.header, tenant_id=_ZERO_TENANT), record.payload)
            yield common_pb2.RecordChunk(start=common_pb2.RecordStart(
                key=record.key, total_bytes=encoded_size(record), durability=int(durability), pin=pin))
            for frame in record_frames(record, step):
                yield frame  # a serialized RecordChunk{data}

    async def put_records(self, records: Sequence[Record], durability: Durability = Durability.MEMORY, *,
                          pin: bool = False) -> list[PutInfo]:
        """Store records (the server stamps the caller's tenant). All are verified before any is stored."""
        reply = await self._call(self._put, self._chunks(records, durability, pin))
        return [PutInfo(bytes(r.key), Durability(r.durability), tuple(r.tiers), r.evicted) for r in reply.results]

    async def put_raw(self, chunks: Iterable[Any] | AsyncIterator[Any]) -> list[PutInfo]:
        """Send hand-made `RecordChunk`s (tests and tools that exercise the stream protocol)."""
        reply = await self._call(self._put, chunks)
        return [PutInfo(bytes(r.key), Durability(r.durability), tuple(r.tiers), r.evicted) for r in reply.results]

    async def get_records(self, keys: Sequence[bytes], *, chunk_bytes: int = 0) -> list[Record | None]:
        """The records (None for a miss), each reassembled and verified by its checksums.

        A record that arrived in one message (payload up to `chunk_bytes`) has as its payload a
        read-only memoryview into that message, not a copy: use it as bytes (compare, slice,
        `np.frombuffer`), or `bytes(record.payload)` where a bytes object is needed."""
        call = self._get(statestore_pb2.GetRecordsRequest(keys=list(keys), chunk_bytes=chunk_bytes),
                         metadata=self._metadata, timeout=self.options.timeout_s)
        out: list[Record | None] = []
        pending: tuple[bytes, int] | None = None
        parts: list[bytes | memoryview] = []
        summed = PartsChecksum()  # a multi-part record is hashed part by part as it arrives
        try:
            async for frame in call:
                data = split_data_frame(frame)
                if data is None:
                    chunk = common_pb2.RecordChunk.FromString(frame)
                    if chunk.WhichOneof("part") == "start":
                        if pending is not None:
                            out.append(await join_parts_off_loop(parts, pending[1], expect_key=pending[0],
                                                                 keep_view=True, payload_sum=summed.value()))
                        pending, parts, summed = None, [], PartsChecksum()
                        if chunk.start.found:
                            pending = (bytes(chunk.start.key), chunk.start.total_bytes)
                        else:
                            out.append(None)
                        continue
                    data = chunk.data
                parts.append(data)
                summed.add(parts)
        except grpc.aio.AioRpcError as exc:
            raise ServiceError(exc.code(), exc.details() or "", "GetRecords") from None
        if pending is not None:
            out.append(await join_parts_off_loop(parts, pending[1], expect_key=pending[0], keep_view=True,
                                                 payload_sum=summed.value()))
        return out

    # ----- opaque payloads from and into the caller's buffers (statestore/payloads.py) ------------

    def _payloads(self) -> PayloadTransport:
        if self._transport is None:
            if self._channel is None:
                raise RuntimeError("StateStoreClient: open() it first")
            o = self.options
            self._transport = PayloadTransport(self._put, self._get, _get_request, _FRAMES, self._metadata,
                                               o.timeout_s, o.chunk_bytes, o.shm_bytes, put_one=self._put_one)
        return self._transport

    @property
    def shm_active(self) -> bool:
        """Whether payloads move through the shared-memory region (known after the first call)."""
        return self._transport is not None and self._transport.shm_active

    def lend_shared_memory(self, path: str) -> None:
        """Lend the server a shared-memory file of this process (under /dev/shm) that holds the
        caller's buffers, so that `LentSpan` parts of `put_payloads` (and a sink's lent
        destinations) move with no copy through the window (statestore/shm.py, "Lent memory").
        OSError or ShmUnavailable if it cannot be opened; unused without shared memory."""
        self._payloads().lend(path)

    @property
    def lent_active(self) -> bool:
        """Whether lent memory is in use (the shared-memory path is up and the server took it)."""
        return self._transport is not None and self._transport.lent_active

    async def put_payloads(self, items: Sequence[PayloadPut], durability: Durability = Durability.MEMORY, *,
                           pin: bool = False) -> list[PutInfo]:
        """Store records given as a header and payload buffers (no `Record` built), in one call;
        through the shared-memory region when `options.shm_bytes` is set and the server is local."""
        if not items:
            raise ValueError("put_payloads: no items")
        try:
            reply = await self._payloads().put(items, int(durability), pin)
        except grpc.aio.AioRpcError as exc:
            raise ServiceError(exc.code(), exc.details() or "", "PutRecords") from None
        return [PutInfo(bytes(r.key), Durability(r.durability), tuple(r.tiers), r.evicted) for r in reply.results]

    async def get_payloads_into(self, keys: Sequence[bytes], sink: PayloadSink, *,
                                head_bytes: int = 4096) -> list[bool]:
        """Fetch records straight into buffers `sink` hands out (see `PayloadSink`): per key, True
        when the payload arrived verified, False for a miss or a discarded record."""
        if not 0 < head_bytes <= 1 << 20:
            raise ValueError(f"get_payloads_into: head_bytes {head_bytes} outside (0, 1 MiB]")
        try:
            return await self._payloads().get_into(list(keys), sink, head_bytes)
        except grpc.aio.AioRpcError as exc:
            raise ServiceError(exc.code(), exc.details() or "", "GetRecords") from None

    async def read_head(self, key: bytes, num_bytes: int) -> tuple[RecordHeader, bytes] | None:
        """A record's header and first `num_bytes` payload bytes, without fetching the rest."""
        if not 0 <= num_bytes <= 1 << 20:
            raise ValueError(f"read_head: num_bytes {num_bytes} outside [0, 1 MiB]")
        try:
            return await self._payloads().read_head(key, num_bytes)
        except grpc.aio.AioRpcError as exc:
            raise ServiceError(exc.code(), exc.details() or "", "GetRecords") from None

    async def count_prefix(self, block_keys: Sequence[bytes], kind: int, *, model_fingerprint: bytes = b"") -> int:
        """How many of `block_keys`, from the first, the server holds as records of `kind`."""
        hits = 0
        for start in range(0, len(block_keys), _LOOKUP_KEYS):
            batch = block_keys[start:start + _LOOKUP_KEYS]
            found = (await self.lookup(batch, kinds=[kind], model_fingerprint=model_fingerprint)).combined_blocks
            hits += found
            if found < len(batch):
                break
        return hits

    async def pin(self, keys: Sequence[bytes]) -> int:
        return (await self._call(self._store.Pin, statestore_pb2.KeysRequest(keys=list(keys)))).changed

    async def unpin(self, keys: Sequence[bytes]) -> int:
        return (await self._call(self._store.Unpin, statestore_pb2.KeysRequest(keys=list(keys)))).changed

    async def evict(self, keys: Sequence[bytes], tiers: Sequence[str] = (), *, force: bool = False) -> dict[bytes, tuple[str, ...]]:
        reply = await self._call(self._store.Evict, statestore_pb2.EvictRequest(keys=list(keys), tiers=list(tiers),
                                                                                force=force))
        return {bytes(e.key): tuple(e.tiers) for e in reply.evicted}

    async def stats(self) -> StatsInfo:
        r = await self._call(self._store.Stats, statestore_pb2.StatsRequest())
        return StatsInfo(
            tiers=[TierStats(**_fields(t, ("tier", "budget_bytes", "resident_bytes", "fill", "healthy",
                                                   "reserve_bytes"))) for t in r.tiers],
            kinds=[KindStats(**_fields(k, ("tier", "kind", "kind_name", "num_records", "resident_bytes", "hits",
                                           "misses", "evictions", "promotions"))) for k in r.kinds],
            num_records=r.num_records, live_sessions=r.live_sessions, model_fingerprint=bytes(r.model_fingerprint),
            model_name=r.model_name, uptime_seconds=r.uptime_seconds)

    async def list_records(self, kind: int = 0, limit: int = 0) -> tuple[list[RecordInfo], bool]:
        """(records oldest first, truncated)."""
        r = await self._call(self._store.List, statestore_pb2.ListRequest(kind=kind, limit=limit))
        return [_record_info(m) for m in r.records], r.truncated

    async def inspect(self, key: bytes) -> RecordInfo:
        return _record_info(await self._call(self._store.Inspect, statestore_pb2.InspectRequest(key=key)))

    # ----- Sessions --------------------------------------------------------------------------

    async def create_session(self, session_id: str) -> SessionInfo:
        return _session(await self._call(self._sessions.Create, sessions_pb2.SessionRequest(session_id=session_id)))

    async def append(self, session_id: str, token_ids: Sequence[int]) -> SessionInfo:
        return _session(await self._call(self._sessions.Append,
                                         sessions_pb2.AppendRequest(session_id=session_id, token_ids=list(token_ids))))

    async def generate_stream(self, session_id: str, num_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                              chunk_tokens: int = 0) -> AsyncIterator[list[int]]:
        """Token ids as the server streams them."""
        call = self._sessions.Generate(sessions_pb2.GenerateRequest(
            session_id=session_id, num_tokens=num_tokens, temperature=temperature, seed=seed,
            chunk_tokens=chunk_tokens), metadata=self._metadata, timeout=self.options.timeout_s)
        try:
            async for chunk in call:
                yield list(chunk.token_ids)
        except grpc.aio.AioRpcError as exc:
            raise ServiceError(exc.code(), exc.details() or "", "Generate") from None

    async def generate(self, session_id: str, num_tokens: int, **kwargs: Any) -> list[int]:
        out: list[int] = []
        async for tokens in self.generate_stream(session_id, num_tokens, **kwargs):
            out += tokens
        return out

    async def checkpoint(self, session_id: str, durability: Durability | None = None) -> CheckpointInfo:
        r = await self._call(self._sessions.Checkpoint, sessions_pb2.CheckpointRequest(
            session_id=session_id, durability=int(durability) if durability else 0))
        return CheckpointInfo(r.version, r.num_tokens, r.new_blocks, r.shared_blocks, dict(r.bytes_written),
                              r.total_bytes, r.seconds)

    async def resume(self, session_id: str, mode: str = "") -> ResumeInfo:
        r = await self._call(self._sessions.Resume, sessions_pb2.ResumeRequest(session_id=session_id, mode=mode))
        return ResumeInfo(**_fields(r, ("mode", "num_tokens", "persisted_tokens", "bytes_loaded", "replay_tokens",
                                        "row_layers", "load_seconds", "replay_seconds")))

    async def plan_resume(self, session_id: str, mode: str = "") -> ResumePlanInfo:
        r = await self._call(self._sessions.PlanResume, sessions_pb2.ResumeRequest(session_id=session_id, mode=mode))
        return ResumePlanInfo(r.session_id, r.num_tokens, _tier_map(r.bytes_by_tier), r.missing_blocks,
                              r.rings_available, _replay(r.replay), r.est_load_seconds, r.est_seconds)

    async def get_session(self, session_id: str) -> SessionInfo:
        return _session(await self._call(self._sessions.Get, sessions_pb2.SessionRequest(session_id=session_id)))

    async def list_sessions(self) -> list[SessionInfo]:
        r = await self._call(self._sessions.List, sessions_pb2.ListSessionsRequest())
        return [_session(s) for s in r.sessions]

    async def delete_session(self, session_id: str) -> bool:
        return (await self._call(self._sessions.Delete, sessions_pb2.SessionRequest(session_id=session_id))).done

    async def drop_session(self, session_id: str) -> bool:
        return (await self._call(self._sessions.Drop, sessions_pb2.SessionRequest(session_id=session_id))).done


def _name(method: Any) -> str:
    raw = getattr(method, "_method", b"")
    raw = raw.decode() if isinstance(raw, bytes) else str(raw)
    return raw.rsplit("/", 1)[-1]


_LOOKUP_KEYS = 65536  # the server's key limit per Lookup


def _get_request(keys: Sequence[bytes], chunk_bytes: int,
                 lent: Sequence[tuple[int, int, int]] = ()) -> statestore_pb2.GetRecordsRequest:
    """`lent`: per key (total_bytes, offset, bytes) of a lent destination, all zero for none."""
    return statestore_pb2.GetRecordsRequest(
        keys=list(keys), chunk_bytes=chunk_bytes,
        lent=[common_pb2.LentDestination(total_bytes=t, offset=o, bytes=n) for t, o, n in lent])


class _Frames:
    """The protobuf side of `PayloadTransport`'s streams."""

    @staticmethod
    def start_frame(key: bytes, total_bytes: int, durability: int, pin: bool, lent_offset: int = 0,
                    lent_bytes: int = 0, checksum_by_server: bool = False) -> bytes:
        return common_pb2.RecordChunk(start=common_pb2.RecordStart(
            key=key, total_bytes=total_bytes, durability=durability, pin=pin, lent_offset=lent_offset,
            lent_bytes=lent_bytes, checksum_by_server=checksum_by_server)).SerializeToString()

    @staticmethod
    def read_frame(frame: bytes) -> memoryview | StartInfo:
        data = split_data_frame(frame)
        if data is not None:
            return data
        chunk = common_pb2.RecordChunk.FromString(frame)
        if chunk.WhichOneof("part") == "data":
            return memoryview(chunk.data)
        start = chunk.start
        return StartInfo(bytes(start.key), start.found, start.total_bytes, start.lent_offset, start.lent_bytes,
                         start.verified)


_FRAMES = _Frames()


def _serialize_chunk(message: bytes | common_pb2.RecordChunk) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


# ----- the sync wrapper ------------------------------------------------------------------------


class SyncStateStoreClient:
    """Blocking twin of `StateStoreClient`: the same methods, run on a private event loop thread.

    Streaming methods (`generate_stream`) are not offered; `generate` returns the whole list.
    """

    def __init__(self, target: str, token: str | None = None, options: ClientOptions | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="statestore-client", daemon=True)
        self._thread.start()
        self._client = StateStoreClient(target, token, options)
        self._run(self._open())

    async def _open(self) -> None:
        self._client.open()

    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name == "generate_stream" or not asyncio.iscoroutinefunction(attr):
            raise AttributeError(f"SyncStateStoreClient has no method {name!r}")
        return lambda *a, **kw: self._run(attr(*a, **kw))

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._client.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> SyncStateStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
