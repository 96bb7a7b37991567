"""What a CED model is: one validated config, its layer schedule, and its state sizes.

The encoder/decoder split, who owns which global state and how many bytes each token costs
all follow from a handful of fields (ENGINE.md §1). `CEDConfig.__post_init__` checks the rules
that make a schedule meaningful, so an engine built from a config never has to ask.

Layer modes (V4.1 numbering)::

    layer   0  1 | 2  3 .. 7 | 8  9 .. 13 | 14 .. 19 | 20 | 21 22 23 24 25 .. 39
    ratio   0  0 | 2  2    2 | 2  2     2 |  2     2 |  1 |  1  1  1  1  1     1
    mode    W  W | F  U    U | F  U     U |  F     U |  F |  U  U  U  R  U ...
            ----------------- encoder (every prompt row) -----------| decoder (bounded tail)
    W = WINDOW (SWA only), F = FULL (compressor + index keys + own indexer),
    R = REINDEX (own indexer, restricted to the candidate pool), U = REUSE.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields
from typing import Any

MAIN_BLOCK = 16  # E2M1 values per E4M3 scale in the main global KV (ENGINE.md §3)
INDEX_BLOCK = 32  # E2M1 values per E8M0 scale in the index keys
RING_BLOCK = 32  # FP8 values per E8M0 scale in an SWA ring row (the GPU format)


class LayerMode(enum.Enum):
    """What one layer does with global state (ENGINE.md §1)."""

    WINDOW = "window"  # SWA only, owns nothing global
    FULL = "full"  # compressor + index keys + its own indexer over every visible entry
    REINDEX = "reindex"  # its own indexer over the owner's index keys, inside the candidate pool
    REUSE = "reuse"  # the last owner's KV and the last index source's top-k, as they are


def _fp4_row_bytes(dim: int, block: int) -> int:
    """Bytes of one FP4 row: dim/2 code bytes + one scale byte per block (codecs.fp4_row_bytes)."""
    return dim // 2 + dim // block


@dataclass(frozen=True, slots=True)
class CEDConfig:
    """Shape and layer schedule of a CED/CSA2 model; validated at construction.

    Lists given for the `*_ids` and `compress_ratios` fields are stored as tuples, so a config
    is hashable and cannot change under an engine built from it.
    """

    name: str
    n_layers: int
    compress_ratios: tuple[int, ...]  # per layer: 0 = SWA only, r > 0 = one global entry per r tokens
    kv_source_layer_ids: tuple[int, ...]  # layers that compute and own global KV and index keys
    index_source_layer_ids: tuple[int, ...]  # layers that run their own indexer (FULL or REINDEX)
    candidate_source_layer_id: int  # the FULL layer whose block scores define the candidate pool
    candidate_topk_blocks: int  # blocks in the pool
    candidate_block_size: int  # entries per block
    index_topk: int  # entries selected per query
    sliding_window: int  # W: query t sees window keys t-W+1 .. t
    d_model: int
    n_heads: int
    d_latent: int  # the one MQA latent: key = value
    d_rope: int  # RoPE tail of the latent
    q_rank: int  # low-rank query bottleneck (wq_a -> norm -> wq_b)
    o_groups: int  # grouped low-rank output projection: heads are split into o_groups groups
    o_rank: int  # ... each projected to o_rank, then concatenated and projected to d_model
    index_heads: int
    index_dim: int
    index_rope: int  # RoPE tail of the index queries and keys
    d_ffn: int  # SwiGLU hidden size
    vocab_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        _validate(self)

    # ------------------------------------------------------------------ schedule

    @property
    def layer_modes(self) -> tuple[LayerMode, ...]:
        """The mode of every layer, derived from ratios and source lists."""
        return tuple(self.layer_mode(i) for i in range(self.n_layers))

    def layer_mode(self, layer_id: int) -> LayerMode:
        if self.compress_ratios[layer_id] == 0:
            return LayerMode.WINDOW
        if layer_id in self.kv_source_layer_ids:
            return LayerMode.FULL
        if layer_id in self.index_source_layer_ids:
            return LayerMode.REINDEX
        return LayerMode.REUSE

    def kv_source_of(self, layer_id: int) -> int | None:
        """The KV source whose global entries `layer_id` reads (the most recent at or below it)."""
        if self.compress_ratios[layer_id] == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer_id)

    def index_source_of(self, layer_id: int) -> int | None:
        """The index source whose top-k `layer_id` uses (itself when it is one)."""
        if self.compress_ratios[layer_id] == 0:
            return None
        return max(s for s in self.index_source_layer_ids if s <= layer_id)

    @property
    def encoder_layer_ids(self) -> tuple[int, ...]:
        """Layers 0 .. candidate source, inclusive: prefill runs them on every prompt row.

        NOTE: the candidate source belongs to the encoder. ENGINE.md §4 counts V4.1's decoder as
        layers 21-39 (R = 1 + 19 * 127 = 2,414), so layer 20 runs on every row: its compressor
        needs every row anyway.
        """
        return tuple(range(self.candidate_source_layer_id + 1))

    @property
    def decoder_layer_ids(self) -> tuple[int, ...]:
        """Layers after the candidate source: they own only their SWA ring."""
        return tuple(range(self.candidate_source_layer_id + 1, self.n_layers))

    @property
    def max_ratio(self) -> int:
        """Every persisted token range starts and ends on a multiple of this (1 if no ratio)."""
        return max([1, *self.compress_ratios])

    @property
    def pool_size(self) -> int:
        """Entries in the candidate pool."""
        return self.candidate_topk_blocks * self.candidate_block_size

    # ------------------------------------------------------------------ sizes

    @property
    def main_row_bytes(self) -> int:
        """Stored bytes of one main global entry (E2M1 + E4M3/16): 288 at d_latent 512."""
        return _fp4_row_bytes(self.d_latent, MAIN_BLOCK)

    @property
    def index_row_bytes(self) -> int:
        """Stored bytes of one index key (E2M1 + E8M0/32): 68 at index_dim 128."""
        return _fp4_row_bytes(self.index_dim, INDEX_BLOCK)

    @property
    def global_bytes_per_token(self) -> float:
        """Persisted global bytes per token, computed without any weights: 890 for V4.1."""
        entries_per_token = sum(1 / self.compress_ratios[s] for s in self.kv_source_layer_ids)
        return entries_per_token * (self.main_row_bytes + self.index_row_bytes)

    @property
    def ring_row_bytes(self) -> int:
        """One SWA ring row in the GPU format, FP8 E4M3 + E8M0/32: 528 at d_latent 512."""
        return self.d_latent + self.d_latent // RING_BLOCK

    @property
    def swa_bytes_per_sequence(self) -> int:
        """All SWA rings of one sequence in the FP8 format (V4.1: 40 x 128 x 528 B = 2.58 MiB)."""
        return self.n_layers * self.sliding_window * self.ring_row_bytes

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON types, in declaration order: stable input for fingerprints."""
        out = asdict(self)
        return {f.name: list(out[f.name]) if isinstance(out[f.name], tuple) else out[f.name] for f in fields(self)}


