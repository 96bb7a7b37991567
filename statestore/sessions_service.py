"""`statestore.v1.Sessions`: the agent session API (create, append, generate, checkpoint,
resume, ...) over the server's `SessionManager`, translated as the record API is (`statestore.rpc`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from proto.statestore.v1 import sessions_pb2, sessions_pb2_grpc
from statestore import sessions as ss
from statestore.messages import durability_of, replay_info, session_info, tier_bytes
from statestore.rpc import BadField, NotFound, Precondition, streaming, unary
from statestore.types import Durability
from tiers.offload import run_to_completion

if TYPE_CHECKING:
    from statestore.server import StateStoreServer

MAX_APPEND_TOKENS = 1 << 20


class SessionsServicer(sessions_pb2_grpc.SessionsServicer):
    """`statestore.v1.Sessions` over a `SessionManager`."""

    def __init__(self, owner: StateStoreServer) -> None:
        self._owner = owner
        self._calls = owner.calls

    @property
    def _sessions(self) -> ss.SessionManager:
        return self._owner.sessions

    @unary
    async def Create(self, request: Any, context: Any, tenant: str) -> Any:
        self._sessions.check_session_id(request.session_id)
        async with self._owner.quotas.admit_session(tenant, lambda: self._count_sessions(tenant)):
            return session_info(await self._sessions.create(tenant, request.session_id))

    async def _count_sessions(self, tenant: str) -> int:
        return self._sessions.count(tenant)

    @unary
    async def Append(self, request: Any, context: Any, tenant: str) -> Any:
        n = len(request.token_ids)
        if not 1 <= n <= MAX_APPEND_TOKENS:
            raise BadField(f"token_ids: {n} ids, give 1..{MAX_APPEND_TOKENS} per Append")
        vocab = self._owner.adapter.config.vocab_size
        bad = next((t for t in request.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadField(f"token_ids: id {bad} outside the model's vocabulary [0, {vocab})")
        return session_info(await self._sessions.append(tenant, request.session_id, list(request.token_ids)))

    @streaming
    async def Generate(self, request: Any, context: Any, tenant: str) -> AsyncIterator[Any]:
        total = request.num_tokens
        if not 1 <= total <= 1 << 16:
            raise BadField(f"num_tokens: {total} outside [1, 65536]")
        if not 0.0 <= request.temperature <= 100.0:
            raise BadField(f"temperature: {request.temperature} outside [0, 100]")
        step = request.chunk_tokens or 16
        if step > 1 << 16:
            raise BadField(f"chunk_tokens: {step} > 65536")
        done = 0
        while done < total:
            n = min(step, total - done)
            seed = request.seed + done if request.temperature > 0 else None
            tokens = await self._sessions.generate(tenant, request.session_id, n, request.temperature, seed)
            done += n
            yield sessions_pb2.GenerateChunk(token_ids=tokens)

    @unary
    async def Checkpoint(self, request: Any, context: Any, tenant: str) -> Any:
        durability = durability_of(request.durability, "durability",
                                 Durability[self._owner.config.durability.upper()])
        # Run to completion: a client gone mid-checkpoint leaves it whole (its records and manifest
        # stored, the store and its tiers agreeing), never a put cut off halfway.
        report = await run_to_completion(self._sessions.checkpoint(tenant, request.session_id, durability))
        return sessions_pb2.CheckpointInfo(version=report.version, num_tokens=report.num_tokens,
                                           new_blocks=report.new_blocks, shared_blocks=report.shared_blocks,
                                           bytes_written=report.bytes_written, total_bytes=report.total_bytes,
                                           seconds=report.seconds)

    def _check_mode(self, mode: str) -> str | None:
        if mode and mode not in ss.REPLAY_MODES:
            raise BadField(f"mode: {mode!r} is not one of {', '.join(ss.REPLAY_MODES)}")
        return mode or None

    @unary
    async def Resume(self, request: Any, context: Any, tenant: str) -> Any:
        mode = self._check_mode(request.mode)
        info = await self._sessions.get(tenant, request.session_id)
        if info.live:
            raise Precondition(f"session {request.session_id!r} is already active on this node; Drop it first "
                                f"to resume from its checkpoint")
        report = await self._sessions.resume(tenant, request.session_id, mode)
        metrics = self._calls.metrics
        metrics.replay_tokens.labels(report.mode).inc(report.replay_tokens)
        metrics.resume_seconds.labels(report.mode).observe(report.seconds)
        return sessions_pb2.ResumeInfo(mode=report.mode, num_tokens=report.num_tokens,
                                       persisted_tokens=report.persisted_tokens, bytes_loaded=report.bytes_loaded,
                                       replay_tokens=report.replay_tokens, row_layers=report.row_layers,
                                       load_seconds=report.load_seconds, replay_seconds=report.replay_seconds)

    @unary
    async def PlanResume(self, request: Any, context: Any, tenant: str) -> Any:
        plan = await self._sessions.plan_resume(tenant, request.session_id, self._check_mode(request.mode))
        return sessions_pb2.ResumePlanInfo(
            session_id=plan.session_id, num_tokens=plan.num_tokens, bytes_by_tier=tier_bytes(plan.bytes_by_tier),
            missing_blocks=plan.missing_blocks, rings_available=plan.rings_available,
            replay=replay_info(plan.replay), est_load_seconds=plan.est_load_seconds, est_seconds=plan.est_seconds)

    @unary
    async def Get(self, request: Any, context: Any, tenant: str) -> Any:
        return session_info(await self._sessions.get(tenant, request.session_id))

    @unary
    async def List(self, request: Any, context: Any, tenant: str) -> Any:
        return sessions_pb2.ListSessionsResponse(sessions=[session_info(i) for i in await self._sessions.list(tenant)])

    @unary
    async def Delete(self, request: Any, context: Any, tenant: str) -> Any:
        return sessions_pb2.DeleteInfo(done=await self._sessions.delete(tenant, request.session_id))

    @unary
    async def Drop(self, request: Any, context: Any, tenant: str) -> Any:
        self._sessions.check_session_id(request.session_id)
        if not await self._sessions.drop(tenant, request.session_id):
            raise NotFound(f"session {request.session_id!r} is not active on this node")
        return sessions_pb2.DeleteInfo(done=True)

