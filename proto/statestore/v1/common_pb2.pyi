from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Durability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DURABILITY_UNSPECIFIED: _ClassVar[Durability]
    DURABILITY_MEMORY: _ClassVar[Durability]
    DURABILITY_LOCAL: _ClassVar[Durability]
    DURABILITY_SHARED: _ClassVar[Durability]
DURABILITY_UNSPECIFIED: Durability
DURABILITY_MEMORY: Durability
DURABILITY_LOCAL: Durability
DURABILITY_SHARED: Durability

class RecordChunk(_message.Message):
    __slots__ = ("start", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: RecordStart
    data: bytes
    def __init__(self, start: _Optional[_Union[RecordStart, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RecordStart(_message.Message):
    __slots__ = ("key", "total_bytes", "durability", "pin", "found", "lent_offset", "lent_bytes", "verified", "checksum_by_server")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    LENT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_BY_SERVER_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    total_bytes: int
    durability: Durability
    pin: bool
    found: bool
    lent_offset: int
    lent_bytes: int
    verified: bool
    checksum_by_server: bool
    def __init__(self, key: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., durability: _Optional[_Union[Durability, str]] = ..., pin: bool = ..., found: bool = ..., lent_offset: _Optional[int] = ..., lent_bytes: _Optional[int] = ..., verified: bool = ..., checksum_by_server: bool = ...) -> None: ...

class LentDestination(_message.Message):
    __slots__ = ("total_bytes", "offset", "bytes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    offset: int
    bytes: int
    def __init__(self, total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class RecordInfo(_message.Message):
    __slots__ = ("key", "kind", "kind_name", "size_bytes", "tiers", "pinned", "durability", "created_at", "last_access", "access_count", "model_fingerprint", "token_start", "token_end", "retention", "explain_json")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KIND_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_FIELD_NUMBER: _ClassVar[int]
    ACCESS_COUNT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    EXPLAIN_JSON_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    kind: int
    kind_name: str
    size_bytes: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierBytes]
    pinned: bool
    durability: Durability
    created_at: float
    last_access: float
    access_count: int
    model_fingerprint: bytes
    token_start: int
    token_end: int
    retention: str
    explain_json: str
    def __init__(self, key: _Optional[bytes] = ..., kind: _Optional[int] = ..., kind_name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierBytes, _Mapping]]] = ..., pinned: bool = ..., durability: _Optional[_Union[Durability, str]] = ..., created_at: _Optional[float] = ..., last_access: _Optional[float] = ..., access_count: _Optional[int] = ..., model_fingerprint: _Optional[bytes] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., retention: _Optional[str] = ..., explain_json: _Optional[str] = ...) -> None: ...

class TierBytes(_message.Message):
    __slots__ = ("tier", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class ReplayPlanInfo(_message.Message):
    __slots__ = ("mode", "num_tokens", "persisted_tokens", "replay_tokens", "row_layers", "est_seconds")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROW_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    num_tokens: int
    persisted_tokens: int
    replay_tokens: int
    row_layers: int
    est_seconds: float
    def __init__(self, mode: _Optional[str] = ..., num_tokens: _Optional[int] = ..., persisted_tokens: _Optional[int] = ..., replay_tokens: _Optional[int] = ..., row_layers: _Optional[int] = ..., est_seconds: _Optional[float] = ...) -> None: ...