# ---------------------------------------------------------------------- validation


def _fail(field: str, rule: str) -> None:
    raise ValueError(f"CEDConfig.{field}: {rule}")


def _validate(c: CEDConfig) -> None:
    _validate_sizes(c)
    _validate_lists(c)
    _validate_schedule(c)
    _validate_pool(c)


def _validate_sizes(c: CEDConfig) -> None:
    for name in ("n_layers", "sliding_window", "d_model", "n_heads", "d_latent", "q_rank", "o_groups",
                 "o_rank", "index_heads", "index_dim", "index_topk", "candidate_topk_blocks",
                 "candidate_block_size", "d_ffn", "vocab_size"):
        if getattr(c, name) <= 0:
            _fail(name, f"must be positive, got {getattr(c, name)}")
    if c.d_latent % MAIN_BLOCK:
        _fail("d_latent", f"must be a multiple of {MAIN_BLOCK} (one E4M3 scale per {MAIN_BLOCK} values), "
              f"got {c.d_latent}")
    if c.index_dim % INDEX_BLOCK:
        _fail("index_dim", f"must be a multiple of {INDEX_BLOCK} (one E8M0 scale per {INDEX_BLOCK} values), "
              f"got {c.index_dim}")
    if c.d_rope % 2 or not 0 < c.d_rope <= c.d_latent:
        _fail("d_rope", f"rope dims must be even and in (0, d_latent={c.d_latent}], got {c.d_rope}")
    if c.index_rope % 2 or not 0 < c.index_rope <= c.index_dim:
        _fail("index_rope", f"rope dims must be even and in (0, index_dim={c.index_dim}], got {c.index_rope}")
    if c.n_heads % c.o_groups:
        _fail("o_groups", f"must divide n_heads={c.n_heads} (heads are grouped), got {c.o_groups}")


def _validate_lists(c: CEDConfig) -> None:
    if len(c.compress_ratios) != c.n_layers:
        _fail("compress_ratios", f"length must equal n_layers={c.n_layers}, got {len(c.compress_ratios)}")
    if any(r < 0 for r in c.compress_ratios):
        _fail("compress_ratios", f"ratios must be >= 0, got {list(c.compress_ratios)}")
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        ids = getattr(c, name)
        if list(ids) != sorted(set(ids)):
            _fail(name, f"layer ids must be strictly increasing, got {list(ids)}")
        if any(not 0 <= i < c.n_layers for i in ids):
            _fail(name, f"layer ids must lie in [0, n_layers={c.n_layers}), got {list(ids)}")
    if not 0 <= c.candidate_source_layer_id < c.n_layers:
        _fail("candidate_source_layer_id", f"must lie in [0, n_layers={c.n_layers}), "
              f"got {c.candidate_source_layer_id}")


