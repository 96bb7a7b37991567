from proto.statestore.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "num_tokens", "live", "checkpoint_version", "checkpointed_tokens", "message_boundaries")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    live: bool
    checkpoint_version: int
    checkpointed_tokens: int
    message_boundaries: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., live: bool = ..., checkpoint_version: _Optional[int] = ..., checkpointed_tokens: _Optional[int] = ..., message_boundaries: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("session_id", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "num_tokens", "temperature", "seed", "chunk_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    temperature: float
    seed: int
    chunk_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., chunk_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("session_id", "durability")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    durability: _common_pb2.Durability
    def __init__(self, session_id: _Optional[str] = ..., durability: _Optional[_Union[_common_pb2.Durability, str]] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("version", "num_tokens", "new_blocks", "shared_blocks", "bytes_written", "total_bytes", "seconds")
    class BytesWrittenEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_tokens: int
    new_blocks: int
    shared_blocks: int
    bytes_written: _containers.ScalarMap[str, int]
    total_bytes: int
    seconds: float
    def __init__(self, version: _Optional[int] = ..., num_tokens: _Optional[int] = ..., new_blocks: _Optional[int] = ..., shared_blocks: _Optional[int] = ..., bytes_written: _Optional[_Mapping[str, int]] = ..., total_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("session_id", "mode")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    mode: str
    def __init__(self, session_id: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class ResumeInfo(_message.Message):
    __slots__ = ("mode", "num_tokens", "persisted_tokens", "bytes_loaded", "replay_tokens", "row_layers", "load_seconds", "replay_seconds")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROW_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    num_tokens: int
    persisted_tokens: int
    bytes_loaded: int
    replay_tokens: int
    row_layers: int
    load_seconds: float
    replay_seconds: float
    def __init__(self, mode: _Optional[str] = ..., num_tokens: _Optional[int] = ..., persisted_tokens: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., replay_tokens: _Optional[int] = ..., row_layers: _Optional[int] = ..., load_seconds: _Optional[float] = ..., replay_seconds: _Optional[float] = ...) -> None: ...

class ResumePlanInfo(_message.Message):
    __slots__ = ("session_id", "num_tokens", "bytes_by_tier", "missing_blocks", "rings_available", "replay", "est_load_seconds", "est_seconds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    MISSING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RINGS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    EST_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    bytes_by_tier: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierBytes]
    missing_blocks: int
    rings_available: bool
    replay: _common_pb2.ReplayPlanInfo
    est_load_seconds: float
    est_seconds: float
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., bytes_by_tier: _Optional[_Iterable[_Union[_common_pb2.TierBytes, _Mapping]]] = ..., missing_blocks: _Optional[int] = ..., rings_available: bool = ..., replay: _Optional[_Union[_common_pb2.ReplayPlanInfo, _Mapping]] = ..., est_load_seconds: _Optional[float] = ..., est_seconds: _Optional[float] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class DeleteInfo(_message.Message):
    __slots__ = ("done",)
    DONE_FIELD_NUMBER: _ClassVar[int]
    done: bool
    def __init__(self, done: bool = ...) -> None: ...
