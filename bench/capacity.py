"""Concurrent capacity in a fixed memory budget: per-kind pools vs one page size for all kinds.

    python -m bench.capacity [--quick] [--budget-gib 64]

For each state shape and context length, the number of sequences whose state fits the
budget, filled through the real allocators (`tiers.pools`, accounting-only: no memory is
touched), against the byte-arithmetic bound (budget / exact bytes per sequence):

- ours: `PerKindPools`, pages sized per kind (one block of B=256 tokens of a per-token
  kind, one sequence of a per-sequence kind), every record paying its header and index
  entry;
- single page: `SinglePagePool` with vLLM's hybrid layout (`uniform_page_layout`): one page
  size (the largest state, per-token kinds' block size raised to fill it), every record
  padded to whole pages.

Then the FP8-vs-BF16 capacity gain of a Mamba/GDN hybrid under both allocators, next to
the figures vLLM RFC #55196 measured (2.00x attention-only; 1.84x at 32K and 1.00x at
short context on hybrids). Floor: ours / bound >= 0.97 at every length, every shape.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import Floor, print_floors, print_table, write_results
from engine_adapter.base import Codec, Retention, StateKind, StateSpec
from statestore.store import make_page_sizes
from tiers.pools import PerKindPools, PoolSet, SinglePagePool, uniform_page_layout

BLOCK_SIZE = 256
CONTEXTS = (1 << 10, 4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10)
FLOOR_OURS_OVER_BOUND = 0.97
VLLM_ALIGN_TOKENS = 16  # vLLM's attention block sizes are multiples of 16
RFC_55196 = {"attention_only": 2.00, "hybrid_32k": 1.84, "hybrid_short": 1.00}


@dataclass(frozen=True, slots=True)
class Shape:
    """The state one sequence keeps, as the engine's specs describe it."""

    name: str
    specs: tuple[StateSpec, ...]
    note: str

    def exact_bytes(self, num_tokens: int) -> int:
        return sum(s.bytes_for_tokens(num_tokens) for s in self.specs)


def v41_shape() -> Shape:
    """DeepSeek-V4.1 CED/CSA2: 2.5 global entries per token (3 ratio-2 sources + 1 ratio-1),
    each 288 B of FP4 main KV and 68 B of FP4 index keys, as two kinds; 40 SWA rings."""
    entries = 3 * 0.5 + 1
    return Shape("v41-fp4", (
        StateSpec(StateKind.GLOBAL_KV, Retention.MUST_KEEP, Codec.E2M1_E4M3_16, bytes_per_token=entries * 288),
        StateSpec(StateKind.INDEX_K, Retention.MUST_KEEP, Codec.E2M1_E8M0_32, bytes_per_token=entries * 68),
        StateSpec(StateKind.SWA_RING, Retention.REBUILDABLE, Codec.FP8_E4M3_E8M0_32,
                  bytes_per_sequence=40 * 128 * 528),
    ), "890 B/token global + 2,703,360 B SWA rings per sequence")


# Qwen3-Next-80B-A3B-like hybrid: 48 layers = 36 Gated DeltaNet + 12 full attention.
GDN_LAYERS, ATTN_LAYERS = 36, 12
GDN_STATE_BYTES = GDN_LAYERS * (32 * 128 * 128 + 3 * 8192) * 2  # bf16 ssm state + conv state
ATTN_KV_ELEMS_PER_TOKEN = ATTN_LAYERS * 2 * 2 * 256  # K and V, 2 KV heads x 256 dims


def hybrid_shape(kv_bytes: int, *, recurrent: bool = True) -> Shape:
    dtype = {1: "fp8", 2: "bf16"}[kv_bytes]
    kv = StateSpec(StateKind.GLOBAL_KV, Retention.MUST_KEEP, Codec.BF16 if kv_bytes == 2 else Codec.RAW,
                   bytes_per_token=ATTN_KV_ELEMS_PER_TOKEN * kv_bytes, name=f"attention KV {dtype}")
    if not recurrent:
        return Shape(f"attn-only-{dtype}", (kv,), f"{ATTN_KV_ELEMS_PER_TOKEN * kv_bytes:,} B/token attention KV")
    state = StateSpec(StateKind.OPAQUE, Retention.MUST_KEEP, Codec.BF16, bytes_per_sequence=GDN_STATE_BYTES,
                      name="GDN recurrent state bf16")
    return Shape(f"hybrid-{dtype}", (kv, state),
                 f"{ATTN_KV_ELEMS_PER_TOKEN * kv_bytes:,} B/token KV + {GDN_STATE_BYTES:,} B GDN state")


ALL_SHAPES = (v41_shape, lambda: hybrid_shape(2), lambda: hybrid_shape(1),
              lambda: hybrid_shape(2, recurrent=False), lambda: hybrid_shape(1, recurrent=False))

# ----- one sequence's records under each allocator -------------------------------------------

Plan = list[tuple[int, int, int]]  # (kind, payload bytes, number of records)


def _token_records(kind: int, bytes_per_token: float, num_tokens: int, tokens_per_record: int) -> Plan:
    full, tail = divmod(num_tokens, tokens_per_record)
    plan = [(kind, int(bytes_per_token * tokens_per_record), full)] if full else []
    if tail:
        plan.append((kind, int(round(bytes_per_token * tail)), 1))  # the tail record, padded to pages
    return plan


def per_kind_plan(shape: Shape, num_tokens: int) -> Plan:
    """Our store: B-token block records per per-token kind, one record per per-sequence kind."""
    plan: Plan = []
    for s in shape.specs:
        if s.per_token:
            plan += _token_records(int(s.kind), s.bytes_per_token, num_tokens, BLOCK_SIZE)
        else:
            plan.append((int(s.kind), s.bytes_per_sequence, 1))
    return plan


