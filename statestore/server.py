"""The gRPC service: a thin translator from `statestore.v1` messages to `TieredStore` and
`SessionManager` calls, and from their outcomes to status codes (DESIGN.md §6).

Every handler goes through `_handler`, which resolves the caller's tenant from its bearer
token, validates nothing itself but maps what the layers below raise::

    ValueError / RecordError / _BadField   INVALID_ARGUMENT   (the message names the field)
    NotFound, SessionNotFound              NOT_FOUND
    SessionExists                          ALREADY_EXISTS
    ModelMismatch, _Precondition,
    CheckpointIncomplete,
    DurabilityUnavailable (tier absent)    FAILED_PRECONDITION
    BudgetExceeded, QuotaExceeded          RESOURCE_EXHAUSTED (the message gives the budget or quota)
    AuthError, _Denied                     PERMISSION_DENIED
    DurabilityUnavailable (tier down)      UNAVAILABLE        (the service itself cannot serve it)
    anything else                          INTERNAL, logged with the traceback; the server keeps serving

Nothing is stored before the whole request is verified: a PutRecords stream is reassembled
and every record's checksums, key, kind, model and tenant are checked before the first put,
so a malformed or interrupted stream leaves stored state unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_adapter.base import Retention, StateKind
from proto.statestore.v1 import common_pb2, sessions_pb2, sessions_pb2_grpc, statestore_pb2, statestore_pb2_grpc
from replay import plan_replay
from statestore.allocator import keep_large_buffers_in_heap
from statestore import sessions as ss
from statestore.auth import AuthError, TokenAuth
from statestore.config import ServiceConfig
from statestore.keys import make_model_fingerprint, tenant_id
from statestore.metrics import ServiceMetrics, kind_name
from statestore.quotas import QuotaExceeded, TenantQuotas
from statestore.shm import (ATTACHED, METADATA_KEY, ShmAttachments, ShmSlots, ShmUnavailable, ShmWindow, slot_views,
                            write_slot, write_slot_header)
from statestore.store import BudgetExceeded, DurabilityUnavailable, StoreConfig, TieredStore, make_page_sizes
from statestore.wire import (OFFLOAD_BYTES, PartsChecksum, copy_hashed, encoded_size, frame_slices,
                             join_parts_off_loop, record_frames, split_data_frame)
from statestore.types import DEFAULT_TIER_PROFILES, TIER_ORDER, Durability, OpenReport, StateMeta, TierName
from tiers.record import (
    HEADER_SIZE,
    RECORD_KEY_BYTES,
    TENANT_BYTES,
    Record,
    RecordError,
    decode_header,
    make_record_key,
    with_tenant,
)

logger = logging.getLogger(__name__)

SERVICE_NAMES = ("statestore.v1.StateStore", "statestore.v1.Sessions")
MAX_KEYS = 65536
MAX_GET_KEYS = 4096
MAX_APPEND_TOKENS = 1 << 20
DEFAULT_CHUNK_BYTES = 1 << 20
_CHUNK_HEADROOM = 4096  # message framing beside a data chunk
_MAX_DETAILS = 2048  # error messages echo client input; clients refuse metadata over 16 KiB by default
MAX_REGISTERED_MODELS = 1024  # fingerprints RegisterModel remembers: bounded, so callers cannot grow it forever
_KNOWN_KINDS = frozenset(int(k) for k in StateKind)
_ZERO_TENANT = bytes(TENANT_BYTES)
T = TypeVar("T")


class _BadField(ValueError):
    """INVALID_ARGUMENT naming the request field."""


class _NotFound(LookupError):
    """NOT_FOUND."""


class _Precondition(Exception):
    """FAILED_PRECONDITION."""


class _Denied(Exception):
    """PERMISSION_DENIED."""


class _Exhausted(Exception):
    """RESOURCE_EXHAUSTED for a server-side limit that is not a store budget or a quota."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a failure maps to (None: unexpected, i.e. INTERNAL)."""
    table: list[tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode]] = [
        ((AuthError, _Denied), grpc.StatusCode.PERMISSION_DENIED),
        ((_NotFound, ss.SessionNotFound), grpc.StatusCode.NOT_FOUND),
        (ss.SessionExists, grpc.StatusCode.ALREADY_EXISTS),
        ((ss.ModelMismatch, ss.CheckpointIncomplete, _Precondition), grpc.StatusCode.FAILED_PRECONDITION),
        ((BudgetExceeded, QuotaExceeded, _Exhausted), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # RecordError and _BadField included
    ]
    if isinstance(exc, DurabilityUnavailable):
        code = grpc.StatusCode.FAILED_PRECONDITION if exc.tier is None else grpc.StatusCode.UNAVAILABLE
        return code, str(exc)
    for types, code in table:
        if isinstance(exc, types):
            return code, str(exc)
    return None


class _Undecodable:
    """A request whose bytes do not parse as its message type. The deserializer returns it
    instead of raising (grpc would answer UNKNOWN); the handler answers INVALID_ARGUMENT."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name, self.error = type_name, error

    def check(self) -> None:
        raise _BadField(f"the request is not a valid {self.type_name} message ({self.error})")


def _lenient_deserializer(message_class: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return _Undecodable(message_class.DESCRIPTOR.full_name, str(exc))

    return deserialize


class _Calls:
    """Tenant resolution, error mapping and per-call metrics shared by both servicers."""

    def __init__(self, auth: TokenAuth, metrics: ServiceMetrics) -> None:
        self.auth = auth
        self.metrics = metrics

    def tenant(self, context: grpc.aio.ServicerContext) -> str:
        return self.auth.tenant_for(context.invocation_metadata())

    async def fail(self, method: str, exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        mapped = status_for(exc)
        if mapped is None:
            logger.error("%s failed unexpectedly", method, exc_info=exc)
            mapped = (grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}; see the server log")
        self.metrics.calls.labels(method, mapped[0].name).inc()
        await context.abort(mapped[0], _clip(mapped[1]))


def _clip(message: str) -> str:
    """An error message short enough for the status trailer: a message that echoes a 100 KB
    session id would exceed the client's metadata limit, which then reports its own
    RESOURCE_EXHAUSTED and drops the connection instead of showing the real status."""
    if len(message) <= _MAX_DETAILS:
        return message
    return f"{message[:_MAX_DETAILS]}... ({len(message) - _MAX_DETAILS} more characters)"


def _unary(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Wrap `fn(self, request, context, tenant)` as a unary (or client-streaming) handler."""
    method = fn.__name__

    @functools.wraps(fn)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            tenant = self._calls.tenant(context)
            if isinstance(request, _Undecodable):
                request.check()
            result = await fn(self, request, context, tenant)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the service boundary: map, never crash
            await self._calls.fail(method, exc, context)
            raise AssertionError("unreachable: abort raises") from exc
        self._calls.metrics.calls.labels(method, "OK").inc()
        return result

    return handler


def _streaming(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Wrap an async-generator handler `fn(self, request, context, tenant)`."""
    method = fn.__name__

    @functools.wraps(fn)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            tenant = self._calls.tenant(context)
            if isinstance(request, _Undecodable):
                request.check()
            async for item in fn(self, request, context, tenant):
                yield item
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the service boundary
            await self._calls.fail(method, exc, context)
            return
        self._calls.metrics.calls.labels(method, "OK").inc()

    return handler


# ----- conversions --------------------------------------------------------------------------


def _record_key(value: bytes, field: str) -> bytes:
    if len(value) != RECORD_KEY_BYTES:
        raise _BadField(f"{field}: a record key is {RECORD_KEY_BYTES} bytes (2-byte kind + 32-byte block key), "
                        f"got {len(value)}")
    return bytes(value)


def _keys(values: Sequence[bytes], field: str, limit: int = MAX_KEYS) -> list[bytes]:
    if not values:
        raise _BadField(f"{field}: give at least one record key")
    if len(values) > limit:
        raise _BadField(f"{field}: {len(values)} keys, at most {limit} per call")
    return [_record_key(v, f"{field}[{i}]") for i, v in enumerate(values)]


def _durability(value: int, field: str, default: Durability) -> Durability:
    if value == common_pb2.DURABILITY_UNSPECIFIED:
        return default
    try:
        return Durability(value)
    except ValueError:
        raise _BadField(f"{field}: unknown durability {value}; use MEMORY, LOCAL or SHARED") from None


def _tier_bytes(mapping: dict[str, int]) -> list[common_pb2.TierBytes]:
    order = [t.value for t in TIER_ORDER]
    return [common_pb2.TierBytes(tier=t, bytes=int(b))
            for t, b in sorted(mapping.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99)]


def _record_info(meta: StateMeta) -> common_pb2.RecordInfo:
    return common_pb2.RecordInfo(
        key=meta.key, kind=meta.kind, kind_name=kind_name(meta.kind), size_bytes=meta.size_bytes,
        tiers=[common_pb2.TierBytes(tier=t.value, bytes=n) for t, n in meta.resident], pinned=meta.pinned,
        durability=int(meta.durability), created_at=meta.created, last_access=meta.last_access,
        access_count=meta.access_count, model_fingerprint=meta.model_fingerprint, token_start=meta.token_start,
        token_end=meta.token_end, retention=meta.retention.name)


def _replay_info(plan: Any) -> common_pb2.ReplayPlanInfo:
    return common_pb2.ReplayPlanInfo(mode=plan.mode, num_tokens=plan.num_tokens,
                                     persisted_tokens=plan.persisted_tokens, replay_tokens=plan.replay_tokens,
                                     row_layers=plan.row_layers, est_seconds=plan.est_seconds)


def _session_info(info: ss.SessionInfo) -> sessions_pb2.SessionInfo:
    return sessions_pb2.SessionInfo(session_id=info.session_id, num_tokens=info.num_tokens, live=info.live,
                                    checkpoint_version=info.checkpoint_version or 0,
                                    checkpointed_tokens=info.checkpointed_tokens or 0,
                                    message_boundaries=list(info.message_boundaries))


# ----- StateStore ----------------------------------------------------------------------------


class _Reassembler:
    """Collects the start + data messages of a PutRecords stream into whole encoded records."""

    def __init__(self, max_record_bytes: int, max_stream_bytes: int, *, data_in_shm: bool = False) -> None:
        self._max_record, self._max_stream = max_record_bytes, max_stream_bytes
        self._data_in_shm = data_in_shm  # the stream carries starts only (statestore/shm.py)
        self.done: list[tuple[common_pb2.RecordStart, list[bytes | memoryview]]] = []
        self.sums: list[int | None] = []  # per done record: its payload's xxh3 taken part by part, if it came in parts
        self._summed = PartsChecksum()
        self._start: common_pb2.RecordStart | None = None
        self._parts: list[bytes | memoryview] = []
        self._received = 0
        self._total = 0

    def feed_frame(self, frame: bytes | common_pb2.RecordChunk) -> None:
        """One message as the wire carried it: serialized bytes (the fast path), or a parsed chunk."""
        if not isinstance(frame, bytes):
            self.feed(frame)
            return
        data = split_data_frame(frame)
        if data is not None:
            self._feed_data(data)
            return
        try:
            chunk = common_pb2.RecordChunk.FromString(frame)
        except DecodeError:
            raise _BadField(f"record {len(self.done)}: a message that is not a RecordChunk") from None
        self.feed(chunk)

    @property
    def _where(self) -> str:  # for error messages only: a property, so the hot path formats nothing
        return f"record {len(self.done)}"

    def feed(self, chunk: common_pb2.RecordChunk) -> None:
        part = chunk.WhichOneof("part")
        if part == "start":
            self._finish()
            start = chunk.start
            if len(start.key) != RECORD_KEY_BYTES:
                _record_key(start.key, f"{self._where}: start.key")  # raises, naming the field
            if not HEADER_SIZE <= start.total_bytes <= self._max_record:
                raise _BadField(f"{self._where}: start.total_bytes {start.total_bytes} outside [{HEADER_SIZE}, "
                                f"{self._max_record}] (header size .. the server's max_record_bytes)")
            self._total += start.total_bytes
            if self._total > self._max_stream:
                raise _BadField(f"{self._where}: the stream's records exceed max_stream_bytes {self._max_stream}; "
                                f"send them in several PutRecords calls")
            self._start = start
        elif part == "data":
            self._feed_data(chunk.data)
        else:
            raise _BadField(f"{self._where}: an empty RecordChunk (set start or data)")

    def _feed_data(self, data: bytes | memoryview) -> None:
        if self._start is None:
            raise _BadField(f"{self._where}: a data chunk came before its start message")
        if self._data_in_shm:
            raise _BadField(f"{self._where}: a data chunk in a shared-memory PutRecords (its bytes are in the window)")
        if self._received + len(data) > self._start.total_bytes:
            raise _BadField(f"{self._where}: data exceeds start.total_bytes {self._start.total_bytes}")
        self._parts.append(data)
        self._summed.add(self._parts)  # hashed while the part's bytes are in cache
        self._received += len(data)

    def _finish(self) -> None:
        if self._start is None:
            return
        if self._received != self._start.total_bytes and not self._data_in_shm:
            raise _BadField(f"record {len(self.done)}: stream ended after {self._received} of "
                            f"start.total_bytes {self._start.total_bytes} bytes")
        self.done.append((self._start, self._parts))
        self.sums.append(self._summed.value())
        self._start, self._parts, self._received, self._summed = None, [], 0, PartsChecksum()

    def records(self) -> list[tuple[common_pb2.RecordStart, list[bytes | memoryview]]]:
        self._finish()
        if not self.done:
            raise _BadField("PutRecords: the stream carried no records")
        return self.done


_DELIVER_MIN_BYTES = 4 << 20  # shm gets of records this large let the SSD tier deliver into the slot
STAGE_MIN_BYTES = 1 << 20  # records this large are assembled in the SSD tier's aligned buffers (`_Stager`)
DEFER_FILL_MIN_BYTES = 4 << 20  # one LOCAL shm record this large is copied out by the SSD tier's write
MAX_STAGED_PER_CALL = 8  # beyond these (per PutRecords call) records are joined in the heap


class _Stager:
    """Assembles the large records of one PutRecords call in the SSD tier's pooled, aligned
    buffers (`SSDTier.staging`) instead of joining them in a fresh heap allocation: the payload
    is copied out of the client's shared-memory window or its message parts once, hashed block
    by block as it is copied, into memory that is already mapped (a fresh 32 MiB join faulted
    in its pages on every call: ~10 ms); and a LOCAL put writes that buffer with O_DIRECT as it
    lies, without copying the payload again. The buffers stay staged until the call's puts are
    done (`stack`); a record kept afterwards (by the host tier, a reader) holds a plain view."""

    def __init__(self, ssd: Any, stack: contextlib.ExitStack) -> None:
        self._ssd, self._stack = ssd, stack
        self._num_staged = 0
        self._deferred: list[Any] = []  # staged buffers whose fill was left to the SSD tier's write

    def settle(self) -> None:
        """After the call's puts: a deferred fill that no write consumed means nothing was
        stored from it (the SSD tier, a LOCAL put's first write, refused or failed first)."""
        for staged in self._deferred:
            if staged.pending:
                logger.debug("PutRecords: a deferred fill was not consumed (the put did not reach the SSD tier)")
        self._deferred.clear()

    def check_consumed(self) -> None:
        """After the call's puts succeeded: every deferred fill was done (and verified) by the
        SSD tier's write; anything else would be a store that wrote another tier first."""
        if any(staged.pending for staged in self._deferred):
            raise RuntimeError("a LOCAL put was acknowledged without the SSD tier's write verifying its payload")

    async def join(self, parts: Sequence[bytes | memoryview], start: common_pb2.RecordStart,
                   payload_sum: int | None, shared: bool, *, defer: bool = False) -> Record | None:
        """The verified record, its payload in a staged buffer; None when it is not worth
        staging (small, or in one message frame: kept as a view) or cannot be (compressed, a
        foreign split of the header): `join_parts` then. RecordError as `join_parts` says it.

        `defer` (one LOCAL record of a shared-memory stream, >= DEFER_FILL_MIN_BYTES): the copy
        and its checksum are left to the SSD tier, which copies the payload out of the window
        piece by piece while it writes the previous piece, and verifies it before the record
        becomes visible (`tiers._fs.Staged.defer_fill`); a mismatch fails the put with the same
        INVALID_ARGUMENT and leaves nothing. The SSD tier is a LOCAL put's first write (the
        store writes the durability tier before any cache copy), so nothing reads the payload
        before it is verified."""
        total = start.total_bytes
        if self._ssd is None or total < STAGE_MIN_BYTES or self._num_staged >= MAX_STAGED_PER_CALL \
                or (len(parts) == 1 and not shared) or len(parts[0]) < HEADER_SIZE:
            return None
        header, checksum = decode_header(memoryview(parts[0])[:HEADER_SIZE])
        if header.flags:
            return None
        if HEADER_SIZE + header.stored_length != total:
            have = total - HEADER_SIZE
            raise RecordError(f"truncated payload: {have} of {header.stored_length} bytes"
                              if have < header.stored_length else
                              f"{have - header.stored_length} trailing bytes after the payload")
        staged = self._stack.enter_context(self._ssd.staging(header.stored_length))
        self._num_staged += 1
        pieces = [memoryview(parts[0])[HEADER_SIZE:], *parts[1:]]
        if defer and shared and len(pieces) == 1 and total >= DEFER_FILL_MIN_BYTES:
            if header.key != start.key:
                raise RecordError("record key does not match the key it was stored under")
            staged.defer_fill(pieces[0], checksum)
            self._deferred.append(staged)
            return Record(header, staged.payload, checksum)
        hash_parts = shared or payload_sum is None
        if total >= OFFLOAD_BYTES:
            got = await asyncio.to_thread(copy_hashed, staged.dest, pieces, hash_parts=hash_parts)
        else:
            got = copy_hashed(staged.dest, pieces, hash_parts=hash_parts)
        if (got if hash_parts else payload_sum) != checksum:
            raise RecordError("payload checksum mismatch: the payload is corrupt")
        if header.key != start.key:
            raise RecordError("record key does not match the key it was stored under")
        return Record(header, staged.payload, checksum)


class StateStoreServicer(statestore_pb2_grpc.StateStoreServicer):
    """`statestore.v1.StateStore` over a `TieredStore`."""

    def __init__(self, owner: StateStoreServer) -> None:
        self._owner = owner
        self._calls = owner.calls

    @property
    def _store(self) -> TieredStore:
        return self._owner.store

    def _owned(self, key: bytes, tenant: str) -> StateMeta | None:
        """The index entry of `key` if it is the caller's, else None (another tenant's is a miss)."""
        meta = self._store.meta(key)
        return meta if meta is not None and meta.tenant_id == tenant_id(tenant) else None

    @_unary
    async def RegisterModel(self, request: Any, context: Any, tenant: str) -> Any:
        if not request.specs:
            raise _BadField("specs: describe at least one state kind")
        if request.layout_version < 1:
            raise _BadField("layout_version: must be >= 1")
        codecs: dict[int, int] = {}
        for i, spec in enumerate(request.specs):
            if spec.kind not in {int(k) for k in StateKind}:
                raise _BadField(f"specs[{i}].kind: unknown kind {spec.kind}; known: "
                                f"{', '.join(f'{int(k)} {k.name}' for k in StateKind)}")
            if spec.retention not in {int(r) for r in Retention}:
                raise _BadField(f"specs[{i}].retention: unknown retention {spec.retention} (1, 2 or 3)")
            if not 0 <= spec.codec <= 0xFFFF:
                raise _BadField(f"specs[{i}].codec: {spec.codec} outside 0..65535")
            codecs[spec.kind] = spec.codec
        try:
            config = json.loads(request.config_json or "{}")
        except ValueError as exc:
            raise _BadField(f"config_json: not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise _BadField("config_json: must be a JSON object")
        fingerprint = make_model_fingerprint(config, codecs, request.layout_version, request.weights_id or "unnamed")
        if fingerprint not in self._owner.models and len(self._owner.models) >= MAX_REGISTERED_MODELS:
            raise _Exhausted(f"this server already knows {MAX_REGISTERED_MODELS} model fingerprints "
                             f"(MAX_REGISTERED_MODELS); restart it or reuse a registered model")
        self._owner.models.add(fingerprint)
        return statestore_pb2.RegisterModelResponse(model_fingerprint=fingerprint,
                                                    hosted=fingerprint == self._owner.adapter.model_fingerprint)

    @_unary
    async def Lookup(self, request: Any, context: Any, tenant: str) -> Any:
        owner = self._owner
        block_size = request.block_size or owner.config.block_size
        if len(request.block_keys) > MAX_KEYS:
            raise _BadField(f"block_keys: {len(request.block_keys)} keys, at most {MAX_KEYS}")
        for i, k in enumerate(request.block_keys):
            if len(k) != 32:
                raise _BadField(f"block_keys[{i}]: a block key is 32 bytes, got {len(k)}")
        kinds = list(request.kinds) or [int(StateKind.GLOBAL_KV), int(StateKind.INDEX_K)]
        for i, kind in enumerate(kinds):
            if kind not in {int(k) for k in StateKind}:
                raise _BadField(f"kinds[{i}]: unknown kind {kind}")
        chain_tokens = len(request.block_keys) * block_size
        num_tokens = request.num_tokens or chain_tokens
        if num_tokens < chain_tokens or num_tokens > 1 << 40:
            raise _BadField(f"num_tokens: {num_tokens} must lie in [{chain_tokens} (the chain's tokens), 2^40]")
        if request.mode and request.mode not in ss.REPLAY_MODES:
            raise _BadField(f"mode: {request.mode!r} is not one of {', '.join(ss.REPLAY_MODES)}")
        if request.model_fingerprint and len(request.model_fingerprint) != 16:
            raise _BadField(f"model_fingerprint: 16 bytes, got {len(request.model_fingerprint)}")
        keys = [make_record_key(kind, bk) for bk in request.block_keys for kind in kinds]
        result = await self._store.lookup(keys)
        tid = tenant_id(tenant)

        def mine(n_keys: int) -> int:  # blocks of the prefix that are not another tenant's
            for i in range(n_keys):
                meta = self._store.meta(keys[i])
                if meta is not None and meta.tenant_id != tid:
                    return i // len(kinds)
            return n_keys // len(kinds)

        blocks = mine(result.combined)
        loaded: dict[str, int] = {}
        for key in keys[: blocks * len(kinds)]:
            meta = self._store.meta(key)
            tier = next((t for t in TIER_ORDER if meta is not None and t in meta.tiers), TierName.REDIS)
            loaded[tier.value] = loaded.get(tier.value, 0) + (meta.size_bytes if meta else 0)
        est_load = sum(DEFAULT_TIER_PROFILES[TierName(t)].latency_s
                       + b / DEFAULT_TIER_PROFILES[TierName(t)].bandwidth_bytes_per_s for t, b in loaded.items())
        persisted = min(blocks * block_size, num_tokens)
        response = statestore_pb2.LookupResponse(
            combined_blocks=blocks, per_tier=[statestore_pb2.TierBlocks(tier=t.value, blocks=mine(n))
                                              for t, n in result.per_tier.items()],
            bytes_to_load=_tier_bytes(loaded), persisted_tokens=persisted, est_load_seconds=est_load,
            est_seconds=est_load)
        hosted = owner.adapter.model_fingerprint
        if request.model_fingerprint in (b"", hosted) and block_size % owner.adapter.token_alignment == 0:
            plan = plan_replay(owner.adapter.replay_geometry(), owner.adapter.costs(),
                               request.mode or owner.config.default_mode, num_tokens, persisted)
            response.replay.CopyFrom(_replay_info(plan))
            response.est_seconds = est_load + plan.est_seconds
        return response

    @_unary
    async def PutRecords(self, request_iterator: Any, context: Any, tenant: str) -> Any:
        with contextlib.ExitStack() as staging:  # staged payloads (`_Stager`) live until the puts are done
            return await self._put_records(request_iterator, context, tenant, _Stager(self._owner.ssd, staging))

    async def _put_records(self, request_iterator: Any, context: Any, tenant: str, stager: _Stager) -> Any:
        owner = self._owner
        window = self._shm_window(context, put=True)
        assembler = _Reassembler(owner.config.max_record_bytes, owner.config.max_stream_bytes,
                                 data_in_shm=window is not None)
        tid = tenant_id(tenant)
        verified: list[tuple[Record, common_pb2.RecordStart, Durability]] = []
        async for frame in request_iterator:
            assembler.feed_frame(frame)
            if window is None:
                await self._verify_done(assembler.done, assembler.sums, verified, tid, stager)
        parts = assembler.records()
        if window is None:
            await self._verify_done(parts, assembler.sums, verified, tid, stager, final=True)
        else:  # the bytes are in the client's window: views, copied once (and hashed) by _verify
            try:
                views = slot_views(owner.shm.buffer(window), window, [start.total_bytes for start, _ in parts])
            except ShmUnavailable as exc:
                raise _Precondition(str(exc)) from None
            parts = [(start, [view]) for (start, _), view in zip(parts, views)]
            try:
                # One LOCAL record alone: the SSD tier copies it out of the window while it writes it
                # and verifies it before it becomes visible (`_Stager.join(defer=True)`).
                defer = len(parts) == 1 and parts[0][0].durability == int(Durability.LOCAL)
                verified = [await self._verify(i, start, buf, tid, stager=stager, shared=True, defer=defer)
                            for i, (start, buf) in enumerate(parts)]
                async with owner.quotas.admit_bytes(self._store, tenant, [v[0] for v in verified]):
                    response = await self._put_verified(verified, parts)
                stager.check_consumed()
                return response
            finally:
                stager.settle()  # a deferred fill no put consumed is dropped with its buffer
                for _, bufs in parts:
                    for view in bufs:
                        view.release()
        async with owner.quotas.admit_bytes(self._store, tenant, [v[0] for v in verified]):
            return await self._put_verified(verified, parts)

    async def _verify_done(self, done: list[tuple[common_pb2.RecordStart, list[bytes | memoryview]]],
                           sums: list[int | None],
                           verified: list[tuple[Record, common_pb2.RecordStart, Durability]], tid: bytes,
                           stager: _Stager, *, final: bool = False) -> None:
        """Verify the records the stream has completed since the last call, and drop their chunks.

        Called as each record completes, so its chunks are joined and checksummed while they are
        still in cache and freed at once, instead of all after the stream (nothing is stored
        until every record is verified either way; `final` marks the call after the stream).
        """
        while len(verified) < len(done):
            i = len(verified)
            start, chunks = done[i]
            verified.append(await self._verify(i, start, chunks, tid, sums[i], stager=stager))
            chunks.clear()  # the verified record holds its own copy of the payload

    def _shm_window(self, context: Any, *, put: bool) -> ShmWindow | None:
        """The shared-memory window the call names (statestore/shm.py), None without one. A put
        that names an unusable one is refused (FAILED_PRECONDITION "shm: ..."); a get falls back
        to data frames."""
        try:
            return self._owner.shm.window_from(context.invocation_metadata(), context.peer())
        except ShmUnavailable as exc:
            if put:
                raise _Precondition(str(exc)) from None
            logger.debug("GetRecords without shared memory: %s", exc)
            return None

    async def _put_verified(self, verified: list[tuple[Record, common_pb2.RecordStart, Durability]],
                            parts: list[tuple[common_pb2.RecordStart, list[bytes | memoryview]]]) -> Any:
        response = statestore_pb2.PutRecordsResponse()
        add = response.results.add  # built in place: no per-record message copied into the response
        stored_bytes = 0
        try:
            for i, (record, start, durability) in enumerate(verified):
                try:
                    put = await self._store.put(record, durability, pin=start.pin)
                except (BudgetExceeded, DurabilityUnavailable) as exc:
                    if i:
                        exc.args = (f"{exc} ({i} earlier record(s) of this stream were stored)",)
                    raise
                except RecordError as exc:  # a payload whose verification the SSD tier's write did
                    raise _BadField(f"record {i} ({start.key.hex()}): {exc}") from None
                stored_bytes += parts[i][0].total_bytes
                add(key=put.key, durability=int(put.durability), tiers=sorted(t.value for t in put.tiers),
                    evicted=len(put.evicted))
        finally:  # once per call, not per record: the counter takes a lock
            self._owner.calls.metrics.bytes_moved.labels("in").inc(stored_bytes)
        return response

    async def _verify(self, i: int, start: common_pb2.RecordStart, parts: list[bytes | memoryview],
                      tid: bytes, payload_sum: int | None = None, *, stager: _Stager | None = None,
                      shared: bool = False, defer: bool = False) -> tuple[Record, common_pb2.RecordStart, Durability]:
        """Durability, checksums, key, kind, model and tenant (`tid`: the caller's tenant id) of one
        record; returned re-stamped with the caller's tenant, with the durability it asks for.

        `shared`: `parts` is a view of a client's shared memory, which the client can still write:
        the payload is copied out before it is hashed, and the copy is what is verified and stored.
        `defer`: the payload checksum may be left to the SSD tier's write (`_Stager.join`)."""
        durability = _durability(start.durability, f"record {i}: start.durability", Durability.MEMORY)
        try:
            record = None if stager is None else await stager.join(parts, start, payload_sum, shared,
                                                                   defer=defer and durability is Durability.LOCAL)
            if record is None:
                record = await join_parts_off_loop(parts, start.total_bytes, expect_key=start.key,
                                                   keep_view=not shared, payload_sum=payload_sum)
        except RecordError as exc:
            raise _BadField(f"record {i} ({start.key.hex()}): {exc}") from None
        h = record.header
        if h.kind not in _KNOWN_KINDS:
            raise _BadField(f"record {i}: unknown kind {h.kind}; known: "
                            f"{', '.join(f'{int(k)} {k.name}' for k in StateKind)}")
        if h.model_fingerprint not in self._owner.models:
            raise _Precondition(f"record {i}: model fingerprint {h.model_fingerprint.hex()} is not registered "
                                f"on this server: call RegisterModel first (hosted model: "
                                f"{self._owner.adapter.model_fingerprint.hex()})")
        if h.tenant_id != _ZERO_TENANT and h.tenant_id != tid:
            raise _Denied(f"record {i}: its header names another tenant; leave tenant_id zero (the server "
                          f"stamps the caller's tenant)")
        existing = self._store.meta(record.key)
        if existing is not None and existing.tenant_id != tid:
            raise _Denied(f"record {i}: key {record.key.hex()} belongs to another tenant")
        return Record(with_tenant(h, tid), record.payload, record.checksum), start, durability  # checksum: verified

    @_streaming
    async def GetRecords(self, request: Any, context: Any, tenant: str) -> AsyncIterator[Any]:
        keys = _keys(request.keys, "keys", MAX_GET_KEYS)
        limit = self._owner.config.max_message_bytes - _CHUNK_HEADROOM
        chunk = min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, limit)
        if chunk < 1024:
            raise _BadField(f"chunk_bytes: {request.chunk_bytes} < 1024")
        tid = tenant_id(tenant)
        window = self._shm_window(context, put=False)
        slots = None
        if window is not None:  # found records go into the client's window (statestore/shm.py)
            await context.send_initial_metadata(((METADATA_KEY, ATTACHED),))
            slots, shm_buf = ShmSlots(window), self._owner.shm.buffer(window)
        sent_bytes = 0
        try:
            layout = frame_slices(chunk) if slots is None else None
            for key in keys:
                if layout is not None:  # a host-tier hit comes as its frames, copied once from the pages
                    got = await self._store.get_slices(key, layout, expect_tenant=tid)
                    if isinstance(got, tuple):
                        header, frames = got
                        total = HEADER_SIZE + header.raw_length
                        yield common_pb2.RecordChunk(start=common_pb2.RecordStart(key=key, total_bytes=total, found=True))
                        for frame in frames:
                            yield frame  # a serialized RecordChunk{data}: see `serialize_chunk`
                        sent_bytes += total
                        continue
                    record = got
                elif slots is not None and self._owner.ssd is not None:
                    record, delivered = await self._get_delivering(key, tenant, tid, slots, shm_buf)
                    if delivered:  # the SSD tier read it straight into its slot: only its header is left
                        total = encoded_size(record)
                        write_slot_header(shm_buf, slots.take(total), record)
                        yield common_pb2.RecordChunk(start=common_pb2.RecordStart(key=key, total_bytes=total,
                                                                                  found=True))
                        sent_bytes += total
                        continue
                else:
                    record = await self._store.get(key, expect_tenant=tid)
                if record is None:
                    yield common_pb2.RecordChunk(start=common_pb2.RecordStart(key=key, found=False))
                    continue
                total = encoded_size(record)
                at = slots.take(total) if slots is not None else None
                if at is not None:
                    await write_slot(shm_buf, at, record)
                    yield common_pb2.RecordChunk(start=common_pb2.RecordStart(key=key, total_bytes=total, found=True))
                    sent_bytes += total
                    continue
                if slots is not None and slots.num_used:
                    return  # the window is full: the client asks again for the keys left
                yield common_pb2.RecordChunk(start=common_pb2.RecordStart(key=key, total_bytes=total, found=True))
                for frame in record_frames(record, chunk):
                    yield frame  # a serialized RecordChunk{data}: see `serialize_chunk`
                sent_bytes += total
        finally:  # once per call, not per record: the counter takes a lock
            self._calls.metrics.bytes_moved.labels("out").inc(sent_bytes)

    async def _get_delivering(self, key: bytes, tenant: str, tid: bytes, slots: ShmSlots,
                              shm_buf: Any) -> tuple[Record | None, bool]:
        """`store.get` for a shared-memory GetRecords: when the caller's record would fit the
        window's next slot, the SSD tier (if it reads it from the disk) copies the payload
        into that slot piece by piece while it reads the rest (`SSDTier.reading_into`), instead
        of the whole payload being copied after the read. Returns the record and whether its
        verified payload is in the slot (the slot is not taken yet either way)."""
        meta = self._owned(key, tenant)
        at = slots.peek(meta.size_bytes) if meta is not None and meta.size_bytes >= _DELIVER_MIN_BYTES else None
        if at is None:
            return await self._store.get(key, expect_tenant=tid), False
        dest = memoryview(shm_buf)[at + HEADER_SIZE:at + meta.size_bytes]
        try:
            with self._owner.ssd.reading_into(key, dest, tid) as target:
                record = await self._store.get(key, expect_tenant=tid)
        finally:
            dest.release()
        return record, record is not None and target.filled and encoded_size(record) == meta.size_bytes

    async def _set_pins(self, request: Any, tenant: str, pinned: bool) -> Any:
        keys = _keys(request.keys, "keys")
        metas = [self._owned(k, tenant) for k in keys]
        missing = [k.hex() for k, m in zip(keys, metas) if m is None]
        if missing:
            raise _NotFound(f"{len(missing)} of {len(keys)} keys are not stored on this node (first: {missing[0]}); "
                            f"nothing was changed")
        changed = sum(1 for m in metas if m is not None and m.pinned != pinned)
        for key in keys:
            (self._store.pin if pinned else self._store.unpin)(key)
        return statestore_pb2.KeysResponse(changed=changed)

    @_unary
    async def Pin(self, request: Any, context: Any, tenant: str) -> Any:
        return await self._set_pins(request, tenant, True)

    @_unary
    async def Unpin(self, request: Any, context: Any, tenant: str) -> Any:
        return await self._set_pins(request, tenant, False)

    @_unary
    async def Evict(self, request: Any, context: Any, tenant: str) -> Any:
        keys = _keys(request.keys, "keys")
        tiers: list[TierName] = []
        for i, name in enumerate(request.tiers):
            try:
                tiers.append(TierName(name))
            except ValueError:
                raise _BadField(f"tiers[{i}]: unknown tier {name!r}; use host, ssd or redis") from None
        out = []
        for key in keys:
            removed: frozenset[TierName] = frozenset()
            if self._owned(key, tenant) is not None:  # another tenant's key: nothing, silently
                removed = await self._store.evict(key, tiers or None, force=request.force)
            out.append(statestore_pb2.EvictedInfo(key=key, tiers=sorted(t.value for t in removed)))
        return statestore_pb2.EvictResponse(evicted=out)

    @_unary
    async def Stats(self, request: Any, context: Any, tenant: str) -> Any:
        owner = self._owner
        response = statestore_pb2.StatsResponse(num_records=len(self._store), live_sessions=owner.live_sessions(),
                                                model_fingerprint=owner.adapter.model_fingerprint,
                                                model_name=owner.adapter.model_name,
                                                uptime_seconds=time.monotonic() - owner.started_at)
        for name, ts in self._store.stats().items():
            response.tiers.append(statestore_pb2.TierStatsInfo(tier=name.value, budget_bytes=ts.budget_bytes,
                                                               resident_bytes=ts.resident_bytes, fill=ts.fill,
                                                               healthy=ts.healthy))
            for kind, ks in ts.by_kind.items():
                response.kinds.append(statestore_pb2.KindStatsInfo(
                    tier=name.value, kind=kind, kind_name=kind_name(kind), num_records=ks.num_records,
                    resident_bytes=ks.resident_bytes, hits=ks.hits, misses=ks.misses, evictions=ks.evictions,
                    promotions=ks.promotions))
        return response

    @_unary
    async def List(self, request: Any, context: Any, tenant: str) -> Any:
        limit = request.limit or 1000
        if limit > 100_000:
            raise _BadField(f"limit: {limit} > 100000")
        tid = tenant_id(tenant)
        metas = [m for k in self._store.keys() if (m := self._store.meta(k)) is not None
                 and m.tenant_id == tid and (not request.kind or m.kind == request.kind)]
        metas.sort(key=lambda m: m.created)
        return statestore_pb2.ListResponse(records=[_record_info(m) for m in metas[:limit]],
                                           truncated=len(metas) > limit)

    @_unary
    async def Inspect(self, request: Any, context: Any, tenant: str) -> Any:
        key = _record_key(request.key, "key")
        meta = self._owned(key, tenant)
        if meta is None:
            raise _NotFound(f"record {key.hex()} is not stored on this node")
        info = _record_info(meta)
        explained = self._store.explain(key)
        if explained is not None:
            info.explain_json = json.dumps(explained, sort_keys=True, default=str)
        return info


# ----- Sessions ----------------------------------------------------------------------------


class SessionsServicer(sessions_pb2_grpc.SessionsServicer):
    """`statestore.v1.Sessions` over a `SessionManager`."""

    def __init__(self, owner: StateStoreServer) -> None:
        self._owner = owner
        self._calls = owner.calls

    @property
    def _sessions(self) -> ss.SessionManager:
        return self._owner.sessions

    @_unary
    async def Create(self, request: Any, context: Any, tenant: str) -> Any:
        self._sessions.check_session_id(request.session_id)
        async with self._owner.quotas.admit_session(tenant, lambda: self._count_sessions(tenant)):
            return _session_info(await self._sessions.create(tenant, request.session_id))

    async def _count_sessions(self, tenant: str) -> int:
        return len(await self._sessions.list(tenant))

    @_unary
    async def Append(self, request: Any, context: Any, tenant: str) -> Any:
        n = len(request.token_ids)
        if not 1 <= n <= MAX_APPEND_TOKENS:
            raise _BadField(f"token_ids: {n} ids, give 1..{MAX_APPEND_TOKENS} per Append")
        vocab = self._owner.adapter.config.vocab_size
        bad = next((t for t in request.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise _BadField(f"token_ids: id {bad} outside the model's vocabulary [0, {vocab})")
        return _session_info(await self._sessions.append(tenant, request.session_id, list(request.token_ids)))

    @_streaming
    async def Generate(self, request: Any, context: Any, tenant: str) -> AsyncIterator[Any]:
        total = request.num_tokens
        if not 1 <= total <= 1 << 16:
            raise _BadField(f"num_tokens: {total} outside [1, 65536]")
        if not 0.0 <= request.temperature <= 100.0:
            raise _BadField(f"temperature: {request.temperature} outside [0, 100]")
        step = request.chunk_tokens or 16
        if step > 1 << 16:
            raise _BadField(f"chunk_tokens: {step} > 65536")
        done = 0
        while done < total:
            n = min(step, total - done)
            seed = request.seed + done if request.temperature > 0 else None
            tokens = await self._sessions.generate(tenant, request.session_id, n, request.temperature, seed)
            done += n
            yield sessions_pb2.GenerateChunk(token_ids=tokens)

    @_unary
    async def Checkpoint(self, request: Any, context: Any, tenant: str) -> Any:
        durability = _durability(request.durability, "durability",
                                 Durability[self._owner.config.durability.upper()])
        report = await self._sessions.checkpoint(tenant, request.session_id, durability)
        return sessions_pb2.CheckpointInfo(version=report.version, num_tokens=report.num_tokens,
                                           new_blocks=report.new_blocks, shared_blocks=report.shared_blocks,
                                           bytes_written=report.bytes_written, total_bytes=report.total_bytes,
                                           seconds=report.seconds)

    def _check_mode(self, mode: str) -> str | None:
        if mode and mode not in ss.REPLAY_MODES:
            raise _BadField(f"mode: {mode!r} is not one of {', '.join(ss.REPLAY_MODES)}")
        return mode or None

    @_unary
    async def Resume(self, request: Any, context: Any, tenant: str) -> Any:
        mode = self._check_mode(request.mode)
        info = await self._sessions.get(tenant, request.session_id)
        if info.live:
            raise _Precondition(f"session {request.session_id!r} is already active on this node; Drop it first "
                                f"to resume from its checkpoint")
        report = await self._sessions.resume(tenant, request.session_id, mode)
        metrics = self._calls.metrics
        metrics.replay_tokens.labels(report.mode).inc(report.replay_tokens)
        metrics.resume_seconds.labels(report.mode).observe(report.seconds)
        return sessions_pb2.ResumeInfo(mode=report.mode, num_tokens=report.num_tokens,
                                       persisted_tokens=report.persisted_tokens, bytes_loaded=report.bytes_loaded,
                                       replay_tokens=report.replay_tokens, row_layers=report.row_layers,
                                       load_seconds=report.load_seconds, replay_seconds=report.replay_seconds)

    @_unary
    async def PlanResume(self, request: Any, context: Any, tenant: str) -> Any:
        plan = await self._sessions.plan_resume(tenant, request.session_id, self._check_mode(request.mode))
        return sessions_pb2.ResumePlanInfo(
            session_id=plan.session_id, num_tokens=plan.num_tokens, bytes_by_tier=_tier_bytes(plan.bytes_by_tier),
            missing_blocks=plan.missing_blocks, rings_available=plan.rings_available,
            replay=_replay_info(plan.replay), est_load_seconds=plan.est_load_seconds, est_seconds=plan.est_seconds)

    @_unary
    async def Get(self, request: Any, context: Any, tenant: str) -> Any:
        return _session_info(await self._sessions.get(tenant, request.session_id))

    @_unary
    async def List(self, request: Any, context: Any, tenant: str) -> Any:
        return sessions_pb2.ListSessionsResponse(sessions=[_session_info(i) for i in await self._sessions.list(tenant)])

    @_unary
    async def Delete(self, request: Any, context: Any, tenant: str) -> Any:
        return sessions_pb2.DeleteInfo(done=await self._sessions.delete(tenant, request.session_id))

    @_unary
    async def Drop(self, request: Any, context: Any, tenant: str) -> Any:
        self._sessions.check_session_id(request.session_id)
        if not await self._sessions.drop(tenant, request.session_id):
            raise _NotFound(f"session {request.session_id!r} is not active on this node")
        return sessions_pb2.DeleteInfo(done=True)


# ----- the server ----------------------------------------------------------------------------


def serialize_chunk(message: bytes | common_pb2.RecordChunk) -> bytes:
    """RecordChunk serializer that passes frames already serialized by `statestore.wire` through."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_statestore_servicer(servicer: StateStoreServicer, server: grpc.aio.Server) -> None:
    """The generated `add_StateStoreServicer_to_server`, except on the record data path:
    PutRecords gets its messages as bytes (data chunks are read without a protobuf copy) and
    GetRecords may yield serialized frames. The wire format is unchanged."""
    _add_servicer(servicer, server, statestore_pb2.DESCRIPTOR.services_by_name["StateStore"])


def _add_servicer(servicer: Any, server: grpc.aio.Server, service: Any) -> None:
    """Register `servicer`'s methods of `service` (a descriptor) as the generated code does, with
    requests that fail to parse passed to the handler as `_Undecodable` (INVALID_ARGUMENT)."""
    handlers = {}
    for method in service.methods:
        deserialize = None if method.name == "PutRecords" else _lenient_deserializer(GetMessageClass(method.input_type))
        serialize = serialize_chunk if method.name == "GetRecords" else \
            GetMessageClass(method.output_type).SerializeToString
        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[method.client_streaming, method.server_streaming]
        handlers[method.name] = kind(getattr(servicer, method.name), request_deserializer=deserialize,
                                     response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


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
        self.ssd: Any = None  # the SSD tier, whose aligned buffers stage large records (`_Stager`)
        self.sessions: ss.SessionManager
        self.adapter: Any = None
        self.metrics = ServiceMetrics(lambda: self.store.stats())
        self.calls = _Calls(TokenAuth(config.tokens), self.metrics)
        self.quotas = TenantQuotas.from_config(config)
        self.metrics_port = 0
        self.open_report = OpenReport({}, {})  # what the start-up scans indexed and discarded
        self._server: grpc.aio.Server | None = None
        self.shm = ShmAttachments()  # clients' shared-memory regions (statestore/shm.py)
        self._health = health.aio.HealthServicer()
        self._stopped = asyncio.Event()

    def live_sessions(self) -> int:
        return len(getattr(self.sessions, "_live", {}))

    async def _open_store(self) -> TieredStore:
        from tiers.host import HostTier
        from tiers.ssd import SSDTier

        c = self.config
        specs = self.adapter.state_specs()
        retention = {int(s.kind): s.retention for s in specs}
        policy, store_config = None, StoreConfig(retention_by_kind=retention)
        if c.policy == "cost":  # before any tier opens: a missing profile leaves nothing locked
            from statestore.cost_policy import CostAwarePolicy
            from statestore.profile import CostProfile

            profile = await asyncio.to_thread(CostProfile.load, c.profile)
            policy = CostAwarePolicy(profile)  # its measured tier costs price loads for the store too
            store_config = StoreConfig(retention_by_kind=retention, tier_profiles=profile.tier_profiles())
        host = HostTier(c.host_budget_bytes, make_page_sizes(specs, c.block_size))
        ssd = await SSDTier.create(c.ssd_dir, budget_bytes=c.ssd_budget_bytes)
        redis = None
        if c.redis_url:
            from tiers.redis import RedisTier

            redis = RedisTier(c.redis_url, prefix=c.redis_prefix)
        store = TieredStore(host=host, ssd=ssd, redis=redis, policy=policy, config=store_config)
        self.ssd = ssd
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
        _add_servicer(SessionsServicer(self), server, sessions_pb2.DESCRIPTOR.services_by_name["Sessions"])
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

    async def _close_layers(self) -> None:
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
