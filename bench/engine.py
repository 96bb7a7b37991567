"""Engine throughput: prefill and decode tokens/s of the bundled CED engine vs a dense transformer.

    python -m bench.engine [--quick] [--device cpu|cuda] [--preset tiny] [--threads N]

For each context length (1K/4K/8K; --quick: 1K/4K) it times a prefill of T tokens and then
decode steps at context T, for the CED engine and, as the in-run reference, a plain dense
pre-norm transformer of the same width, depth, heads and SwiGLU (causal SDPA, a KV cache for
decode). Each figure is the best of several runs after a warm-up (other developers share the
machine; the load average is recorded). It then profiles one 4K prefill by phase (encoder
attention, indexer/top-k, compressor, encoder FFN, decoder tail) and checks the floor:
a 4K-token `tiny` prefill in fp32 on 2 CPU cores must take <= 2.6 s (ENGINE.md §5).

Writes bench/results/engine[-cuda].json (DESIGN.md §7 format); presets other than `tiny` write
engine_<preset>[-cuda].json.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import Floor, print_floors, print_table, write_results
from engine_adapter.ced import CEDConfig, CEDEngine, get_preset

FLOOR_PREFILL_4K_S = 2.6  # the prototype's 2.3-2.6 s, upper end (ENGINE.md §5)


# ---------------------------------------------------------------------- the dense reference


class DenseBlock(nn.Module):
    """Pre-norm MHA (d_model / n_heads per head) + SwiGLU, no biases: the textbook dense layer."""

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, **kw) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(d_model, **kw), nn.RMSNorm(d_model, **kw)
        self.wqkv = nn.Linear(d_model, 3 * d_model, bias=False, **kw)
        self.wo = nn.Linear(d_model, d_model, bias=False, **kw)
        self.w13 = nn.Linear(d_model, 2 * d_ffn, bias=False, **kw)
        self.w2 = nn.Linear(d_ffn, d_model, bias=False, **kw)

    def forward(self, h: torch.Tensor, cache: list[torch.Tensor], pos: int) -> torch.Tensor:
        """Rows [pos, pos + t); causal masking assumes a prefill starts at 0 or decodes one row."""
        t, d = h.shape
        q, k, v = self.wqkv(self.attn_norm(h)).view(t, 3, self.n_heads, d // self.n_heads).unbind(1)
        cache[0][pos: pos + t], cache[1][pos: pos + t] = k, v
        # [1, H, T, D]: the 4-d form takes PyTorch's fused (flash) CPU kernel, ~8x the 3-d one at 4K
        keys, values = (c[: pos + t].transpose(0, 1)[None] for c in cache)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, is_causal=t > 1)
        h = h + self.wo(out[0].transpose(0, 1).reshape(t, d))
        gate, up = self.w13(self.ffn_norm(h)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)


class DenseLM(nn.Module):
    """Same d_model, depth, heads, FFN and vocabulary as the CED config; full KV cache."""

    def __init__(self, c: CEDConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.config, self.device, self.dtype = c, device, dtype
        self.embed = nn.Embedding(c.vocab_size, c.d_model, **kw)
        self.blocks = nn.ModuleList(DenseBlock(c.d_model, c.n_heads, c.d_ffn, **kw) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.d_model, **kw)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False, **kw)

    def new_cache(self, max_tokens: int) -> list[list[torch.Tensor]]:
        c = self.config
        shape = (max_tokens, c.n_heads, c.d_model // c.n_heads)
        return [[torch.empty(shape, device=self.device, dtype=self.dtype) for _ in range(2)]
                for _ in range(c.n_layers)]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: list[list[torch.Tensor]], pos: int) -> torch.Tensor:
        h = self.embed(tokens)
        for block, layer_cache in zip(self.blocks, cache):
            h = block(h, layer_cache, pos)
        return self.head(self.norm(h[-1:]))[0]


# ---------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn: Callable[[], None], repeats: int, device: torch.device) -> tuple[float, float]:
    """(best, median) wall seconds of `fn` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def measure_ced(engine: CEDEngine, tokens: torch.Tensor, decode_steps: int, repeats: int) -> dict[str, float]:
    def prefill() -> None:
        engine.prefill([engine.new_state()], [tokens])

    prefill()  # warm-up
    best, median = best_of(prefill, repeats, engine.device)
    state = engine.new_state()
    engine.prefill([state], [tokens])
    steps = [int(t) for t in tokens[:decode_steps]]

    def decode() -> None:
        for tok in steps:
            engine.decode_step([state], [tok])

    decode_s, _ = best_of(decode, max(1, repeats // 2), engine.device)
    return {"prefill_s": best, "prefill_median_s": median, "decode_s_per_token": decode_s / decode_steps}


def measure_dense(model: DenseLM, tokens: torch.Tensor, decode_steps: int, repeats: int,
                  device: torch.device) -> dict[str, float]:
    n = tokens.shape[0]
    cache = model.new_cache(n + decode_steps * max(1, repeats))
    model(tokens, cache, 0)  # warm-up
    best, median = best_of(lambda: model(tokens, cache, 0), repeats, device)
    steps = tokens[:decode_steps].tolist()
    pos = [n]

    def decode() -> None:
        for tok in steps:
            model(torch.tensor([tok], device=device), cache, pos[0])
            pos[0] += 1

    decode_s, _ = best_of(decode, max(1, repeats // 2), device)
    return {"prefill_s": best, "prefill_median_s": median, "decode_s_per_token": decode_s / decode_steps}


# ---------------------------------------------------------------------- phase profile


class PhaseTimer:
    """Wraps the engine's layer methods on one model instance to attribute wall time to phases.

    Nested calls are subtracted so phases do not overlap: encoder attention excludes the
    indexer and the compressor it calls. Timing syncs CUDA at every boundary (slower, but
    attributable).
    """

    def __init__(self, engine: CEDEngine) -> None:
        self.engine, self.acc = engine, collections.defaultdict(float)
        decoder = set(engine.config.decoder_layer_ids)
        for layer_id, block in enumerate(engine.model.blocks):
            if layer_id in decoder:
                self._wrap(block, "forward", "decoder tail (all of it)")
                continue
            self._wrap(block.ffn, "forward", "encoder FFN")
            self._wrap(block.attn, "forward", "encoder attention")
            self._wrap(block.attn, "_select", "indexer scores + top-k", parent="encoder attention")
            if block.attn.indexer is not None:
                self._wrap(block.attn.indexer, "queries", "indexer scores + top-k", parent="encoder attention")
            if block.attn.compressor is not None:
                self._wrap(block.attn.compressor, "publish", "compressor + FP4 quantize", parent="encoder attention")

    def _wrap(self, obj: object, name: str, phase: str, parent: str | None = None) -> None:
        inner, acc, device = getattr(obj, name), self.acc, self.engine.device

        def timed(*args, **kwargs):
            sync(device)
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            sync(device)
            dt = time.perf_counter() - t0
            acc[phase] += dt
            if parent is not None:
                acc[parent] -= dt
            return out

        setattr(obj, name, timed)

    def profile(self, tokens: torch.Tensor, repeats: int) -> tuple[float, dict[str, float]]:
        best_total, best = float("inf"), {}
        for _ in range(repeats):
            self.acc.clear()
            sync(self.engine.device)
            t0 = time.perf_counter()
            self.engine.prefill([self.engine.new_state()], [tokens])
            sync(self.engine.device)
            total = time.perf_counter() - t0
            if total < best_total:
                best_total, best = total, dict(self.acc)
        best["other (embedding, q/out proj. outside phases, head, glue)"] = best_total - sum(best.values())
        return best_total, best


# ---------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1K/4K only, fewer repeats")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = get_preset(args.preset)
    lengths = [1024, 4096] if args.quick else [1024, 4096, 8192]
    repeats, decode_steps = (3, 8) if args.quick else (5, 16)
    load_before = os.getloadavg()

    torch.manual_seed(0)
    engine = CEDEngine(config, seed=0, device=device, dtype=dtype)
    dense = DenseLM(config, device, dtype).eval()
    rows = []
    for n in lengths:
        tokens = torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        for name, result in (("ced", measure_ced(engine, tokens, decode_steps, repeats)),
                             ("dense", measure_dense(dense, tokens.to(device), decode_steps, repeats, device))):
            rows.append({"model": name, "preset": config.name, "tokens": n, "prefill_s": result["prefill_s"],
                         "prefill_median_s": result["prefill_median_s"], "prefill_tok_s": n / result["prefill_s"],
                         "decode_tok_s": 1 / result["decode_s_per_token"],
                         "decode_ms_per_token": 1e3 * result["decode_s_per_token"]})
        ced, ref = rows[-2], rows[-1]
        ced["prefill_vs_dense"] = ref["prefill_s"] / ced["prefill_s"]
        ced["decode_vs_dense"] = ced["decode_tok_s"] / ref["decode_tok_s"]
    print(f"engine: {config.name} {args.dtype} on {device} ({args.threads} threads), "
          f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print_table(rows, ["model", "tokens", "prefill_s", "prefill_median_s", "prefill_tok_s", "decode_tok_s",
                       "decode_ms_per_token", "prefill_vs_dense", "decode_vs_dense"])

    profile_tokens = torch.randint(0, config.vocab_size, (4096,), generator=torch.Generator().manual_seed(4096))
    del dense
    total, phases = PhaseTimer(engine).profile(profile_tokens, repeats)  # wraps this engine's layers
    print(f"\n4K prefill by phase (best of {repeats}, {total:.3f} s with timing syncs):")
    print_table([{"phase": k, "seconds": v, "share": v / total} for k, v in phases.items()],
                ["phase", "seconds", "share"])

    floors = {}
    prefill_4k = next(r["prefill_s"] for r in rows if r["model"] == "ced" and r["tokens"] == 4096)
    if config.name == "tiny" and device.type == "cpu" and dtype == torch.float32:
        floors["tiny_prefill_4k_s"] = Floor(prefill_4k, FLOOR_PREFILL_4K_S, higher_is_better=False)
        print_floors(floors)
    params = {"preset": config.name, "dtype": args.dtype, "threads": args.threads, "lengths": lengths,
              "repeats": repeats, "decode_steps": decode_steps, "quick": args.quick,
              "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0],
              "phases_4k_s": phases, "config": config.to_dict()}
    name = "engine" if config.name == "tiny" else f"engine_{config.name}"
    path = write_results(name, device=args.device, params=params, rows=rows, floors=floors)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
