from proto.statestore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateSpecInfo(_message.Message):
    __slots__ = ("kind", "retention", "codec", "bytes_per_token", "bytes_per_sequence", "name")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    kind: int
    retention: int
    codec: int
    bytes_per_token: float
    bytes_per_sequence: int
    name: str
    def __init__(self, kind: _Optional[int] = ..., retention: _Optional[int] = ..., codec: _Optional[int] = ..., bytes_per_token: _Optional[float] = ..., bytes_per_sequence: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("model_name", "weights_id", "config_json", "layout_version", "specs")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPECS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    weights_id: str
    config_json: str
    layout_version: int
    specs: _containers.RepeatedCompositeFieldContainer[StateSpecInfo]
    def __init__(self, model_name: _Optional[str] = ..., weights_id: _Optional[str] = ..., config_json: _Optional[str] = ..., layout_version: _Optional[int] = ..., specs: _Optional[_Iterable[_Union[StateSpecInfo, _Mapping]]] = ...) -> None: ...

class RegisterModelResponse(_message.Message):
    __slots__ = ("model_fingerprint", "hosted")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HOSTED_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: bytes
    hosted: bool
    def __init__(self, model_fingerprint: _Optional[bytes] = ..., hosted: bool = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_keys", "kinds", "num_tokens", "block_size", "mode", "model_fingerprint")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    kinds: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    block_size: int
    mode: str
    model_fingerprint: bytes
    def __init__(self, block_keys: _Optional[_Iterable[bytes]] = ..., kinds: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., mode: _Optional[str] = ..., model_fingerprint: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("combined_blocks", "per_tier", "bytes_to_load", "persisted_tokens", "replay", "est_load_seconds", "est_seconds")
    COMBINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PER_TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_LOAD_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    EST_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    combined_blocks: int
    per_tier: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    bytes_to_load: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierBytes]
    persisted_tokens: int
    replay: _common_pb2.ReplayPlanInfo
    est_load_seconds: float
    est_seconds: float
    def __init__(self, combined_blocks: _Optional[int] = ..., per_tier: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ..., bytes_to_load: _Optional[_Iterable[_Union[_common_pb2.TierBytes, _Mapping]]] = ..., persisted_tokens: _Optional[int] = ..., replay: _Optional[_Union[_common_pb2.ReplayPlanInfo, _Mapping]] = ..., est_load_seconds: _Optional[float] = ..., est_seconds: _Optional[float] = ...) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("tier", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    blocks: int
    def __init__(self, tier: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class PutRecordsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutResultInfo]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResultInfo, _Mapping]]] = ...) -> None: ...

class PutResultInfo(_message.Message):
    __slots__ = ("key", "durability", "tiers", "evicted")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    durability: _common_pb2.Durability
    tiers: _containers.RepeatedScalarFieldContainer[str]
    evicted: int
    def __init__(self, key: _Optional[bytes] = ..., durability: _Optional[_Union[_common_pb2.Durability, str]] = ..., tiers: _Optional[_Iterable[str]] = ..., evicted: _Optional[int] = ...) -> None: ...

class GetRecordsRequest(_message.Message):
    __slots__ = ("keys", "chunk_bytes", "lent")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    chunk_bytes: int
    lent: _containers.RepeatedCompositeFieldContainer[_common_pb2.LentDestination]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., chunk_bytes: _Optional[int] = ..., lent: _Optional[_Iterable[_Union[_common_pb2.LentDestination, _Mapping]]] = ...) -> None: ...

class RequestDoneRequest(_message.Message):
    __slots__ = ("block_keys", "kinds", "generated_tokens")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    kinds: _containers.RepeatedScalarFieldContainer[int]
    generated_tokens: int
    def __init__(self, block_keys: _Optional[_Iterable[bytes]] = ..., kinds: _Optional[_Iterable[int]] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class RequestDoneResponse(_message.Message):
    __slots__ = ("known_records",)
    KNOWN_RECORDS_FIELD_NUMBER: _ClassVar[int]
    known_records: int
    def __init__(self, known_records: _Optional[int] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KeysResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("keys", "tiers", "force")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tiers: _containers.RepeatedScalarFieldContainer[str]
    force: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., tiers: _Optional[_Iterable[str]] = ..., force: bool = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: _containers.RepeatedCompositeFieldContainer[EvictedInfo]
    def __init__(self, evicted: _Optional[_Iterable[_Union[EvictedInfo, _Mapping]]] = ...) -> None: ...

class EvictedInfo(_message.Message):
    __slots__ = ("key", "tiers")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[bytes] = ..., tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "kinds", "num_records", "live_sessions", "model_fingerprint", "model_name", "uptime_seconds")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatsInfo]
    kinds: _containers.RepeatedCompositeFieldContainer[KindStatsInfo]
    num_records: int
    live_sessions: int
    model_fingerprint: bytes
    model_name: str
    uptime_seconds: float
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStatsInfo, _Mapping]]] = ..., kinds: _Optional[_Iterable[_Union[KindStatsInfo, _Mapping]]] = ..., num_records: _Optional[int] = ..., live_sessions: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ..., model_name: _Optional[str] = ..., uptime_seconds: _Optional[float] = ...) -> None: ...

class TierStatsInfo(_message.Message):
    __slots__ = ("tier", "budget_bytes", "resident_bytes", "fill", "healthy", "reserve_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    budget_bytes: int
    resident_bytes: int
    fill: float
    healthy: bool
    reserve_bytes: int
    def __init__(self, tier: _Optional[str] = ..., budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., fill: _Optional[float] = ..., healthy: bool = ..., reserve_bytes: _Optional[int] = ...) -> None: ...

class KindStatsInfo(_message.Message):
    __slots__ = ("tier", "kind", "kind_name", "num_records", "resident_bytes", "hits", "misses", "evictions", "promotions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KIND_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    kind: int
    kind_name: str
    num_records: int
    resident_bytes: int
    hits: int
    misses: int
    evictions: int
    promotions: int
    def __init__(self, tier: _Optional[str] = ..., kind: _Optional[int] = ..., kind_name: _Optional[str] = ..., num_records: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("kind", "limit")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    kind: int
    limit: int
    def __init__(self, kind: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("records", "truncated")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[_common_pb2.RecordInfo]
    truncated: bool
    def __init__(self, records: _Optional[_Iterable[_Union[_common_pb2.RecordInfo, _Mapping]]] = ..., truncated: bool = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...
