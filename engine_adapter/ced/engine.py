"""`CEDEngine`: prefill, decode, generate, replay and state transfer for the bundled CED model.

Every forward is one call of the model over the rows a `RowPlan` names (plan.py):

    prefill (chunk of n new tokens)   encoder layers 0..c on all n rows, decoder on the exact
                                      staircase (or `decoder_rows` uniform rows)
    decode_step                       every layer on the one new row; rings supply the window
    replay                            rings rebuilt from the replayed rows only; global reads
                                      use the persisted entries; only tokens past them publish
    reference_logits                  every layer on every row of a fresh state (test oracle)

Sequences of a batch run one after the other (each forward is vectorised over its rows), so a
batch gives exactly the logits each sequence gives alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import transfer
from .config import INDEX_BLOCK, MAIN_BLOCK, CEDConfig
from .context import StepContext
from .layers import compute_dtype
from .model import CEDModel, build_model
from .plan import RowPlan, prefill_plan
from .state import GrowBuffer, Ring, SequenceState, SourceState, state_bytes
from .transfer import GlobalSlice, RingFormat

TokenIds = Sequence[int] | torch.Tensor


class CEDEngine:
    """The bundled reference engine (ENGINE.md). Deterministic on the CPU for a given seed.

    Args:
        config: the model (see config.py presets).
        seed: weight seed.
        device: "cpu", "cuda", ... or "meta" (shapes only: sizes without allocating weights).
        dtype: weights and activations (float64 for exactness tests, float32, bfloat16).
        query_chunk: queries per indexer chunk (its scores are [chunk, E]); bounds memory at
            long contexts. Default 256 on the CPU, 1024 elsewhere.
        attention_tile: queries per attention tile (reads tile + W - 1 window keys). Default
            64 on the CPU (measured best for `tiny`), 256 elsewhere.
        fp8_ring: round window keys through FP8 E4M3 + E8M0/32 (V4.1's GPU ring format) before
            attention reads them; then `export_swa(fmt="fp8")` (528 B a row at D = 512) is lossless.
    """

    def __init__(self, config: CEDConfig, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, query_chunk: int | None = None,
                 attention_tile: int | None = None, fp8_ring: bool = False) -> None:
        self.config = config
        self.seed = seed
        self.device = torch.device(device)
        self.dtype = dtype
        on_cpu = self.device.type == "cpu"
        self.query_chunk = query_chunk or (256 if on_cpu else 1024)
        self.attention_tile = min(attention_tile or (64 if on_cpu else 256), self.query_chunk)
        self.fp8_ring = fp8_ring
        self.model: CEDModel = build_model(config, seed, self.device, dtype)

    # ------------------------------------------------------------------ states

    def new_state(self) -> SequenceState:
        """An empty sequence: no tokens, no entries, empty rings."""
        c, dev, dt = self.config, self.device, self.dtype

        def source(layer_id: int) -> SourceState:
            empty_tail = torch.empty(0, c.d_latent, dtype=compute_dtype(dt), device=dev)
            return SourceState(
                layer_id=layer_id, ratio=c.compress_ratios[layer_id],
                main_codes=GrowBuffer((c.d_latent // 2,), torch.uint8, dev),
                main_scales=GrowBuffer((c.d_latent // MAIN_BLOCK,), torch.uint8, dev),
                index_codes=GrowBuffer((c.index_dim // 2,), torch.uint8, dev),
                index_scales=GrowBuffer((c.index_dim // INDEX_BLOCK,), torch.uint8, dev),
                main_values=GrowBuffer((c.d_latent,), dt, dev),
                index_values=GrowBuffer((c.index_dim,), dt, dev),
                tail_kv=empty_tail, tail_gate=empty_tail,
            )

        return SequenceState(
            tokens=GrowBuffer((), torch.long, dev),
            sources={s: source(s) for s in c.kv_source_layer_ids},
            rings=[Ring(c.sliding_window, c.d_latent, dt, dev) for _ in range(c.n_layers)],
        )

    def state_bytes(self, state: SequenceState) -> dict[str, int]:
        """Bytes per kind: global_kv, index_k, swa_ring, compressor_tail, tokens."""
        return state_bytes(state)

    # ------------------------------------------------------------------ forward passes

    @torch.inference_mode()
    def prefill(self, states: Sequence[SequenceState], token_ids_list: Sequence[TokenIds], *,
                decoder_rows: int | None = None) -> torch.Tensor:
        """Append a chunk of tokens to each state; returns [B, vocab] logits of each last token.

        A state may be empty (a new prompt) or live (chunked prefill: a new message appended).
        `decoder_rows=None` runs the decoder on the exact staircase, so the result equals a
        full recompute up to reduction order; an int bounds the decoder tail (approximate).
        """
        self._check_batch(states, token_ids_list)
        return torch.stack([self._append(s, t, decoder_rows) for s, t in zip(states, token_ids_list)])

    @torch.inference_mode()
    def decode_step(self, states: Sequence[SequenceState], token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """One token per sequence through every layer; returns [B, vocab] logits."""
        tokens = [[int(t)] for t in token_ids]
        self._check_batch(states, tokens)
        return torch.stack([self._append(s, t, None) for s, t in zip(states, tokens)])

    def generate(self, state: SequenceState, num_tokens: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> list[int]:
        """Sample `num_tokens` tokens after the state's last token (greedy when temperature is 0).

        Sampling draws on the CPU from float32 probabilities, so a seeded CPU generator gives
        the same tokens whatever device the engine runs on.
        """
        if state.last_logits is None:
            raise ValueError("generate: the state has no logits yet; prefill (or replay) it first")
        out: list[int] = []
        logits = state.last_logits
        for _ in range(num_tokens):
            if temperature <= 0.0:
                token = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            out.append(token)
            logits = self.decode_step([state], [token])[0]
        return out

    @torch.inference_mode()
    def reference_logits(self, token_ids: TokenIds) -> torch.Tensor:
        """Full recompute: every layer on every row of a fresh state -> [T, vocab] logits (test oracle)."""
        state = self.new_state()
        tokens = self._as_tokens(token_ids)
        state.tokens.append(tokens)
        plan = RowPlan.full(self.config.n_layers, tokens.shape[0], logit_rows=tokens.shape[0])
        return self._forward(state, plan)

    @torch.inference_mode()
    def replay(self, state: SequenceState, token_ids: TokenIds, rows_per_layer: RowPlan) -> torch.Tensor:
        """Rebuild rings (and compressor tails) of a state from its tokens; returns the last logits [vocab].

        `state` holds persisted global entries for tokens [0, P) (`import_global`); `token_ids`
        is the whole sequence [0, T), T >= P. Layer l reads only the trailing
        `rows_per_layer.layer_rows[l]` rows, so its SWA ring comes from replayed rows alone;
        global reads use the persisted entries, which are never rewritten: only tokens past P
        publish, so every KV source layer must read all of [P, T). P is a multiple of each
        source's ratio (entries are whole groups), so no compressor group straddles the edge;
        rows below P are read as window keys only. Build the plan with `plan.replay_rows`.
        """
        tokens = self._as_tokens(token_ids)
        self._check_replay(state, tokens.shape[0], rows_per_layer)
        state.tokens.clear()
        state.tokens.append(tokens)
        for src in state.sources.values():
            src.clear_tail()
        for ring in state.rings:
            ring.reset()
        return self._forward(state, rows_per_layer)[-1]

    def _append(self, state: SequenceState, tokens: TokenIds, decoder_rows: int | None) -> torch.Tensor:
        tokens = self._as_tokens(tokens)
        if tokens.shape[0] == 0:
            raise ValueError("prefill: a sequence needs at least one new token")
        if not state.is_live():
            raise ValueError("prefill/decode: the state is not live (imported global entries without rings or "
                             "tails?); replay it or import its rings and tails first")
        state.tokens.append(tokens)
        plan = prefill_plan(self.config, state.num_tokens, tokens.shape[0], decoder_rows)
        return self._forward(state, plan)[-1]

    def _forward(self, state: SequenceState, plan: RowPlan) -> torch.Tensor:
        ctx = StepContext(state=state, end=state.num_tokens, plan=plan, query_chunk=self.query_chunk,
                          attention_tile=self.attention_tile, fp8_ring=self.fp8_ring)
        logits = self.model(state.tokens.view()[-plan.token_rows:], ctx)
        state.last_logits = logits[-1].clone()
        return logits

    # ------------------------------------------------------------------ checks

    def _as_tokens(self, token_ids: TokenIds) -> torch.Tensor:
        tokens = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        return tokens.to(self.device)

    @staticmethod
    def _check_batch(states: Sequence[SequenceState], token_ids_list: Sequence[TokenIds]) -> None:
        if len(states) != len(token_ids_list):
            raise ValueError(f"{len(states)} states but {len(token_ids_list)} token lists")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a state appears twice in one batch")

    def _check_replay(self, state: SequenceState, num_tokens: int, plan: RowPlan) -> None:
        c = self.config
        if len(plan.layer_rows) != c.n_layers:
            raise ValueError(f"replay: the plan has {len(plan.layer_rows)} layers, the model {c.n_layers}")
        if plan.token_rows > num_tokens:
            raise ValueError(f"replay: layer 0 reads {plan.token_rows} rows of a {num_tokens}-token sequence")
        for sid, src in state.sources.items():
            published = src.published_tokens
            start = num_tokens - plan.layer_rows[sid]
            if published > num_tokens:
                raise ValueError(f"replay: source {sid} holds entries for {published} tokens, more than the "
                                 f"{num_tokens} given")
            if start > published:
                raise ValueError(f"replay: layer {sid} reads rows from {start}, but its entries end at {published}: "
                                 f"the unpublished tokens [{published}, {num_tokens}) must all be replayed")

    # ------------------------------------------------------------------ state transfer

    def export_global(self, state: SequenceState, start: int, end: int) -> GlobalSlice:
        """Packed main entries and index keys of every KV source covering tokens [start, end)."""
        return transfer.export_global(self.config, state, start, end)

    def import_global(self, state: SequenceState, start: int, end: int,
                      payload: GlobalSlice | tuple[bytes, bytes]) -> None:
        """Append persisted entries for tokens [start, end): a `GlobalSlice` or (main_payload, index_payload)."""
        if not isinstance(payload, GlobalSlice):
            payload = GlobalSlice.from_payloads(self.config, start, end, *payload)
        transfer.import_global(self.config, state, start, end, payload, self.dtype)

    def export_swa(self, state: SequenceState, fmt: RingFormat = "native") -> bytes:
        return transfer.export_swa(self.config, state, fmt)

    def import_swa(self, state: SequenceState, payload: bytes, fmt: RingFormat = "native") -> None:
        transfer.import_swa(self.config, state, payload, self.dtype, fmt)

    def export_tails(self, state: SequenceState) -> bytes:
        return transfer.export_tails(self.config, state)

    def import_tails(self, state: SequenceState, payload: bytes) -> None:
        transfer.import_tails(self.config, state, payload, self.dtype)

    def export_tokens(self, state: SequenceState) -> bytes:
        return transfer.export_tokens(state)

    def import_tokens(self, state: SequenceState, payload: bytes) -> None:
        transfer.import_tokens(state, payload)
