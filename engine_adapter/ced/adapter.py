"""The `EngineAdapter` of the bundled CED engine: what statestore sees of it.

Kinds the CED engine produces (ENGINE.md §3) and how they are kept:

    GLOBAL_KV        E2M1 + E4M3/16, one record per block   MUST_KEEP
    INDEX_K          E2M1 + E8M0/32, one record per block   MUST_KEEP
    TOKENS           int32                                  MUST_KEEP (replay and recompute need them)
    SWA_RING         native dtype on the CPU, per sequence  REBUILDABLE (replay)
    COMPRESSOR_TAIL  compute dtype, < r rows per source     REBUILDABLE (replay)
    OPAQUE           the last token's logits                REBUILDABLE (kept with the rings so a
                                                            resume without replay can generate)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine_adapter.base import (
    Codec,
    EngineCosts,
    ReplayGeometry,
    Retention,
    StateKind,
    StatePayload,
    StateSpec,
)
from engine_adapter.fingerprint import make_model_fingerprint

from . import transfer
from .engine import CEDEngine
from .layers import compute_dtype
from . import plan
from .plan import RowPlan
from .state import SequenceState

LAYOUT_VERSION = 1  # bump when an export layout changes
_DTYPE_CODECS = {torch.float32: Codec.FP32, torch.bfloat16: Codec.BF16, torch.float64: Codec.FP64}
_CODECS_BY_KIND = {StateKind.GLOBAL_KV: Codec.E2M1_E4M3_16, StateKind.INDEX_K: Codec.E2M1_E8M0_32,
                   StateKind.TOKENS: Codec.INT32}


class CEDAdapter:
    """Adapts a `CEDEngine` to the `EngineAdapter` protocol.

    Args:
        engine: the engine (its config, seed and dtype define the model).
        weights_id: identity of the weights; random weights are named by their seed.
        costs: measured cost figures (`statestore calibrate`); else `measure_costs()` or an estimate.
    """

    def __init__(self, engine: CEDEngine, *, weights_id: str | None = None, costs: EngineCosts | None = None) -> None:
        self.engine = engine
        self.config = engine.config
        self._weights_id = weights_id or f"random-seed-{engine.seed}"
        self._costs = costs
        self._fingerprint = make_model_fingerprint(
            self.config.to_dict(), {int(k): int(c) for k, c in _CODECS_BY_KIND.items()}, LAYOUT_VERSION,
            self._weights_id)

    # ----- identity and specs -------------------------------------------------------------

    @property
    def model_fingerprint(self) -> bytes:
        return self._fingerprint

    @property
    def model_name(self) -> str:
        return f"ced-{self.config.name}"

    @property
    def token_alignment(self) -> int:
        return transfer.token_alignment(self.config)

    def state_specs(self) -> tuple[StateSpec, ...]:
        c = self.config
        entries = sum(1 / c.compress_ratios[s] for s in c.kv_source_layer_ids)
        ring_row = transfer.ring_row_bytes(c, "native", self.engine.dtype)
        tail_rows = sum(c.compress_ratios[s] - 1 for s in c.kv_source_layer_ids if c.compress_ratios[s] > 1)
        tail_elem = torch.empty(0, dtype=compute_dtype(self.engine.dtype)).element_size()
        native = _DTYPE_CODECS.get(self.engine.dtype, Codec.RAW)
        return (
            StateSpec(StateKind.GLOBAL_KV, Retention.MUST_KEEP, Codec.E2M1_E4M3_16,
                      bytes_per_token=entries * c.main_row_bytes, name="main global KV (FP4)"),
            StateSpec(StateKind.INDEX_K, Retention.MUST_KEEP, Codec.E2M1_E8M0_32,
                      bytes_per_token=entries * c.index_row_bytes, name="index keys (FP4)"),
            StateSpec(StateKind.TOKENS, Retention.MUST_KEEP, Codec.INT32, bytes_per_token=4, name="token ids"),
            StateSpec(StateKind.SWA_RING, Retention.REBUILDABLE, native,
                      bytes_per_sequence=c.n_layers * c.sliding_window * ring_row, name="SWA rings"),
            StateSpec(StateKind.COMPRESSOR_TAIL, Retention.REBUILDABLE, native,
                      bytes_per_sequence=max(1, 2 * tail_rows * c.d_latent * tail_elem), name="compressor tails"),
            StateSpec(StateKind.OPAQUE, Retention.REBUILDABLE, Codec.FP32,
                      bytes_per_sequence=4 * c.vocab_size, name="last-token logits"),
        )

    def replay_geometry(self) -> ReplayGeometry:
        return plan.replay_geometry(self.config)

    def costs(self) -> EngineCosts:
        if self._costs is None:
            self._costs = self._estimate_costs()
        return self._costs

    def _estimate_costs(self) -> EngineCosts:
        """Unmeasured placeholder from a FLOP count at an assumed 50 GFLOP/s (CPU)."""
        params_per_layer = sum(p.numel() for p in self.engine.model.parameters()) / max(1, self.config.n_layers)
        per_row_layer = 2 * params_per_layer / 50e9
        return EngineCosts(prefill_s_per_token=per_row_layer * self.config.n_layers,
                           decode_s_per_token=per_row_layer * self.config.n_layers * 4,
                           replay_s_per_row_layer=per_row_layer, device=str(self.engine.device))

    def measure_costs(self, num_tokens: int = 512) -> EngineCosts:
        """Time a prefill, a few decode steps and a bounded replay on this machine; cache the result.

        The replay runs the way a resume does: the prefilled state's global entries are
        exported, imported into a fresh state, and its trailing rows replayed.
        """
        tokens = torch.randint(0, self.config.vocab_size, (num_tokens,),
                               generator=torch.Generator().manual_seed(0)).tolist()
        state = self.new_state()
        t0 = time.perf_counter()
        self.append(state, tokens)
        prefill = (time.perf_counter() - t0) / num_tokens
        persisted = num_tokens // self.token_alignment * self.token_alignment
        payloads = self.export_range(state, 0, persisted)
        t0 = time.perf_counter()
        self.engine.generate(state, 4)
        decode = (time.perf_counter() - t0) / 4
        resumed = self.new_state()
        self.import_range(resumed, payloads)
        rows = plan.replay_rows(self.config, "bounded", num_tokens, published_tokens=persisted)
        t0 = time.perf_counter()
        self.engine.replay(resumed, tokens, rows)
        replay = (time.perf_counter() - t0) / rows.row_layers
        self._costs = EngineCosts(prefill, decode, replay, device=str(self.engine.device), measured=True)
        return self._costs

    # ----- running ---------------------------------------------------------------------------

    def new_state(self) -> SequenceState:
        return self.engine.new_state()

    def num_tokens(self, state: SequenceState) -> int:
        return state.num_tokens

    def token_ids(self, state: SequenceState) -> list[int]:
        return state.tokens.view().tolist()

    def append(self, state: SequenceState, token_ids: Sequence[int]) -> None:
        self.engine.prefill([state], [list(token_ids)])

    def generate(self, state: SequenceState, num_tokens: int, temperature: float = 0.0,
                 seed: int | None = None) -> list[int]:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return self.engine.generate(state, num_tokens, temperature, generator)

    def replay(self, state: SequenceState, token_ids: Sequence[int], layer_rows: Sequence[int]) -> None:
        self.engine.replay(state, list(token_ids), RowPlan(tuple(layer_rows)))

    # ----- state transfer --------------------------------------------------------------------

    def export_range(self, state: SequenceState, start: int, end: int) -> list[StatePayload]:
        sl = transfer.export_global(self.config, state, start, end)
        entries = sum(transfer.entries_in(self.config, s, start, end) for s in self.config.kv_source_layer_ids)
        return [StatePayload(StateKind.GLOBAL_KV, Codec.E2M1_E4M3_16, start, end, sl.main_payload, entries),
                StatePayload(StateKind.INDEX_K, Codec.E2M1_E8M0_32, start, end, sl.index_payload, entries)]

    def import_range(self, state: SequenceState, payloads: Sequence[StatePayload]) -> None:
        """Import GLOBAL_KV/INDEX_K pairs of consecutive ranges, in order."""
        mains = {(p.token_start, p.token_end): p for p in payloads if p.kind is StateKind.GLOBAL_KV}
        index = {(p.token_start, p.token_end): p for p in payloads if p.kind is StateKind.INDEX_K}
        if set(mains) != set(index) or len(mains) + len(index) != len(payloads):
            raise ValueError("import_range: payloads must be GLOBAL_KV/INDEX_K pairs over the same token ranges")
        for start, end in sorted(mains):
            sl = transfer.GlobalSlice.from_payloads(self.config, start, end, mains[start, end].payload,
                                                    index[start, end].payload)
            transfer.import_global(self.config, state, start, end, sl, self.engine.dtype)

    def export_rebuildable(self, state: SequenceState) -> list[StatePayload]:
        t = state.num_tokens
        native = _DTYPE_CODECS.get(self.engine.dtype, Codec.RAW)
        if state.last_logits is None:
            raise ValueError("export_rebuildable: the state has no logits yet")
        logits = state.last_logits.detach().float().cpu().contiguous().numpy().tobytes()
        return [StatePayload(StateKind.SWA_RING, native, t, t, transfer.export_swa(self.config, state, "native")),
                StatePayload(StateKind.COMPRESSOR_TAIL, native, t, t, transfer.export_tails(self.config, state)),
                StatePayload(StateKind.OPAQUE, Codec.FP32, t, t, logits)]

    def import_rebuildable(self, state: SequenceState, token_ids: Sequence[int],
                           payloads: Sequence[StatePayload]) -> None:
        by_kind = {p.kind: p for p in payloads}
        missing = {StateKind.SWA_RING, StateKind.COMPRESSOR_TAIL, StateKind.OPAQUE} - set(by_kind)
        if missing:
            raise ValueError(f"import_rebuildable: missing {sorted(k.name for k in missing)}")
        if any(p.token_end != len(token_ids) for p in payloads):
            raise ValueError("import_rebuildable: payloads describe another sequence length")
        logits = by_kind[StateKind.OPAQUE].payload
        if len(logits) != 4 * self.config.vocab_size:
            raise ValueError(f"import_rebuildable: logits must be {4 * self.config.vocab_size} bytes, got {len(logits)}")
        transfer.import_tokens(state, torch.tensor(list(token_ids), dtype=torch.int32).numpy().tobytes())
        transfer.import_swa(self.config, state, by_kind[StateKind.SWA_RING].payload, self.engine.dtype, "native")
        transfer.import_tails(self.config, state, by_kind[StateKind.COMPRESSOR_TAIL].payload, self.engine.dtype)
        state.last_logits = torch.frombuffer(bytearray(logits), dtype=torch.float32).to(
            device=self.engine.device, dtype=self.engine.dtype)
        if not state.is_live():
            raise ValueError("import_rebuildable: the state is not live after import (global entries missing?)")