def fill(pools: PoolSet, plan: Plan, first_batch: int = 256) -> int:
    """Sequences admitted until the budget refuses a single one.

    Sequences are admitted in batches (all or nothing; a refused batch is rolled back and
    halved, down to one sequence): the same allocator calls as one at a time, in fewer steps.
    """
    n, batch = 0, first_batch
    while batch:
        if _admit(pools, plan, batch):
            n += batch
        else:
            batch //= 2
    return n


def _admit(pools: PoolSet, plan: Plan, num_seqs: int) -> bool:
    taken = []
    for kind, nbytes, count in plan:
        bulk = pools.reserve_many(kind, nbytes, count * num_seqs)
        if bulk is None:
            for done in taken:
                pools.release(done)
            return False
        taken.append(bulk)
    return True


def fit_per_kind(shape: Shape, num_tokens: int, budget_bytes: int) -> int:
    pools = PerKindPools(budget_bytes, make_page_sizes(shape.specs, BLOCK_SIZE), materialize=False)
    return fill(pools, per_kind_plan(shape, num_tokens))


def fit_single_page(shape: Shape, num_tokens: int, budget_bytes: int) -> tuple[int, int]:
    """vLLM's uniform page: returns (sequences, page bytes)."""
    per_token = {int(s.kind): s.bytes_per_token for s in shape.specs if s.per_token}
    per_seq = {int(s.kind): s.bytes_per_sequence for s in shape.specs if not s.per_token}
    layout = uniform_page_layout(per_token, per_seq, align_tokens=VLLM_ALIGN_TOKENS)
    plan: Plan = []
    for kind, bpt in per_token.items():
        plan += _token_records(kind, bpt, num_tokens, layout.tokens_per_page[kind])
    plan += [(kind, nbytes, 1) for kind, nbytes in per_seq.items()]
    pools = SinglePagePool(budget_bytes, layout.page_bytes, materialize=False)
    return fill(pools, plan), layout.page_bytes


# ----- the tables ------------------------------------------------------------------------------

def capacity_rows(budget_bytes: int, contexts: Sequence[int] = CONTEXTS) -> list[dict[str, Any]]:
    rows = []
    for make in ALL_SHAPES:
        shape = make()
        for t in contexts:
            exact = shape.exact_bytes(t)
            bound = budget_bytes / exact
            ours = fit_per_kind(shape, t, budget_bytes)
            single, page = fit_single_page(shape, t, budget_bytes)
            rows.append({"table": "capacity", "shape": shape.name, "context": t, "bytes_per_seq": exact,
                         "bound": round(bound, 2), "ours": ours, "ours_over_bound": round(ours / bound, 4),
                         "single_page": single, "single_over_bound": round(single / bound, 4),
                         "single_page_bytes": page})
    return rows


def gain_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """FP8-vs-BF16 capacity gain per context, for the hybrid and its attention-only twin."""
    by = {(r["shape"], r["context"]): r for r in rows}
    out = []
    for family in ("hybrid", "attn-only"):
        for t in sorted({r["context"] for r in rows}):
            fp8, bf16 = by[(f"{family}-fp8", t)], by[(f"{family}-bf16", t)]
            rfc = _rfc_figure(family, t)
            out.append({"table": "fp8_gain", "shape": family, "context": t,
                        "bound_gain": round(fp8["bound"] / bf16["bound"], 3),
                        "ours_gain": round(fp8["ours"] / bf16["ours"], 3),
                        "single_page_gain": round(fp8["single_page"] / bf16["single_page"], 3),
                        "rfc_55196_vllm": rfc if rfc is not None else ""})
    return out


def _rfc_figure(family: str, context: int) -> float | None:
    if family == "attn-only":
        return RFC_55196["attention_only"]
    return {1 << 10: RFC_55196["hybrid_short"], 32 << 10: RFC_55196["hybrid_32k"]}.get(context)


def floors(rows: Sequence[dict[str, Any]]) -> dict[str, Floor]:
    return {f"ours_over_bound/{r['shape']}@{r['context'] // 1024}K": Floor(r["ours_over_bound"], FLOOR_OURS_OVER_BOUND)
            for r in rows if r["table"] == "capacity"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 16 GiB budget instead of 64 GiB")
    parser.add_argument("--budget-gib", type=float, default=None)
    args = parser.parse_args(argv)
    budget_gib = args.budget_gib or (16 if args.quick else 64)
    budget = int(budget_gib * (1 << 30))
    started = time.perf_counter()
    rows = capacity_rows(budget)
    gains = gain_rows(rows)
    fl = floors(rows)
    print(f"capacity in a {budget_gib:g} GiB budget (B = {BLOCK_SIZE}; sequences that fit)")
    print_table(rows, ["shape", "context", "bytes_per_seq", "bound", "ours", "ours_over_bound",
                       "single_page", "single_over_bound", "single_page_bytes"])
    print("\nFP8 vs BF16 capacity gain (hybrid = 36 GDN + 12 attention layers; attn-only = its attention alone)")
    print_table(gains, ["shape", "context", "bound_gain", "ours_gain", "single_page_gain", "rfc_55196_vllm"])
    print()
    print_floors(fl)
    path = write_results("capacity", device="cpu", rows=rows + gains, floors=fl, params={
        "budget_bytes": budget, "block_size": BLOCK_SIZE, "contexts": list(CONTEXTS),
        "vllm_align_tokens": VLLM_ALIGN_TOKENS, "rfc_55196": RFC_55196,
        "shapes": {make().name: make().note for make in ALL_SHAPES}})
    print(f"\nwrote {path} in {time.perf_counter() - started:.1f} s")
    return 0 if all(f.ok for f in fl.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
