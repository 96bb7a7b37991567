"""What a model's state is: kinds, specs and retention classes.

The store reasons only about these specs, never about a particular model. An engine adapter
describes each piece of inference state it produces with a `StateSpec`; the store uses the
spec to size pages, price rebuilds and decide what must be kept. Engines we do not know
describe their state with `StateKind.OPAQUE`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class StateKind(enum.IntEnum):
    """One enum shared by all layers. Values are the on-disk kind codes of records: never renumber."""

    GLOBAL_KV = 1
    INDEX_K = 2
    SWA_RING = 3
    COMPRESSOR_TAIL = 4
    TOKENS = 5
    OPAQUE = 6


class Retention(enum.IntEnum):
    """How much it costs to lose a piece of state."""

    MUST_KEEP = 1  # losing it costs a recompute of O(context)
    REBUILDABLE = 2  # bounded cost to rebuild (replay)
    EPHEMERAL = 3  # never stored


class Codec(enum.IntEnum):
    """Payload encodings. Values are on-disk codes: never renumber."""

    RAW = 0
    E2M1_E4M3_16 = 1  # FP4 codes, low nibble first, one E4M3 scale per 16 values
    E2M1_E8M0_32 = 2  # FP4 codes, one power-of-two scale per 32 values
    FP8_E4M3_E8M0_32 = 3  # FP8 values, one power-of-two scale per 32 values
    FP32 = 4
    BF16 = 5
    INT32 = 6
    FP64 = 7


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One kind of state an engine produces, as the store needs to see it.

    Exactly one of `bytes_per_token` and `bytes_per_sequence` is non-zero: global KV grows
    with the context, an SWA ring does not.
    """

    kind: StateKind
    retention: Retention
    codec: Codec
    bytes_per_token: float = 0.0  # may be fractional: a ratio-2 source stores one entry per 2 tokens
    bytes_per_sequence: int = 0
    page_size_bytes: int = 0  # the host/GPU pool page for this kind; 0 = derive from the block size
    name: str = ""  # engine-specific label, for humans only

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StateKind):
            raise ValueError(f"StateSpec.kind must be a StateKind, got {self.kind!r}")
        if self.bytes_per_token < 0 or self.bytes_per_sequence < 0 or self.page_size_bytes < 0:
            raise ValueError(f"StateSpec {self.kind.name}: sizes must be >= 0")
        if (self.bytes_per_token > 0) == (self.bytes_per_sequence > 0):
            raise ValueError(
                f"StateSpec {self.kind.name}: set exactly one of bytes_per_token "
                f"({self.bytes_per_token}) and bytes_per_sequence ({self.bytes_per_sequence})"
            )

    @property
    def per_token(self) -> bool:
        return self.bytes_per_token > 0

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Exact bytes this state takes for a sequence of `num_tokens` tokens."""
        if self.per_token:
            return int(round(self.bytes_per_token * num_tokens))
        return self.bytes_per_sequence

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one full block of `block_size` tokens (per-token kinds only)."""
        if not self.per_token:
            raise ValueError(f"{self.kind.name} is per sequence: it has no per-block size")
        exact = self.bytes_per_token * block_size
        if exact != int(exact):
            raise ValueError(
                f"{self.kind.name}: {self.bytes_per_token} B/token x block {block_size} is not whole bytes"
            )
        return int(exact)


# ---------------------------------------------------------------------- the adapter protocol


@dataclass(frozen=True, slots=True)
class StatePayload:
    """One piece of exported state: what becomes one record's payload.

    Per-token kinds cover tokens [token_start, token_end); per-sequence kinds (SWA rings,
    compressor tails) describe the sequence as of `token_end`.
    """

    kind: StateKind
    codec: Codec
    token_start: int
    token_end: int
    payload: bytes
    entry_count: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.token_start <= self.token_end:
            raise ValueError(f"StatePayload {self.kind.name}: token range [{self.token_start}, "
                             f"{self.token_end}) is not ordered")


