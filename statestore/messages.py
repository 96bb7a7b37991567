"""Conversions between `statestore.v1` messages and the store's types, with the checks of the
request fields they read (each error names its field: INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proto.statestore.v1 import common_pb2, sessions_pb2
from statestore import sessions as ss
from statestore.metrics import kind_name
from statestore.rpc import BadField
from statestore.types import TIER_ORDER, Durability, StateMeta
from tiers.record import RECORD_KEY_BYTES

MAX_KEYS = 65536  # record keys one request may name


def record_key(value: bytes, field: str) -> bytes:
    if len(value) != RECORD_KEY_BYTES:
        raise BadField(f"{field}: a record key is {RECORD_KEY_BYTES} bytes (2-byte kind + 32-byte block key), "
                        f"got {len(value)}")
    return bytes(value)


def record_keys(values: Sequence[bytes], field: str, limit: int = MAX_KEYS) -> list[bytes]:
    if not values:
        raise BadField(f"{field}: give at least one record key")
    if len(values) > limit:
        raise BadField(f"{field}: {len(values)} keys, at most {limit} per call")
    return [record_key(v, f"{field}[{i}]") for i, v in enumerate(values)]


def durability_of(value: int, field: str, default: Durability) -> Durability:
    if value == common_pb2.DURABILITY_UNSPECIFIED:
        return default
    try:
        return Durability(value)
    except ValueError:
        raise BadField(f"{field}: unknown durability {value}; use MEMORY, LOCAL or SHARED") from None


def tier_bytes(mapping: dict[str, int]) -> list[common_pb2.TierBytes]:
    order = [t.value for t in TIER_ORDER]
    return [common_pb2.TierBytes(tier=t, bytes=int(b))
            for t, b in sorted(mapping.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99)]


def record_info(meta: StateMeta) -> common_pb2.RecordInfo:
    return common_pb2.RecordInfo(
        key=meta.key, kind=meta.kind, kind_name=kind_name(meta.kind), size_bytes=meta.size_bytes,
        tiers=[common_pb2.TierBytes(tier=t.value, bytes=n) for t, n in meta.resident], pinned=meta.pinned,
        durability=int(meta.durability), created_at=meta.created, last_access=meta.last_access,
        access_count=meta.access_count, model_fingerprint=meta.model_fingerprint, token_start=meta.token_start,
        token_end=meta.token_end, retention=meta.retention.name)


def replay_info(plan: Any) -> common_pb2.ReplayPlanInfo:
    return common_pb2.ReplayPlanInfo(mode=plan.mode, num_tokens=plan.num_tokens,
                                     persisted_tokens=plan.persisted_tokens, replay_tokens=plan.replay_tokens,
                                     row_layers=plan.row_layers, est_seconds=plan.est_seconds)


def session_info(info: ss.SessionInfo) -> sessions_pb2.SessionInfo:
    return sessions_pb2.SessionInfo(session_id=info.session_id, num_tokens=info.num_tokens, live=info.live,
                                    checkpoint_version=info.checkpoint_version or 0,
                                    checkpointed_tokens=info.checkpointed_tokens or 0,
                                    message_boundaries=list(info.message_boundaries))