def _validate_schedule(c: CEDConfig) -> None:
    sources, index_sources = c.kv_source_layer_ids, c.index_source_layer_ids
    if not sources:
        _fail("kv_source_layer_ids", "a CED model needs at least one KV source")
    missing = [s for s in sources if s not in index_sources]
    if missing:
        _fail("kv_source_layer_ids", f"every KV source is an index source (missing from "
              f"index_source_layer_ids: {missing})")
    zero = [s for s in sources if c.compress_ratios[s] == 0]
    if zero:
        _fail("kv_source_layer_ids", f"kv sources have ratio > 0 (a WINDOW layer owns nothing); ratio 0 at {zero}")
    zero = [s for s in index_sources if c.compress_ratios[s] == 0]
    if zero:
        _fail("index_source_layer_ids", f"a WINDOW layer (ratio 0) owns nothing, so it cannot be an index "
              f"source: {zero}")
    for layer_id, ratio in enumerate(c.compress_ratios):
        if ratio == 0:
            continue
        below = [s for s in sources if s <= layer_id]
        if not below:
            _fail("kv_source_layer_ids", f"a consumer reads the KV of the most recent source at or below it, "
                  f"but layer {layer_id} (ratio {ratio}) has none; the first layer with ratio > 0 must be a source")
        if c.compress_ratios[below[-1]] != ratio:
            _fail("compress_ratios", f"a consumer reads the KV of the most recent source at or below it, "
                  f"with the same ratio: layer {layer_id} has ratio {ratio}, its source {below[-1]} has "
                  f"ratio {c.compress_ratios[below[-1]]}")


def _validate_pool(c: CEDConfig) -> None:
    cand = c.candidate_source_layer_id
    if cand not in c.kv_source_layer_ids:
        _fail("candidate_source_layer_id", f"the candidate source must be a FULL layer (a KV source), "
              f"got layer {cand}")
    if cand != c.kv_source_layer_ids[-1]:
        _fail("candidate_source_layer_id", f"the candidate source must be the last KV source: decoder layers "
              f"own only their SWA ring (later sources: {[s for s in c.kv_source_layer_ids if s > cand]})")
    early = [i for i in c.index_source_layer_ids if i not in c.kv_source_layer_ids and i < cand]
    if early:
        _fail("index_source_layer_ids", f"a REINDEX layer restricts itself to the candidate pool, so it must "
              f"lie above the candidate source {cand}: {early}")
    if c.pool_size < c.index_topk:
        _fail("index_topk", f"pool size candidate_topk_blocks * candidate_block_size = {c.pool_size} must be "
              f">= index_topk = {c.index_topk}")


# ---------------------------------------------------------------------- presets


def mini() -> CEDConfig:
    """Unit-test model (ENGINE.md §5): 8 layers, 159 global B/token, small enough for float64 tests."""
    return CEDConfig(
        name="mini", n_layers=8, compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1),
        kv_source_layer_ids=(2, 4), index_source_layer_ids=(2, 4, 6), candidate_source_layer_id=4,
        candidate_topk_blocks=4, candidate_block_size=4, index_topk=8, sliding_window=8,
        d_model=64, n_heads=2, d_latent=128, d_rope=16, q_rank=32, o_groups=2, o_rank=32,
        index_heads=2, index_dim=64, index_rope=16, d_ffn=128, vocab_size=256,
    )


def tiny() -> CEDConfig:
    """CPU demo and benchmark model (ENGINE.md §5): 16 layers, d_model 256, W 128, 212 global B/token.

    Fields the spec leaves open (q_rank, output groups, index RoPE) follow V4.1's proportions.
    """
    return CEDConfig(
        name="tiny", n_layers=16, compress_ratios=(0, 0) + (2,) * 6 + (1,) * 8,
        kv_source_layer_ids=(2, 5, 8), index_source_layer_ids=(2, 5, 8, 11, 14), candidate_source_layer_id=8,
        candidate_topk_blocks=32, candidate_block_size=8, index_topk=64, sliding_window=128,
        d_model=256, n_heads=4, d_latent=128, d_rope=32, q_rank=128, o_groups=2, o_rank=128,
        index_heads=4, index_dim=64, index_rope=32, d_ffn=768, vocab_size=8192,
    )


def v41() -> CEDConfig:
    """DeepSeek-V4.1's attention geometry (ENGINE.md §5), MoE replaced by a dense SwiGLU: 890 B/token."""
    return CEDConfig(
        name="v41", n_layers=40, compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        kv_source_layer_ids=(2, 8, 14, 20), index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8, index_topk=512,
        sliding_window=128, d_model=5120, n_heads=64, d_latent=512, d_rope=64, q_rank=1280, o_groups=8,
        o_rank=1024, index_heads=32, index_dim=128, index_rope=64, d_ffn=16128, vocab_size=129280,
    )


PRESETS = {"mini": mini, "tiny": tiny, "v41": v41}


def get_preset(name: str) -> CEDConfig:
    """A preset by name; the error lists the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown CED preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()
