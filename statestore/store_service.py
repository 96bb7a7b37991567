"""`statestore.v1.StateStore` on the wire: a thin translator from its messages to `TieredStore`
calls (`StateStoreServicer`), served by `statestore.server.StateStoreServer`.

Every handler goes through `statestore.rpc`'s wrappers: they resolve the caller's tenant from
its bearer token and map what the layers below raise to status codes (DESIGN.md §6, the table
in `statestore.rpc`); the server keeps serving whatever a call raised.

Nothing is stored before the whole request is verified: a PutRecords stream is reassembled
(`statestore.record_stream`) and every record's checksums, key, kind, model and tenant are
checked before the first put, so a malformed or interrupted stream leaves stored state unchanged.
(What may happen earlier is invisible: a verified MEMORY record is copied into host pages while
the stream still comes in, `HostTier.stage`, and those pages go back if the call ends unstored.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import operator
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from engine_adapter.base import Retention, StateKind
from proto.statestore.v1 import common_pb2, statestore_pb2, statestore_pb2_grpc
from replay import plan_replay
from statestore import sessions as ss
from statestore.keys import make_model_fingerprint, tenant_id
from statestore.messages import (MAX_KEYS, durability_of, record_info, record_key, record_keys, replay_info,
                                 tier_bytes)
from statestore.metrics import kind_name
from statestore.record_stream import Reassembler, Stager, with_server_checksum
from statestore.rpc import BadField, Denied, Exhausted, NotFound, Precondition, add_servicer, streaming, unary
from statestore.shm import (ATTACHED, LENT_METADATA_KEY, METADATA_KEY, ShmSlots, ShmUnavailable, ShmWindow,
                            slot_views, write_slot, write_slot_header)
from statestore.store import BudgetExceeded, DurabilityUnavailable, TieredStore
from statestore.types import DEFAULT_TIER_PROFILES, Durability, StateMeta, TierName
from statestore.wire import OFFLOAD_BYTES, encoded_size, frame_slices, join_parts_off_loop, record_frames
from tiers.offload import run_to_completion
from tiers.record import HEADER_SIZE, TENANT_BYTES, Record, RecordError, record_key_prefix, with_tenant

if TYPE_CHECKING:
    from statestore.server import StateStoreServer

logger = logging.getLogger(__name__)

MAX_GET_KEYS = 4096
DEFAULT_CHUNK_BYTES = 1 << 20
_CHUNK_HEADROOM = 4096  # message framing beside a data chunk
MAX_REGISTERED_MODELS = 1024  # fingerprints RegisterModel remembers: bounded, so callers cannot grow it forever
_KNOWN_KINDS = frozenset(int(k) for k in StateKind)
_ZERO_TENANT = bytes(TENANT_BYTES)
_DELIVER_MIN_BYTES = 4 << 20  # shm gets of records this large let the SSD tier deliver into the slot
LIST_CHUNK = 16_384  # index entries a List reads between yields to the event loop
_CREATED = operator.attrgetter("created")  # List's order: oldest first


@dataclass(frozen=True, slots=True)
class _LentInto:
    """Where GetRecords delivers the last `bytes` of a record of `total_bytes` (lent memory)."""

    buf: Any
    total_bytes: int
    offset: int
    bytes: int


def _check_lent_range(where: str, offset: int, nbytes: int, total_bytes: int, lent: Any) -> None:
    """The last `nbytes` of a `total_bytes` record at `offset` of the lent memory: at least one
    byte, never the header (it lies in the slot), inside the lent memory."""
    if not 0 < nbytes <= total_bytes - HEADER_SIZE:
        raise BadField(f"{where}: {nbytes} lent bytes outside [1, total_bytes - {HEADER_SIZE}] "
                       f"(the header lies in the slot)")
    if offset + nbytes > len(lent):
        raise BadField(f"{where}: lent bytes [{offset}, +{nbytes}) exceed the {len(lent)}-byte lent memory")


def _lent_destinations(lent_request: Any, lent: Any) -> list[_LentInto | None]:
    """GetRecordsRequest.lent, checked against the lent memory (all zero: none for that key)."""
    out: list[_LentInto | None] = []
    for i, d in enumerate(lent_request):
        if not (d.total_bytes or d.offset or d.bytes):
            out.append(None)
            continue
        _check_lent_range(f"lent[{i}]", d.offset, d.bytes, d.total_bytes, lent)
        out.append(_LentInto(lent, d.total_bytes, d.offset, d.bytes))
    return out


def _lent_bytes(i: int, start: common_pb2.RecordStart, lent: Any) -> int:
    """How many of record i's bytes lie in the call's lent memory (statestore/shm.py), checked."""
    if not start.lent_bytes and not start.lent_offset:
        return 0
    if lent is None:
        raise BadField(f"record {i}: start.lent_bytes / lent_offset without lent memory ({LENT_METADATA_KEY})")
    _check_lent_range(f"record {i}", start.lent_offset, start.lent_bytes, start.total_bytes, lent)
    return start.lent_bytes


def _slot_bytes(total_bytes: int, into: _LentInto | None) -> int:
    """The bytes of a `total_bytes` record that go in its slot (the rest, if any, into lent memory)."""
    return total_bytes - (into.bytes if into is not None else 0)


def _found_start(key: bytes, total: int, into: _LentInto | None, verified: bool = False) -> Any:
    """The start message of a record GetRecords found (and where its lent bytes went, if any)."""
    return common_pb2.RecordChunk(start=common_pb2.RecordStart(
        key=key, total_bytes=total, found=True, lent_offset=into.offset if into else 0,
        lent_bytes=into.bytes if into else 0, verified=verified))


class StateStoreServicer(statestore_pb2_grpc.StateStoreServicer):
    """`statestore.v1.StateStore` over a `TieredStore`."""

    def __init__(self, owner: StateStoreServer) -> None:
        self._owner = owner
        self._calls = owner.calls

    @property
    def _store(self) -> TieredStore:
        return self._owner.store

    def _owned(self, key: bytes, tid: bytes) -> StateMeta | None:
        """The index entry of `key` if it is the caller's (`tid`: its tenant id), else None
        (another tenant's is a miss). Callers hash the tenant once per call, not per key."""
        meta = self._store.meta(key)
        return meta if meta is not None and meta.tenant_id == tid else None

    @unary
    async def RegisterModel(self, request: Any, context: Any, tenant: str) -> Any:
        if not request.specs:
            raise BadField("specs: describe at least one state kind")
        if request.layout_version < 1:
            raise BadField("layout_version: must be >= 1")
        codecs: dict[int, int] = {}
        for i, spec in enumerate(request.specs):
            if spec.kind not in {int(k) for k in StateKind}:
                raise BadField(f"specs[{i}].kind: unknown kind {spec.kind}; known: "
                                f"{', '.join(f'{int(k)} {k.name}' for k in StateKind)}")
            if spec.retention not in {int(r) for r in Retention}:
                raise BadField(f"specs[{i}].retention: unknown retention {spec.retention} (1, 2 or 3)")
            if not 0 <= spec.codec <= 0xFFFF:
                raise BadField(f"specs[{i}].codec: {spec.codec} outside 0..65535")
            codecs[spec.kind] = spec.codec
        try:
            config = json.loads(request.config_json or "{}")
        except ValueError as exc:
            raise BadField(f"config_json: not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise BadField("config_json: must be a JSON object")
        fingerprint = make_model_fingerprint(config, codecs, request.layout_version, request.weights_id or "unnamed")
        if fingerprint not in self._owner.models and len(self._owner.models) >= MAX_REGISTERED_MODELS:
            raise Exhausted(f"this server already knows {MAX_REGISTERED_MODELS} model fingerprints "
                             f"(MAX_REGISTERED_MODELS); restart it or reuse a registered model")
        self._owner.models.add(fingerprint)
        return statestore_pb2.RegisterModelResponse(model_fingerprint=fingerprint,
                                                    hosted=fingerprint == self._owner.adapter.model_fingerprint)

    @staticmethod
    def _chain_keys(request: Any) -> tuple[list[bytes], list[int]]:
        """The record keys of a request's `block_keys` x `kinds` (Lookup, RequestDone), checked."""
        if len(request.block_keys) > MAX_KEYS:
            raise BadField(f"block_keys: {len(request.block_keys)} keys, at most {MAX_KEYS}")
        block_keys = list(request.block_keys)  # (each read of a repeated field makes its bytes anew)
        for i, k in enumerate(block_keys):
            if len(k) != 32:
                raise BadField(f"block_keys[{i}]: a block key is 32 bytes, got {len(k)}")
        kinds = list(request.kinds) or [int(StateKind.GLOBAL_KV), int(StateKind.INDEX_K)]
        for i, kind in enumerate(kinds):
            if kind not in _KNOWN_KINDS:
                raise BadField(f"kinds[{i}]: unknown kind {kind}")
        prefixes = [record_key_prefix(kind) for kind in kinds]  # (block keys are checked above)
        return [prefix + bk for bk in block_keys for prefix in prefixes], kinds

    @unary
    async def Lookup(self, request: Any, context: Any, tenant: str) -> Any:
        owner = self._owner
        block_size = request.block_size or owner.config.block_size
        keys, kinds = self._chain_keys(request)
        chain_tokens = len(request.block_keys) * block_size
        num_tokens = request.num_tokens or chain_tokens
        if num_tokens < chain_tokens or num_tokens > 1 << 40:
            raise BadField(f"num_tokens: {num_tokens} must lie in [{chain_tokens} (the chain's tokens), 2^40]")
        if request.mode and request.mode not in ss.REPLAY_MODES:
            raise BadField(f"mode: {request.mode!r} is not one of {', '.join(ss.REPLAY_MODES)}")
        if request.model_fingerprint and len(request.model_fingerprint) != 16:
            raise BadField(f"model_fingerprint: 16 bytes, got {len(request.model_fingerprint)}")
        result = await self._store.lookup(keys)
        width = len(kinds)
        reach = max(result.combined, *result.per_tier.values(), 0)  # the keys any answer counts
        metas = self._store.metas(keys[:reach])
        tid = tenant_id(tenant)
        foreign = next((i for i, meta in enumerate(metas) if meta is not None and meta.tenant_id != tid), reach)

        def mine(n_keys: int) -> int:  # blocks of the prefix that are not another tenant's
            return min(n_keys, foreign) // width

        blocks = mine(result.combined)
        by_tier: dict[TierName, int] = {}
        for meta in metas[: blocks * width]:  # bytes to load from each key's fastest tier
            tier = meta.resident[0][0] if meta is not None and meta.resident else TierName.REDIS
            by_tier[tier] = by_tier.get(tier, 0) + (meta.size_bytes if meta is not None else 0)
        loaded = {tier.value: nbytes for tier, nbytes in by_tier.items()}
        est_load = sum(DEFAULT_TIER_PROFILES[TierName(t)].latency_s
                       + b / DEFAULT_TIER_PROFILES[TierName(t)].bandwidth_bytes_per_s for t, b in loaded.items())
        persisted = min(blocks * block_size, num_tokens)
        response = statestore_pb2.LookupResponse(
            combined_blocks=blocks, per_tier=[statestore_pb2.TierBlocks(tier=t.value, blocks=mine(n))
                                              for t, n in result.per_tier.items()],
            bytes_to_load=tier_bytes(loaded), persisted_tokens=persisted, est_load_seconds=est_load,
            est_seconds=est_load)
        hosted = owner.adapter.model_fingerprint
        if request.model_fingerprint in (b"", hosted) and block_size % owner.adapter.token_alignment == 0:
            plan = plan_replay(owner.adapter.replay_geometry(), owner.adapter.costs(),
                               request.mode or owner.config.default_mode, num_tokens, persisted)
            response.replay.CopyFrom(replay_info(plan))
            response.est_seconds = est_load + plan.est_seconds
        return response

    @unary
    async def PutRecords(self, request_iterator: Any, context: Any, tenant: str) -> Any:
        with contextlib.ExitStack() as staging:  # staged payloads (`Stager`) live until the puts are done
            return await self._put_records(request_iterator, context, tenant,
                                           Stager(self._owner.ssd, staging, self._owner.host))

    async def _put_records(self, request_iterator: Any, context: Any, tenant: str, stager: Stager) -> Any:
        owner = self._owner
        window = self._shm_window(context, put=True)
        assembler = Reassembler(owner.config.max_record_bytes, owner.config.max_stream_bytes,
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
        else:  # the bytes are in the client's window (and lent memory): views, copied once (and hashed) by _verify
            try:
                lent = owner.shm.lent_from(context.invocation_metadata(), window)
                views = slot_views(owner.shm.buffer(window), window,
                                   [start.total_bytes - _lent_bytes(i, start, lent) for i, (start, _) in enumerate(parts)])
            except ShmUnavailable as exc:
                raise Precondition(str(exc)) from None
            parts = [(start, [view] if not start.lent_bytes else
                      [view, memoryview(lent)[start.lent_offset:start.lent_offset + start.lent_bytes]])  # type: ignore[arg-type]
                     for (start, _), view in zip(parts, views)]
            try:
                # A LOCAL record the SSD tier copies out of the window while it writes it, verifying it
                # before it becomes visible (`Stager.join(defer=True)`): one alone, or any whose payload
                # checksum the server takes (lent memory: there is no client checksum that could fail
                # after an earlier record of the stream was stored, so nothing-before-verified holds).
                verified = [await self._verify(i, start, buf, tid, stager=stager, shared=True,
                                               defer=len(parts) == 1 or start.checksum_by_server)
                            for i, (start, buf) in enumerate(parts)]
                async with owner.quotas.admit_bytes(self._store, tenant, [v[0] for v in verified]):
                    response = await run_to_completion(self._put_verified(verified, parts))
                stager.check_consumed()
                return response
            finally:
                stager.settle()  # a deferred fill no put consumed is dropped with its buffer
                for _, bufs in parts:
                    for view in bufs:
                        view.release()
        async with owner.quotas.admit_bytes(self._store, tenant, [v[0] for v in verified]):
            return await run_to_completion(self._put_verified(verified, parts))

    async def _verify_done(self, done: list[tuple[common_pb2.RecordStart, list[bytes | memoryview]]],
                           sums: list[int | None],
                           verified: list[tuple[Record, common_pb2.RecordStart, Durability]], tid: bytes,
                           stager: Stager, *, final: bool = False) -> None:
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
            if verified[-1][2] is Durability.MEMORY:
                stager.stage_in_host(verified[-1][0])  # copied into its pages now, stored after the stream

    def _shm_window(self, context: Any, *, put: bool) -> ShmWindow | None:
        """The shared-memory window the call names (statestore/shm.py), None without one. A put
        that names an unusable one is refused (FAILED_PRECONDITION "shm: ..."); a get falls back
        to data frames."""
        try:
            return self._owner.shm.window_from(context.invocation_metadata(), context.peer())
        except ShmUnavailable as exc:
            if put:
                raise Precondition(str(exc)) from None
            logger.debug("GetRecords without shared memory: %s", exc)
            return None

    async def _put_verified(self, verified: list[tuple[Record, common_pb2.RecordStart, Durability]],
                            parts: list[tuple[common_pb2.RecordStart, list[bytes | memoryview]]]) -> Any:
        """Store the verified records in order (run to completion: a client that goes away once
        the puts began does not cut one off halfway, leaving a tier holding a record the store
        does not know; its call ends once they are done)."""
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
                    raise BadField(f"record {i} ({start.key.hex()}): {exc}") from None
                stored_bytes += parts[i][0].total_bytes
                add(key=put.key, durability=int(put.durability), tiers=sorted(t.value for t in put.tiers),
                    evicted=len(put.evicted))
        finally:  # once per call, not per record: the counter takes a lock
            self._owner.calls.metrics.bytes_moved.labels("in").inc(stored_bytes)
        return response

    async def _verify(self, i: int, start: common_pb2.RecordStart, parts: list[bytes | memoryview],
                      tid: bytes, payload_sum: int | None = None, *, stager: Stager | None = None,
                      shared: bool = False, defer: bool = False) -> tuple[Record, common_pb2.RecordStart, Durability]:
        """Durability, checksums, key, kind, model and tenant (`tid`: the caller's tenant id) of one
        record; returned re-stamped with the caller's tenant, with the durability it asks for.

        `shared`: `parts` is a view of a client's shared memory, which the client can still write:
        the payload is copied out before it is hashed, and the copy is what is verified and stored.
        `defer`: the payload checksum may be left to the SSD tier's write (`Stager.join`)."""
        durability = durability_of(start.durability, f"record {i}: start.durability", Durability.MEMORY)
        by_server = start.checksum_by_server
        if by_server and not start.lent_bytes:
            raise BadField(f"record {i}: start.checksum_by_server without lent bytes (shared memory only)")
        try:
            record = None if stager is None else await stager.join(parts, start, payload_sum, shared,
                                                                   defer=defer and durability is Durability.LOCAL,
                                                                   checksum_by_server=by_server)
            if record is None and by_server:  # not a deferred write: take the checksum now, then as usual
                parts = await asyncio.to_thread(with_server_checksum, parts) \
                    if start.total_bytes >= OFFLOAD_BYTES else with_server_checksum(parts)
                payload_sum = None
                record = None if stager is None else await stager.join(parts, start, None, shared)
            if record is None:
                record = await join_parts_off_loop(parts, start.total_bytes, expect_key=start.key,
                                                   keep_view=not shared, payload_sum=payload_sum)
        except RecordError as exc:
            raise BadField(f"record {i} ({start.key.hex()}): {exc}") from None
        h = record.header
        if h.kind not in _KNOWN_KINDS:
            raise BadField(f"record {i}: unknown kind {h.kind}; known: "
                            f"{', '.join(f'{int(k)} {k.name}' for k in StateKind)}")
        if h.model_fingerprint not in self._owner.models:
            raise Precondition(f"record {i}: model fingerprint {h.model_fingerprint.hex()} is not registered "
                                f"on this server: call RegisterModel first (hosted model: "
                                f"{self._owner.adapter.model_fingerprint.hex()})")
        if h.tenant_id != _ZERO_TENANT and h.tenant_id != tid:
            raise Denied(f"record {i}: its header names another tenant; leave tenant_id zero (the server "
                          f"stamps the caller's tenant)")
        existing = self._store.meta(record.key)
        if existing is not None and existing.tenant_id != tid:
            raise Denied(f"record {i}: key {record.key.hex()} belongs to another tenant")
        return Record(with_tenant(h, tid), record.payload, record.checksum), start, durability  # checksum: verified

    @streaming
    async def GetRecords(self, request: Any, context: Any, tenant: str) -> AsyncIterator[Any]:
        keys = record_keys(request.keys, "keys", MAX_GET_KEYS)
        limit = self._owner.config.max_message_bytes - _CHUNK_HEADROOM
        chunk = min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, limit)
        if chunk < 1024:
            raise BadField(f"chunk_bytes: {request.chunk_bytes} < 1024")
        tid = tenant_id(tenant)
        if request.lent and len(request.lent) != len(keys):
            raise BadField(f"lent: {len(request.lent)} destinations for {len(keys)} keys (give none or one per key)")
        window = self._shm_window(context, put=False)
        slots, lent, dests = None, None, [None] * len(keys)
        if window is not None:  # found records go into the client's window (statestore/shm.py)
            lent = self._lent_for_get(context, window) if request.lent else None
            if lent is not None:
                dests = _lent_destinations(request.lent, lent)
            await context.send_initial_metadata(((METADATA_KEY, ATTACHED),))
            slots, shm_buf = ShmSlots(window), self._owner.shm.buffer(window)
        sent_bytes = 0
        try:
            layout = frame_slices(chunk) if slots is None else None
            for i, key in enumerate(keys):
                if layout is not None:  # a host-tier hit comes as its frames, copied once from the pages
                    got = await self._store.get_slices(key, layout, expect_tenant=tid)
                    if isinstance(got, tuple):
                        header, frames = got
                        total = HEADER_SIZE + header.raw_length
                        yield common_pb2.RecordChunk(start=common_pb2.RecordStart(key=key, total_bytes=total, found=True))
                        for frame in frames:
                            yield frame  # a serialized RecordChunk{data}: see `statestore.rpc.serialize_chunk`
                        sent_bytes += total
                        continue
                    record = got
                elif slots is not None and self._owner.ssd is not None:
                    record, delivered, into = await self._get_delivering(key, tid, slots, shm_buf, dests[i])
                    if delivered:  # the SSD tier read it straight into its slot: only its header is left
                        total = encoded_size(record)
                        write_slot_header(shm_buf, slots.take(_slot_bytes(total, into)), record)
                        yield _found_start(key, total, into, verified=into is not None)
                        sent_bytes += total
                        continue
                else:
                    record = await self._store.get(key, expect_tenant=tid)
                if record is None:
                    yield common_pb2.RecordChunk(start=common_pb2.RecordStart(key=key, found=False))
                    continue
                total = encoded_size(record)
                into = dests[i] if slots is not None and dests[i] is not None and \
                    dests[i].total_bytes == total else None
                at = slots.take(_slot_bytes(total, into)) if slots is not None else None
                if at is not None:
                    lent_view = memoryview(lent)[into.offset:into.offset + into.bytes] if into else None
                    try:
                        await write_slot(shm_buf, at, record, lent_view)
                    finally:
                        if lent_view is not None:
                            lent_view.release()
                    yield _found_start(key, total, into)
                    sent_bytes += total
                    continue
                if slots is not None and slots.num_used:
                    return  # the window is full: the client asks again for the keys left
                yield common_pb2.RecordChunk(start=common_pb2.RecordStart(key=key, total_bytes=total, found=True))
                for frame in record_frames(record, chunk):
                    yield frame  # a serialized RecordChunk{data}: see `statestore.rpc.serialize_chunk`
                sent_bytes += total
        finally:  # once per call, not per record: the counter takes a lock
            self._calls.metrics.bytes_moved.labels("out").inc(sent_bytes)

    async def _get_delivering(self, key: bytes, tid: bytes, slots: ShmSlots, shm_buf: Any, lent: _LentInto | None
                              ) -> tuple[Record | None, bool, _LentInto | None]:
        """`store.get` for a shared-memory GetRecords: when the caller's record would fit the
        window's next slot, the SSD tier (if it reads it from the disk) copies the payload
        into that slot piece by piece while it reads the rest (`SSDTier.reading_into`), instead
        of the whole payload being copied after the read; with a `lent` destination for a
        record of its size, the last bytes go there instead of the slot. Returns the record,
        whether its verified payload was delivered (the slot is not taken yet either way), and
        the lent destination it used."""
        meta = self._owned(key, tid)
        size = meta.size_bytes if meta is not None else 0
        into = lent if lent is not None and lent.total_bytes == size else None
        in_slot = _slot_bytes(size, into)
        at = slots.peek(in_slot) if size >= _DELIVER_MIN_BYTES else None
        if at is None:
            return await self._store.get(key, expect_tenant=tid), False, None
        dests = [memoryview(shm_buf)[at + HEADER_SIZE:at + in_slot]]
        if into is not None:
            dests.append(memoryview(into.buf)[into.offset:into.offset + into.bytes])
        try:
            with self._owner.ssd.reading_into(key, dests, tid) as target:
                record = await self._store.get(key, expect_tenant=tid)
        finally:
            for dest in dests:
                dest.release()
        delivered = record is not None and target.filled and encoded_size(record) == size
        return record, delivered, into if delivered else None

    def _lent_for_get(self, context: Any, window: ShmWindow) -> Any:
        """The lent memory a GetRecords names, or None (its records then come in their slots)."""
        try:
            return self._owner.shm.lent_from(context.invocation_metadata(), window)
        except ShmUnavailable as exc:
            logger.debug("GetRecords without lent memory: %s", exc)
            return None

    async def _set_pins(self, request: Any, tenant: str, pinned: bool) -> Any:
        keys = record_keys(request.keys, "keys")
        tid = tenant_id(tenant)
        metas = [self._owned(k, tid) for k in keys]
        missing = [k.hex() for k, m in zip(keys, metas) if m is None]
        if missing:
            raise NotFound(f"{len(missing)} of {len(keys)} keys are not stored on this node (first: {missing[0]}); "
                            f"nothing was changed")
        changed = sum(1 for m in metas if m is not None and m.pinned != pinned)
        for key in keys:
            (self._store.pin if pinned else self._store.unpin)(key)
        return statestore_pb2.KeysResponse(changed=changed)

    @unary
    async def RequestDone(self, request: Any, context: Any, tenant: str) -> Any:
        keys, _ = self._chain_keys(request)
        if request.generated_tokens > 1 << 40:
            raise BadField(f"generated_tokens: {request.generated_tokens} > 2^40")
        tid = tenant_id(tenant)
        mine = [k for k in keys if self._owned(k, tid) is not None]  # another tenant's key: nothing, silently
        self._store.request_done(mine, request.generated_tokens)
        return statestore_pb2.RequestDoneResponse(known_records=len(mine))

    @unary
    async def Pin(self, request: Any, context: Any, tenant: str) -> Any:
        return await self._set_pins(request, tenant, True)

    @unary
    async def Unpin(self, request: Any, context: Any, tenant: str) -> Any:
        return await self._set_pins(request, tenant, False)

    @unary
    async def Evict(self, request: Any, context: Any, tenant: str) -> Any:
        keys = record_keys(request.keys, "keys")
        tiers: list[TierName] = []
        for i, name in enumerate(request.tiers):
            try:
                tiers.append(TierName(name))
            except ValueError:
                raise BadField(f"tiers[{i}]: unknown tier {name!r}; use host, ssd or redis") from None
        tid = tenant_id(tenant)
        out = []
        for key in keys:
            removed: frozenset[TierName] = frozenset()
            if self._owned(key, tid) is not None:  # another tenant's key: nothing, silently
                removed = await self._store.evict(key, tiers or None, force=request.force)
            out.append(statestore_pb2.EvictedInfo(key=key, tiers=sorted(t.value for t in removed)))
        return statestore_pb2.EvictResponse(evicted=out)

    @unary
    async def Stats(self, request: Any, context: Any, tenant: str) -> Any:
        owner = self._owner
        response = statestore_pb2.StatsResponse(num_records=len(self._store), live_sessions=owner.live_sessions(),
                                                model_fingerprint=owner.adapter.model_fingerprint,
                                                model_name=owner.adapter.model_name,
                                                uptime_seconds=time.monotonic() - owner.started_at)
        for name, ts in self._store.stats().items():
            response.tiers.append(statestore_pb2.TierStatsInfo(tier=name.value, budget_bytes=ts.budget_bytes,
                                                               resident_bytes=ts.resident_bytes, fill=ts.fill,
                                                               healthy=ts.healthy, reserve_bytes=ts.reserve_bytes))
            for kind, ks in ts.by_kind.items():
                response.kinds.append(statestore_pb2.KindStatsInfo(
                    tier=name.value, kind=kind, kind_name=kind_name(kind), num_records=ks.num_records,
                    resident_bytes=ks.resident_bytes, hits=ks.hits, misses=ks.misses, evictions=ks.evictions,
                    promotions=ks.promotions))
        return response

    @unary
    async def List(self, request: Any, context: Any, tenant: str) -> Any:
        limit = request.limit or 1000
        if limit > 100_000:
            raise BadField(f"limit: {limit} > 100000")
        tid = tenant_id(tenant)
        keys = self._store.keys()  # a snapshot: puts and evictions go on while it is read
        oldest: list[StateMeta] = []
        matched = 0
        for start in range(0, len(keys), LIST_CHUNK):
            chunk = [m for m in self._store.metas(keys[start:start + LIST_CHUNK]) if m is not None
                     and m.tenant_id == tid and (not request.kind or m.kind == request.kind)]
            matched += len(chunk)
            if len(oldest) == limit:  # only what is older than the oldest `limit` so far can get in
                cutoff = oldest[-1].created
                chunk = [m for m in chunk if m.created < cutoff]
            if chunk:
                oldest = sorted([*oldest, *chunk], key=_CREATED)[:limit]  # stable: ties keep the index's order
            await asyncio.sleep(0)  # other calls run between chunks: the loop is held a chunk at a time, not a pass
        return statestore_pb2.ListResponse(records=[record_info(m) for m in oldest], truncated=matched > limit)

    @unary
    async def Inspect(self, request: Any, context: Any, tenant: str) -> Any:
        key = record_key(request.key, "key")
        meta = self._owned(key, tenant_id(tenant))
        if meta is None:
            raise NotFound(f"record {key.hex()} is not stored on this node")
        info = record_info(meta)
        explained = self._store.explain(key)
        if explained is not None:
            info.explain_json = json.dumps(explained, sort_keys=True, default=str)
        return info



# ----- the server ----------------------------------------------------------------------------


def add_statestore_servicer(servicer: StateStoreServicer, server: grpc.aio.Server) -> None:
    """The generated `add_StateStoreServicer_to_server`, except on the record data path:
    PutRecords gets its messages as bytes (data chunks are read without a protobuf copy) and
    GetRecords may yield serialized frames. The wire format is unchanged."""
    add_servicer(servicer, server, statestore_pb2.DESCRIPTOR.services_by_name["StateStore"])
