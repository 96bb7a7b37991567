"""Moving state in and out of a `SequenceState` as bytes (the payloads of statestore records).

    kind              payload                                              size
    GLOBAL_KV         per KV source, entries [start/r, end//r), each row:   (end-start)/r x 288 B (V4.1)
                      D/2 E2M1 code bytes (low nibble first) + D/16 E4M3
    INDEX_K           same entries, Di/2 code bytes + Di/32 E8M0             (end-start)/r x 68 B
    SWA_RING          per layer, the last min(W, T) window keys, oldest      L x min(W,T) x row
                      first; "native" = the engine dtype, "fp8" = E4M3 +
                      E8M0/32 (lossy: 528 B a row at D = 512)
    COMPRESSOR_TAIL   per ratio>1 source, T - (T//r)r rows of wkv_c then     compute dtype
                      the same rows of wgate
    TOKENS            int32 little-endian                                   4 B a token

Sources are always in `kv_source_layer_ids` order and layers in stack order. Every import
checks the payload length exactly before touching the state, so a short or long buffer is an
error, never a silently shifted state.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm
from typing import Literal

import torch

from .codecs import (PackedFP4, dequantize_fp8, fp4_from_bytes, fp8_from_bytes, fp8_row_bytes, quantize_fp8_e8m0,
                     to_bytes)
from .config import INDEX_BLOCK, MAIN_BLOCK, RING_BLOCK, CEDConfig
from .layers import compute_dtype
from .state import SequenceState

RingFormat = Literal["native", "fp8"]


@dataclass(frozen=True, slots=True)
class GlobalSlice:
    """Persisted global state of tokens [start, end): per KV source, main entries and index keys."""

    start: int
    end: int
    main: tuple[bytes, ...]  # one payload per KV source, kv_source_layer_ids order
    index: tuple[bytes, ...]

    @property
    def main_payload(self) -> bytes:
        """All sources' main entries, concatenated (one GLOBAL_KV record)."""
        return b"".join(self.main)

    @property
    def index_payload(self) -> bytes:
        """All sources' index keys, concatenated (one INDEX_K record)."""
        return b"".join(self.index)

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.main)) + sum(map(len, self.index))

    @classmethod
    def from_payloads(cls, config: CEDConfig, start: int, end: int, main_payload: bytes,
                      index_payload: bytes) -> GlobalSlice:
        """Split concatenated payloads back per source; their lengths must match exactly."""
        check_token_range(config, start, end)
        main_sizes = [entries_in(config, s, start, end) * config.main_row_bytes for s in config.kv_source_layer_ids]
        index_sizes = [entries_in(config, s, start, end) * config.index_row_bytes for s in config.kv_source_layer_ids]
        for what, payload, sizes in (("main", main_payload, main_sizes), ("index", index_payload, index_sizes)):
            if len(payload) != sum(sizes):
                raise ValueError(f"GlobalSlice: {what} payload for tokens [{start}, {end}) must be {sum(sizes)} "
                                 f"bytes ({sizes} per source), got {len(payload)}")
        return cls(start, end, _split(main_payload, main_sizes), _split(index_payload, index_sizes))


def _split(buf: bytes, sizes: list[int]) -> tuple[bytes, ...]:
    out, at = [], 0
    for n in sizes:
        out.append(bytes(buf[at: at + n]))
        at += n
    return tuple(out)


def token_alignment(config: CEDConfig) -> int:
    """Persisted token ranges start and end on multiples of this (lcm of the ratios)."""
    return lcm(*[r for r in config.compress_ratios if r > 0] or [1])


def check_token_range(config: CEDConfig, start: int, end: int) -> None:
    """`start` on a multiple of every ratio; `end` too, except for a sequence's trailing range.

    A trailing range [start, T) with T unaligned carries, per source, the entries its ratio has
    completed (a ratio-1 source has entry T-1, a ratio-2 source waits for the pair): the session
    rewrites it at each checkpoint, and the ratio-2 remainder travels as a compressor tail.
    """
    align = token_alignment(config)
    if not 0 <= start <= end or start % align:
        raise ValueError(f"token range [{start}, {end}) must satisfy 0 <= start <= end with start a multiple of "
                         f"{align} (every compression ratio)")


