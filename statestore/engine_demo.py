"""The engine end to end, before the service exists around it: prefill, generate, and the
bytes per token that statestore keeps against what a conventional cache would keep.

Used by `statestore demo --engine-only`; the service demo (issue 4) builds on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine_adapter.ced import CEDEngine, get_preset
from engine_adapter.ced import transfer


@dataclass(frozen=True, slots=True)
class BytesRow:
    """Bytes per token of one way to keep a model's state."""

    what: str
    bytes_per_token: float
    note: str


def bytes_table(preset: str) -> list[BytesRow]:
    """Global bytes/token from the config (no weights): ours FP4 vs BF16 shared vs BF16 per layer."""
    c = get_preset(preset)
    entries_per_token = sum(1 / c.compress_ratios[s] for s in c.kv_source_layer_ids)
    return [
        BytesRow("FP4 global KV + index keys (statestore keeps)", c.global_bytes_per_token, "must keep"),
        BytesRow("same sharing in BF16", entries_per_token * (c.d_latent + c.index_dim) * 2,
                 "what a BF16 store of the same entries costs"),
        BytesRow("BF16 latent in every layer", c.n_layers * c.d_latent * 2, "a conventional MLA-style stack"),
        BytesRow("SWA rings (FP8), per sequence", c.swa_bytes_per_sequence, "rebuilt by replay: not kept"),
    ]


def run_engine_demo(preset: str = "tiny", prompt_tokens: int = 1024, new_tokens: int = 16, seed: int = 0) -> dict:
    """Prefill a seeded random prompt, generate greedily, measure exported bytes. Returns a report."""
    config = get_preset(preset)
    t0 = time.perf_counter()
    engine = CEDEngine(config, seed=seed)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (prompt_tokens,), generator=gen).tolist()
    state = engine.new_state()
    t0 = time.perf_counter()
    engine.prefill([state], [prompt])
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    generated = engine.generate(state, new_tokens)
    decode_s = time.perf_counter() - t0
    align = transfer.token_alignment(config)
    kept_until = state.num_tokens // align * align
    exported = transfer.export_global(config, state, 0, kept_until)
    return {
        "preset": preset,
        "prompt_tokens": prompt_tokens,
        "generated": generated,
        "build_s": build_s,
        "prefill_s": prefill_s,
        "prefill_tok_s": prompt_tokens / prefill_s,
        "decode_s": decode_s,
        "decode_tok_s": new_tokens / decode_s if new_tokens else 0.0,
        "exported_tokens": kept_until,
        "exported_bytes": exported.nbytes,
        "measured_bytes_per_token": exported.nbytes / kept_until if kept_until else 0.0,
        "state_bytes": engine.state_bytes(state),
    }
