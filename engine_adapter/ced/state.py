"""Per-sequence state of the CED engine (ENGINE.md §3).

One `SequenceState` per sequence holds everything a forward reads or writes:

    tokens            int64 [T]                       the session keeps them (replay, recompute)
    sources[s]        per KV source s (ratio r):
      main            PackedFP4 E2M1 + E4M3/16  [E, D/2 + D/16]    must keep   (E = T // r)
      index           PackedFP4 E2M1 + E8M0/32  [E, Di/2 + Di/32]  must keep
      main_values     dequantized copy of main  [E, D]             derived: what attention reads
      index_values    dequantized copy of index [E, Di]            derived: what indexers read
      tail_kv/gate    the < r rows of an incomplete group          rebuildable
    rings[l]          SWA ring of layer l, the last <= W window keys [m, D]  rebuildable

The engine owns the layout; callers move state through `engine.export_*` / `import_*`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs import PackedFP4, dequantize_fp4


class GrowBuffer:
    """Append-only rows with amortised O(1) appends (capacity doubles), so decode stays O(1) a step."""

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self._buf = torch.empty(16, *row_shape, dtype=dtype, device=device)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        if self._len + n > self._buf.shape[0]:
            grown = torch.empty(max(2 * self._buf.shape[0], self._len + n), *self._buf.shape[1:],
                                dtype=self._buf.dtype, device=self._buf.device)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len: self._len + n] = rows
        self._len += n

    def view(self) -> torch.Tensor:
        """The rows appended so far (a view: valid until the next append)."""
        return self._buf[: self._len]

    def clear(self) -> None:
        self._len = 0

    @property
    def nbytes(self) -> int:
        return self.view().numel() * self._buf.element_size()


class Ring:
    """The SWA ring of one layer: window keys of the last <= W positions, ending at `end`.

    Stored in a 2W buffer so pushing one row is a copy of one row; every W pushes the last W
    rows move to the front.
    """

    def __init__(self, window: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.window = window
        self._buf = torch.empty(2 * window, dim, dtype=dtype, device=device)
        self._len = 0
        self.end = 0  # position after the newest row

    def __len__(self) -> int:
        return min(self._len, self.window)

    @property
    def start(self) -> int:
        return self.end - len(self)

    def view(self) -> torch.Tensor:
        """[min(n, W), D] rows for positions [start, end)."""
        return self._buf[self._len - len(self): self._len]

    def reset(self, end: int = 0) -> None:
        self._len, self.end = 0, end

    def push(self, rows: torch.Tensor, first: int) -> None:
        """Append rows for positions [first, first + n); a gap after `end` drops the old rows."""
        if first != self.end:
            self.reset(first)
        n, w = rows.shape[0], self.window
        if n >= w:
            self._buf[:w] = rows[-w:]
            self._len = w
        else:
            if self._len + n > 2 * w:
                keep = w - n
                self._buf[:keep] = self._buf[self._len - keep: self._len].clone()
                self._len = keep
            self._buf[self._len: self._len + n] = rows
            self._len += n
        self.end = first + n

    def load(self, rows: torch.Tensor, end: int) -> None:
        """Replace the ring by `rows` ending at position `end` (import)."""
        self.reset(end - rows.shape[0])
        self.push(rows, end - rows.shape[0])

    @property
    def nbytes(self) -> int:
        return len(self) * self._buf.shape[1] * self._buf.element_size()


@dataclass(eq=False)
class SourceState:
    """Global state owned by one KV source: packed entries, their dequantized copies, the tail."""

    layer_id: int
    ratio: int
    main_codes: GrowBuffer
    main_scales: GrowBuffer
    index_codes: GrowBuffer
    index_scales: GrowBuffer
    main_values: GrowBuffer
    index_values: GrowBuffer
    tail_kv: torch.Tensor  # [m < ratio, D] wkv_c rows of the incomplete group (compute dtype)
    tail_gate: torch.Tensor  # [m, D] their gate logits

    @property
    def num_entries(self) -> int:
        return len(self.main_codes)

    @property
    def published_tokens(self) -> int:
        """Tokens [0, E * r) are covered by published entries."""
        return self.num_entries * self.ratio

    @property
    def covered_tokens(self) -> int:
        """Tokens the compressor has seen: published ones plus the tail."""
        return self.published_tokens + self.tail_kv.shape[0]

    def append(self, main: PackedFP4, index: PackedFP4, dtype: torch.dtype) -> None:
        """Publish entries: keep the packed bytes and the dequantized values attention reads."""
        self.main_codes.append(main.codes)
        self.main_scales.append(main.scales)
        self.index_codes.append(index.codes)
        self.index_scales.append(index.scales)
        self.main_values.append(dequantize_fp4(main, dtype))
        self.index_values.append(dequantize_fp4(index, dtype))

    def packed(self, first: int, last: int) -> tuple[PackedFP4, PackedFP4]:
        """Entries [first, last) as (main, index) PackedFP4."""
        main = PackedFP4(self.main_codes.view()[first:last], self.main_scales.view()[first:last], 16, "e4m3")
        index = PackedFP4(self.index_codes.view()[first:last], self.index_scales.view()[first:last], 32, "e8m0")
        return main, index

    def clear_tail(self) -> None:
        self.tail_kv = self.tail_kv[:0]
        self.tail_gate = self.tail_gate[:0]


@dataclass(eq=False)
class SequenceState:
    """Everything the engine keeps for one sequence; build it with `CEDEngine.new_state()`."""

    tokens: GrowBuffer
    sources: dict[int, SourceState]
    rings: list[Ring]
    last_logits: torch.Tensor | None = None  # logits after the newest token (what generate samples)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def published_tokens(self) -> int:
        """Tokens [0, P) whose global entries exist in every KV source."""
        return min(s.published_tokens for s in self.sources.values())

    def is_live(self) -> bool:
        """True when decode can continue: compressors and rings are at the newest token."""
        t = self.num_tokens
        return (all(s.covered_tokens == t for s in self.sources.values())
                and all(r.end == t and len(r) == min(t, r.window) for r in self.rings))


def state_bytes(state: SequenceState) -> dict[str, int]:
    """Bytes per state kind, as exported (packed global, native rings and tails, int32 tokens).

    The dequantized copies of the global entries are a derived cache and are not counted.
    """
    sources = state.sources.values()
    return {
        "global_kv": sum(s.main_codes.nbytes + s.main_scales.nbytes for s in sources),
        "index_k": sum(s.index_codes.nbytes + s.index_scales.nbytes for s in sources),
        "swa_ring": sum(r.nbytes for r in state.rings),
        "compressor_tail": sum(s.tail_kv.numel() * s.tail_kv.element_size() * 2 for s in sources),
        "tokens": 4 * state.num_tokens,
    }
