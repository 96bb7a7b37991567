"""What a model's state is: kinds, specs and retention classes.

The store reasons only about these specs, never about a particular model. An engine adapter
describes each piece of inference state it produces with a `StateSpec`; the store uses the
spec to size pages, price rebuilds and decide what must be kept. Engines we do not know
describe their state with `StateKind.OPAQUE`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
