"""The CED engine: bytes per token, causality, prefill/decode agreement, selection rules, transfer.

Exactness is checked on `mini` in float64, where two computations of the same function agree to
~1e-15 and a real difference (a different window, a different selected entry) is >> 1e-9.
"""

from __future__ import annotations

import pytest
import torch

from engine_adapter.ced import CEDEngine, RowPlan, mini, tiny
from engine_adapter.ced.context import StepContext
from engine_adapter.ced.indexer import candidate_pool, pool_mask, select_topk

EXACT = 1e-9


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors gain nothing from a second thread, and on a shared 2-core machine every
    parallel region can wait a whole scheduler slice for it; restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_tokens(n: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def engine() -> CEDEngine:
    return CEDEngine(mini(), seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def engine32() -> CEDEngine:
    return CEDEngine(mini(), seed=0, dtype=torch.float32)


def prefilled(engine: CEDEngine, tokens: torch.Tensor, **kw):
    state = engine.new_state()
    engine.prefill([state], [tokens], **kw)
    return state


# ---------------------------------------------------------------------- sizes


def test_global_bytes_per_token_measured_from_exports_mini(engine: CEDEngine) -> None:
    state = prefilled(engine, make_tokens(64))
    exported = engine.export_global(state, 0, 64)
    assert exported.nbytes / 64 == 159
    assert len(exported.main_payload) == 32 * 72 + 64 * 72  # ratio-2 source + ratio-1 source, 72 B rows
    assert len(exported.index_payload) == 32 * 34 + 64 * 34
    sizes = engine.state_bytes(state)
    assert sizes["global_kv"] + sizes["index_k"] == exported.nbytes
    assert sizes["tokens"] == 4 * 64 and sizes["compressor_tail"] == 0
    assert sizes["swa_ring"] == 8 * 8 * 128 * 8  # layers x W x D x float64


def test_tiny_smoke_bytes_and_generate() -> None:
    eng = CEDEngine(tiny(), seed=1)
    state = prefilled(eng, make_tokens(130, vocab=8192))
    assert eng.export_global(state, 0, 130).nbytes / 130 == 212
    out = eng.generate(state, 3)
    assert len(out) == 3 and state.num_tokens == 133
    sampled = eng.generate(state, 2, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert all(0 <= t < 8192 for t in sampled)


# ---------------------------------------------------------------------- causality and agreement


@pytest.mark.parametrize("t", [0, 7, 20])
def test_changing_token_t_never_changes_anything_before_t(engine: CEDEngine, t: int) -> None:
    a = make_tokens(28, seed=3)
    b = a.clone()
    b[t] = (a[t] + 1) % 256
    la, lb = engine.reference_logits(a), engine.reference_logits(b)
    torch.testing.assert_close(la[:t], lb[:t], rtol=0, atol=EXACT)
    assert (la[t] - lb[t]).abs().max() > 1e-6
    end = t + 4  # rings then hold positions end-8 .. end-1: four of them before t
    sa, sb = prefilled(engine, a[:end], decoder_rows=end), prefilled(engine, b[:end], decoder_rows=end)
    before = end - t  # ring rows at positions >= t
    for ra, rb in zip(sa.rings, sb.rings):
        torch.testing.assert_close(ra.view()[:-before], rb.view()[:-before], rtol=0, atol=EXACT)
    for sid, src in sa.sources.items():
        n = t // src.ratio  # entries made only of tokens < t
        assert torch.equal(src.main_codes.view()[:n], sb.sources[sid].main_codes.view()[:n])
        assert torch.equal(src.index_codes.view()[:n], sb.sources[sid].index_codes.view()[:n])


@pytest.mark.parametrize("prompt", [15, 16, 31, 33])  # odd/even (ratio-2 groups); 16, 32 = pool/block edges
def test_prefill_then_decode_equals_longer_prefill(engine: CEDEngine, prompt: int) -> None:
    tokens = make_tokens(prompt + 5, seed=prompt)
    reference = engine.reference_logits(tokens)
    state = engine.new_state()
    first = engine.prefill([state], [tokens[:prompt]])[0]
    torch.testing.assert_close(first, reference[prompt - 1], rtol=0, atol=EXACT)
    for i in range(prompt, prompt + 5):
        logits = engine.decode_step([state], [int(tokens[i])])[0]
        torch.testing.assert_close(logits, reference[i], rtol=0, atol=EXACT)
    longer = prefilled(engine, tokens)
    torch.testing.assert_close(longer.last_logits, state.last_logits, rtol=0, atol=EXACT)
    for ra, rb in zip(longer.rings, state.rings):
        torch.testing.assert_close(ra.view(), rb.view(), rtol=0, atol=EXACT)


def test_prefill_then_decode_float32(engine32: CEDEngine) -> None:
    tokens = make_tokens(45, seed=9)
    reference = engine32.reference_logits(tokens)
    state = prefilled(engine32, tokens[:37])
    for i in range(37, 45):
        logits = engine32.decode_step([state], [int(tokens[i])])[0]
        torch.testing.assert_close(logits, reference[i], rtol=1e-4, atol=1e-4)


def test_query_chunks_and_attention_tiles_do_not_change_the_result(engine: CEDEngine) -> None:
    tokens = make_tokens(61, seed=8)
    odd = CEDEngine(mini(), seed=0, dtype=torch.float64, query_chunk=7, attention_tile=3)
    torch.testing.assert_close(odd.reference_logits(tokens), engine.reference_logits(tokens), rtol=0, atol=EXACT)


def test_chunked_prefill_equals_one_prefill(engine: CEDEngine) -> None:
    tokens = make_tokens(70, seed=5)
    state = engine.new_state()
    for lo, hi in [(0, 9), (9, 40), (40, 41), (41, 70)]:  # odd chunk edges split ratio-2 groups
        engine.prefill([state], [tokens[lo:hi]])
    whole = prefilled(engine, tokens)
    torch.testing.assert_close(state.last_logits, whole.last_logits, rtol=0, atol=EXACT)
    assert engine.export_global(state, 0, 70) == engine.export_global(whole, 0, 70)


def test_batch_of_different_lengths_equals_each_alone(engine: CEDEngine) -> None:
    prompts = [make_tokens(n, seed=n) for n in (5, 23, 40)]
    states = [engine.new_state() for _ in prompts]
    batch = engine.prefill(states, prompts)
    assert batch.shape == (3, 256)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(batch[i], prefilled(engine, p).last_logits, rtol=0, atol=0)
    step = engine.decode_step(states, [1, 2, 3])
    for i, p in enumerate(prompts):
        alone = prefilled(engine, p)
        torch.testing.assert_close(step[i], engine.decode_step([alone], [i + 1])[0], rtol=0, atol=0)


def test_the_staircase_does_the_specified_work(engine: CEDEngine) -> None:
    from engine_adapter.ced import prefill_plan

    c = engine.config
    plan = prefill_plan(c, 100, 100)
    decoder = c.decoder_layer_ids
    layers, w = len(decoder), c.sliding_window
    assert plan.layer_rows == (100,) * 5 + (22, 15, 8)
    assert sum(plan.output_rows(i) for i in decoder) == layers + (w - 1) * layers * (layers - 1) // 2


# ---------------------------------------------------------------------- selection rules


def test_topk_ties_go_to_the_smaller_position() -> None:
    scores = torch.tensor([[0.0, 3.0, 3.0, 0.0, 3.0, 1.0, 0.0, 0.0]])
    every = torch.ones_like(scores, dtype=torch.bool)
    assert select_topk(scores, every, 2).tolist() == [[1, 2]]
    assert select_topk(scores, every, 4).tolist() == [[1, 2, 4, 5]]
    assert select_topk(scores, every, 6).tolist() == [[0, 1, 2, 3, 4, 5]]  # ReLU zeros: leftmost win
    visible = torch.arange(8)[None, :] < 3
    assert select_topk(scores, visible, 5).tolist() == [[0, 1, 2, -1, -1]]  # unreachable slots
    many = torch.zeros(3, 50)
    assert select_topk(many, torch.ones_like(many, dtype=torch.bool), 4).tolist() == [[0, 1, 2, 3]] * 3


def test_candidate_pool_keeps_the_newest_block() -> None:
    scores = torch.tensor([[5.0, 0.0, 4.0, 0.0, 9.0, 0.0, -7.0, -7.0, -7.0, 100.0]])  # 4 blocks of 2
    pool = candidate_pool(scores, torch.tensor([7]), block_size=2, num_blocks=2)
    assert pool.tolist() == [[2, 3]]  # block 3 holds the newest entry (6); entry 9 is not visible
    pool = candidate_pool(scores, torch.tensor([9]), block_size=2, num_blocks=2)
    assert pool.tolist() == [[2, 4]]
    assert pool_mask(pool, 10, 2).tolist() == [[False] * 4 + [True] * 2 + [False] * 2 + [True] * 2]


def test_pool_and_reindex_rules_in_a_real_forward(engine: CEDEngine) -> None:
    c = engine.config
    tokens = make_tokens(90, seed=11)
    state = engine.new_state()
    state.tokens.append(tokens)
    ctx = StepContext(state=state, end=90, plan=RowPlan.full(c.n_layers, 90, 90), query_chunk=32,
                      attention_tile=16)
    with torch.inference_mode():
        engine.model(tokens, ctx)
    pool, reindex = ctx.pool, ctx.topk[6]
    positions = torch.arange(90)
    newest_block = positions // c.candidate_block_size  # ratio 1: entry t is the newest for query t
    assert (pool == newest_block[:, None]).any(dim=1).all()
    visible_blocks = positions // c.candidate_block_size + 1
    assert ((pool >= 0).sum(dim=1) == visible_blocks.clamp(max=c.candidate_topk_blocks)).all()
    chosen = reindex >= 0
    in_pool = ((reindex // c.candidate_block_size)[:, :, None] == pool[:, None, :]).any(dim=2)
    assert (in_pool | ~chosen).all()
    assert (chosen.sum(dim=1) == (positions + 1).clamp(max=c.index_topk)).all()  # pool >= top-k
    own = ctx.topk[4]  # the FULL layer selects among every visible entry
    assert ((own < positions[:, None] + 1) | (own == -1)).all()
    assert not torch.equal(own, reindex)


# ---------------------------------------------------------------------- transfer


def test_export_import_into_a_fresh_engine_then_decode(engine: CEDEngine) -> None:
    tokens = make_tokens(37, seed=4)  # odd: the ratio-2 source has a one-row tail
    a = prefilled(engine, tokens)
    other = CEDEngine(mini(), seed=0, dtype=torch.float64)
    b = other.new_state()
    other.import_tokens(b, engine.export_tokens(a))
    other.import_global(b, 0, 20, engine.export_global(a, 0, 20))  # one block, then the trailing range
    trailing = engine.export_global(a, 20, 37)  # ratio-1 source: entries 20..36; ratio-2: 10..17
    assert len(trailing.main[0]) == 8 * 72 and len(trailing.main[1]) == 17 * 72
    other.import_global(b, 20, 37, (trailing.main_payload, trailing.index_payload))
    with pytest.raises(ValueError, match="not live"):
        other.decode_step([b], [1])
    other.import_tails(b, engine.export_tails(a))
    other.import_swa(b, engine.export_swa(a))
    assert b.is_live() and other.export_global(b, 0, 37) == engine.export_global(a, 0, 37)
    for token in [5, 77, 3, 200, 9, 1]:
        la = engine.decode_step([a], [token])[0]
        lb = other.decode_step([b], [token])[0]
        assert torch.equal(la, lb)


def test_import_validates_sizes_and_order(engine: CEDEngine) -> None:
    a = prefilled(engine, make_tokens(40, seed=2))
    sl = engine.export_global(a, 0, 20)
    fresh = engine.new_state()
    with pytest.raises(ValueError, match="main payload for tokens \\[0, 20\\) must be 2160 bytes"):
        engine.import_global(fresh, 0, 20, (sl.main_payload[:-1], sl.index_payload))
    with pytest.raises(ValueError, match="entries must be imported in order"):
        engine.import_global(fresh, 20, 40, engine.export_global(a, 20, 40))
    with pytest.raises(ValueError, match="start a multiple of 2"):
        engine.export_global(a, 1, 20)
    with pytest.raises(ValueError, match="not all published"):
        engine.export_global(a, 0, 42)
    assert fresh.published_tokens == 0  # nothing half-imported
    with pytest.raises(ValueError, match="= 0 bytes expected for 0 tokens"):
        engine.import_swa(fresh, b"\0" * 8)


def test_fp8_ring_export_is_528_bytes_a_row_at_v41_width_and_close() -> None:
    eng = CEDEngine(mini(), seed=0)
    a = prefilled(eng, make_tokens(20))
    payload = eng.export_swa(a, fmt="fp8")
    assert len(payload) == 8 * 8 * (128 + 4)
    b = eng.new_state()
    eng.import_tokens(b, eng.export_tokens(a))
    eng.import_swa(b, payload, fmt="fp8")
    for ra, rb in zip(a.rings, b.rings):
        torch.testing.assert_close(ra.view(), rb.view(), rtol=0.07, atol=0.02)


def test_fp8_rings_make_the_fp8_export_lossless() -> None:
    eng = CEDEngine(mini(), seed=0, dtype=torch.float64, fp8_ring=True)
    tokens = make_tokens(30, seed=12)
    a = prefilled(eng, tokens)
    reference = eng.reference_logits(tokens)
    torch.testing.assert_close(a.last_logits, reference[-1], rtol=0, atol=EXACT)  # staircase still exact
    b = eng.new_state()
    eng.import_tokens(b, eng.export_tokens(a))
    eng.import_global(b, 0, 30, eng.export_global(a, 0, 30))
    eng.import_tails(b, eng.export_tails(a))
    eng.import_swa(b, eng.export_swa(a, fmt="fp8"), fmt="fp8")
    for ra, rb in zip(a.rings, b.rings):
        assert torch.equal(ra.view(), rb.view())
    for token in (4, 8, 15):
        assert torch.equal(eng.decode_step([a], [token])[0], eng.decode_step([b], [token])[0])