@dataclass(frozen=True, slots=True)
class ReplayGeometry:
    """What replay planning needs to know of a layer stack, and nothing model-specific.

    A layer's only cross-token reads are its own sliding window (`windows[l]` keys, counting
    the key itself) and persisted global state. Layers up to `last_publisher` publish global
    entries in groups of `group_tokens[l]` tokens (a compression ratio; 0 = none), so a replay
    edge at or below it must start on a group boundary. `first_decoder_layer` is where prefill
    may stop running every row (None: the whole stack runs on every row).
    """

    windows: tuple[int, ...]
    group_tokens: tuple[int, ...]
    last_publisher: int | None = None
    first_decoder_layer: int | None = None

    def __post_init__(self) -> None:
        if not self.windows or len(self.windows) != len(self.group_tokens):
            raise ValueError("ReplayGeometry: windows and group_tokens need one entry per layer")
        if min(self.windows) < 1 or min(self.group_tokens) < 0:
            raise ValueError("ReplayGeometry: windows must be >= 1 and group sizes >= 0")
        n = len(self.windows)
        for name, value in (("last_publisher", self.last_publisher), ("first_decoder_layer", self.first_decoder_layer)):
            if value is not None and not 0 <= value < n:
                raise ValueError(f"ReplayGeometry: {name}={value} outside [0, {n})")

    @property
    def num_layers(self) -> int:
        return len(self.windows)


@dataclass(frozen=True, slots=True)
class EngineCosts:
    """Per-token cost figures the policy and the replay planner price work with (seconds)."""

    prefill_s_per_token: float
    decode_s_per_token: float
    replay_s_per_row_layer: float  # one query row through one layer during replay
    device: str = "cpu"
    measured: bool = False  # False: a default estimate, True: measured on this machine


@runtime_checkable
class EngineAdapter(Protocol):
    """What any engine implements so statestore can persist and resume its sequences.

    Engine state is opaque to statestore (`object`): only the adapter looks inside. An engine
    we do not know can implement this with `StateKind.OPAQUE` specs and payloads.
    """

    @property
    def model_fingerprint(self) -> bytes:
        """16 bytes over weights identity, config, codecs and layout version."""

    @property
    def model_name(self) -> str: ...

    def state_specs(self) -> tuple[StateSpec, ...]:
        """Every kind of state the engine produces."""

    @property
    def token_alignment(self) -> int:
        """Exported token ranges start on multiples of this (compression groups); only a
        sequence's last range may end unaligned (its open group travels as rebuildable state)."""

    def replay_geometry(self) -> ReplayGeometry: ...

    def costs(self) -> EngineCosts: ...

    def new_state(self) -> object: ...

    def num_tokens(self, state: object) -> int: ...

    def token_ids(self, state: object) -> list[int]: ...

    def append(self, state: object, token_ids: Sequence[int]) -> None:
        """Prefill new tokens onto a live state (a new prompt or a new message)."""

    def generate(self, state: object, num_tokens: int, temperature: float = 0.0, seed: int | None = None) -> list[int]: ...

    def export_range(self, state: object, start: int, end: int) -> list[StatePayload]:
        """MUST_KEEP per-token state of tokens [start, end) (aligned), one payload per kind."""

    def import_range(self, state: object, payloads: Sequence[StatePayload]) -> None:
        """Load exported per-token state into a fresh (or partially loaded) state, in order."""

    def export_rebuildable(self, state: object) -> list[StatePayload]:
        """Per-sequence REBUILDABLE state (rings, compressor tails) as of now."""

    def import_rebuildable(self, state: object, token_ids: Sequence[int], payloads: Sequence[StatePayload]) -> None:
        """Make a state whose per-token state is loaded live again without replay."""

    def replay(self, state: object, token_ids: Sequence[int], layer_rows: Sequence[int]) -> None:
        """Run the engine over trailing rows (`layer_rows[l]` for layer l) with the persisted
        global state already imported, so the state is live and ready to generate."""