def entries_in(config: CEDConfig, source_id: int, start: int, end: int) -> int:
    """Entries of one source for tokens [start, end): the groups that end inside the range."""
    r = config.compress_ratios[source_id]
    return end // r - start // r


# ---------------------------------------------------------------------- global KV


def export_global(config: CEDConfig, state: SequenceState, start: int, end: int) -> GlobalSlice:
    """Packed main entries and index keys covering tokens [start, end)."""
    check_token_range(config, start, end)
    if any(end // s.ratio > s.num_entries for s in state.sources.values()):
        raise ValueError(f"export_global: tokens [{start}, {end}) are not all published (entries cover "
                         f"{ {sid: s.published_tokens for sid, s in state.sources.items()} } tokens per source)")
    main, index = [], []
    for sid in config.kv_source_layer_ids:
        r = config.compress_ratios[sid]
        m, k = state.sources[sid].packed(start // r, end // r)
        main.append(to_bytes(m))
        index.append(to_bytes(k))
    return GlobalSlice(start, end, tuple(main), tuple(index))


def import_global(config: CEDConfig, state: SequenceState, start: int, end: int, payload: GlobalSlice,
                  dtype: torch.dtype) -> None:
    """Append persisted entries for tokens [start, end); `start` must be where the state's entries end."""
    check_token_range(config, start, end)
    if (payload.start, payload.end) != (start, end):
        raise ValueError(f"import_global: payload covers [{payload.start}, {payload.end}), asked for [{start}, {end})")
    n = len(config.kv_source_layer_ids)
    if len(payload.main) != n or len(payload.index) != n:
        raise ValueError(f"import_global: need {n} main and {n} index payloads (one per KV source), got "
                         f"{len(payload.main)} and {len(payload.index)}")
    for sid in config.kv_source_layer_ids:
        src = state.sources[sid]
        if src.covered_tokens != start:
            raise ValueError(f"import_global: source {sid} covers tokens [0, {src.covered_tokens}); entries must be "
                             f"imported in order starting there, got start {start}")
    decoded = []
    for i, sid in enumerate(config.kv_source_layer_ids):  # decode everything before mutating anything
        rows = entries_in(config, sid, start, end)
        main = fp4_from_bytes(payload.main[i], rows, config.d_latent, MAIN_BLOCK, "e4m3")
        index = fp4_from_bytes(payload.index[i], rows, config.index_dim, INDEX_BLOCK, "e8m0")
        decoded.append((sid, main, index))
    device = state.tokens.view().device
    for sid, main, index in decoded:
        state.sources[sid].append(_to_device(main, device), _to_device(index, device), dtype)


def _to_device(p, device: torch.device):
    return type(p)(p.codes.to(device), p.scales.to(device), p.block, p.scale_format)


# ---------------------------------------------------------------------- SWA rings, tails, tokens


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _tensor_from(buf: bytes, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if not buf:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dtype).view(shape).to(device)


def ring_row_bytes(config: CEDConfig, fmt: RingFormat, dtype: torch.dtype) -> int:
    if fmt == "fp8":
        return fp8_row_bytes(config.d_latent, RING_BLOCK)
    if fmt == "native":
        return config.d_latent * torch.empty(0, dtype=dtype).element_size()
    raise ValueError(f"ring format must be 'native' or 'fp8', got {fmt!r}")


def export_swa(config: CEDConfig, state: SequenceState, fmt: RingFormat = "native") -> bytes:
    """Every layer's ring (the last min(W, T) window keys), oldest row first."""
    t = state.num_tokens
    rows = min(t, config.sliding_window)
    out = []
    for layer_id, ring in enumerate(state.rings):
        if ring.end != t or len(ring) != rows:
            raise ValueError(f"export_swa: layer {layer_id}'s ring holds {len(ring)} rows ending at {ring.end}, "
                             f"expected {rows} ending at {t} (replay first)")
        out.append(to_bytes(quantize_fp8_e8m0(ring.view(), RING_BLOCK)) if fmt == "fp8" else _tensor_bytes(ring.view()))
    return b"".join(out)


def import_swa(config: CEDConfig, state: SequenceState, payload: bytes, dtype: torch.dtype,
               fmt: RingFormat = "native") -> None:
    """Load every layer's ring for the state's tokens (import the tokens first)."""
    t = state.num_tokens
    rows = min(t, config.sliding_window)
    row_bytes = ring_row_bytes(config, fmt, dtype)
    expected = config.n_layers * rows * row_bytes
    if len(payload) != expected:
        raise ValueError(f"import_swa: {config.n_layers} layers x {rows} rows x {row_bytes} B = {expected} bytes "
                         f"expected for {t} tokens, got {len(payload)}")
    device = state.tokens.view().device
    per_layer = rows * row_bytes
    for layer_id, ring in enumerate(state.rings):
        chunk = payload[layer_id * per_layer: (layer_id + 1) * per_layer]
        if fmt == "fp8":
            values = dequantize_fp8(fp8_from_bytes(chunk, rows, config.d_latent, RING_BLOCK), dtype).to(device)
        else:
            values = _tensor_from(chunk, dtype, (rows, config.d_latent), device)
        ring.load(values, t)


def _tail_sources(config: CEDConfig) -> list[int]:
    return [s for s in config.kv_source_layer_ids if config.compress_ratios[s] > 1]


def export_tails(config: CEDConfig, state: SequenceState) -> bytes:
    """Per ratio>1 source: the wkv_c rows then the wgate rows of its incomplete group."""
    out = []
    for sid in _tail_sources(config):
        src = state.sources[sid]
        if src.covered_tokens != state.num_tokens:
            raise ValueError(f"export_tails: source {sid} has seen {src.covered_tokens} of {state.num_tokens} tokens")
        out += [_tensor_bytes(src.tail_kv), _tensor_bytes(src.tail_gate)]
    return b"".join(out)


def import_tails(config: CEDConfig, state: SequenceState, payload: bytes, dtype: torch.dtype) -> None:
    """Load the tails; tokens and global entries must already be imported (they fix each tail's length)."""
    cdt = compute_dtype(dtype)
    elem = torch.empty(0, dtype=cdt).element_size()
    sizes, loaded = [], []
    for sid in _tail_sources(config):
        rows = state.num_tokens - state.sources[sid].published_tokens
        if not 0 <= rows < config.compress_ratios[sid]:
            raise ValueError(f"import_tails: source {sid} publishes tokens [0, {state.sources[sid].published_tokens}) "
                             f"but the state has {state.num_tokens} tokens; import tokens and global entries first")
        sizes.append(rows * config.d_latent * elem)
    if len(payload) != 2 * sum(sizes):
        raise ValueError(f"import_tails: expected {2 * sum(sizes)} bytes (kv + gate rows per source: {sizes}), "
                         f"got {len(payload)}")
    device, at = state.tokens.view().device, 0
    for sid, size in zip(_tail_sources(config), sizes):
        rows = size // (config.d_latent * elem)
        kv = _tensor_from(payload[at: at + size], cdt, (rows, config.d_latent), device)
        gate = _tensor_from(payload[at + size: at + 2 * size], cdt, (rows, config.d_latent), device)
        loaded.append((sid, kv, gate))
        at += 2 * size
    for sid, kv, gate in loaded:
        state.sources[sid].tail_kv, state.sources[sid].tail_gate = kv, gate


def export_tokens(state: SequenceState) -> bytes:
    return _tensor_bytes(state.tokens.view().to(torch.int32))


def import_tokens(state: SequenceState, payload: bytes) -> None:
    """Set the tokens of a state that has none (int32 little-endian)."""
    if state.num_tokens:
        raise ValueError(f"import_tokens: the state already holds {state.num_tokens} tokens")
    if len(payload) % 4:
        raise ValueError(f"import_tokens: payload of {len(payload)} bytes is not whole int32 tokens")
    device = state.tokens.view().device
    state.tokens.append(_tensor_from(payload, torch.int32, (len(payload) // 4,), device).long())


# ---------------------------------------------------------------------- device-side import (GPU resume)


def split_block_rows(config: CEDConfig, pages: torch.Tensor, block_tokens: int, row_bytes: int) -> list[torch.Tensor]:
    """Per-source entry rows from the payloads of whole blocks, without leaving the device.

    Args:
        pages: uint8 [n, >= payload] : row i holds block i's record payload (the hbm tier's
            pages, gathered by slot id), blocks consecutive in token order.
        block_tokens: B, a multiple of every ratio (so each block holds B / r entries a source).
        row_bytes: `config.main_row_bytes` (GLOBAL_KV) or `config.index_row_bytes` (INDEX_K).

    Returns:
        One uint8 [n * B / r_s, row_bytes] tensor per KV source, `kv_source_layer_ids` order.
    """
    per_block = [block_tokens // config.compress_ratios[s] for s in config.kv_source_layer_ids]
    payload = sum(per_block) * row_bytes
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] < payload:
        raise ValueError(f"split_block_rows: pages must be uint8 [n, >= {payload}], got {pages.dtype} "
                         f"{tuple(pages.shape)}")
    rows = pages[:, :payload].view(pages.shape[0], sum(per_block), row_bytes)
    out, at = [], 0
    for m in per_block:
        out.append(rows[:, at: at + m].reshape(-1, row_bytes))
        at += m
    return out


def import_global_rows(config: CEDConfig, state: SequenceState, start: int, end: int,
                       main_rows: list[torch.Tensor], index_rows: list[torch.Tensor], dtype: torch.dtype) -> None:
    """`import_global` from per-source uint8 row tensors already on the state's device.

    The GPU resume path: rows come straight from the hbm tier's pages (`split_block_rows`),
    so nothing crosses PCIe again and dequantization runs on the device (Triton on CUDA).
    """
    check_token_range(config, start, end)
    n = len(config.kv_source_layer_ids)
    if len(main_rows) != n or len(index_rows) != n:
        raise ValueError(f"import_global_rows: need {n} main and {n} index row tensors, got "
                         f"{len(main_rows)} and {len(index_rows)}")
    for i, sid in enumerate(config.kv_source_layer_ids):
        src, want = state.sources[sid], entries_in(config, sid, start, end)
        if src.covered_tokens != start:
            raise ValueError(f"import_global_rows: source {sid} covers tokens [0, {src.covered_tokens}); entries "
                             f"must be imported in order starting there, got start {start}")
        for what, t, width in (("main", main_rows[i], config.main_row_bytes),
                               ("index", index_rows[i], config.index_row_bytes)):
            if t.dtype != torch.uint8 or tuple(t.shape) != (want, width):
                raise ValueError(f"import_global_rows: source {sid} {what} rows must be uint8 [{want}, {width}], "
                                 f"got {t.dtype} {tuple(t.shape)}")
    d, di = config.d_latent, config.index_dim
    for i, sid in enumerate(config.kv_source_layer_ids):
        m, k = main_rows[i], index_rows[i]
        main = PackedFP4(m[:, : d // 2], m[:, d // 2:], MAIN_BLOCK, "e4m3")
        index = PackedFP4(k[:, : di // 2], k[:, di // 2:], INDEX_BLOCK, "e8m0")
        state.sources[sid].append(main, index, dtype)
