"""Replay (ENGINE.md §4): row plans, exact replay == full recompute, bounded replay's divergence.

All on `mini` in float64 (8 layers, W = 8, decoder = layers 5..7): a full recompute and an exact
replay agree to ~1e-15, and one row too few already moves the logits by far more than 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from engine_adapter.ced import CEDEngine, RowPlan, exact_replay_rows, mini, tiny, v41
from engine_adapter.ced.plan import prefill_plan, replay_rows

EXACT = 1e-9


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: a second thread only waits for its scheduler slice on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine() -> CEDEngine:
    return CEDEngine(mini(), seed=0, dtype=torch.float64)


def make_tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def full_state(engine: CEDEngine, tokens: torch.Tensor):
    """Every layer on every row (decoder_rows = T): the full-recompute baseline, rings included."""
    state = engine.new_state()
    engine.prefill([state], [tokens], decoder_rows=len(tokens))
    return state


def persisted(engine: CEDEngine, source, end: int):
    """A fresh state holding only the global entries of tokens [0, end) of `source`."""
    state = engine.new_state()
    engine.import_global(state, 0, end, engine.export_global(source, 0, end))
    return state


def assert_rings_close(a, b, atol: float = EXACT) -> None:
    for layer_id, (ra, rb) in enumerate(zip(a.rings, b.rings)):
        assert (ra.start, ra.end) == (rb.start, rb.end), layer_id
        torch.testing.assert_close(ra.view(), rb.view(), rtol=0, atol=atol, msg=f"ring of layer {layer_id}")


# ---------------------------------------------------------------------- plans (pure)


def test_row_counts_of_the_spec() -> None:
    c = v41()
    assert exact_replay_rows(19, 128) == 2414 and exact_replay_rows(40, 128) == 5081
    stack = replay_rows(c, "exact", 10_000, published_tokens=10_000)
    assert stack.layer_rows[0] == 5081 and stack.layer_rows[-1] == 128
    tail = replay_rows(c, "exact", 10_000, first_layer=21)
    assert tail.layer_rows[:21] == (10_000,) * 21 and tail.layer_rows[21] == 2414
    assert sum(tail.output_rows(i) for i in c.decoder_layer_ids) == 19 + 127 * 19 * 18 // 2
    assert replay_rows(c, "bounded", 10_000, published_tokens=10_000, slack=5).layer_rows == (133,) * 40
    assert replay_rows(c, "off", 10_000).layer_rows == (10_000,) * 40


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(mode="exact", num_tokens=100), (57, 50, 43, 36, 29, 22, 15, 8)),
        (dict(mode="exact", num_tokens=40), (40, 40, 40, 36, 29, 22, 15, 8)),  # clamped to the sequence
        # 45 unpublished tokens: every source reads them, with a W-1 lead-in per layer below
        (dict(mode="exact", num_tokens=95, published_tokens=50), (73, 66, 59, 52, 45, 22, 15, 8)),
        (dict(mode="bounded", num_tokens=100, published_tokens=99), (8,) * 8),
        (dict(mode="bounded", num_tokens=100, published_tokens=60), (40,) * 5 + (8,) * 3),
        (dict(mode="bounded", num_tokens=100, bounded_rows=12, first_layer=5), (100,) * 5 + (12,) * 3),
        (dict(mode="off", num_tokens=30), (30,) * 8),
        (dict(mode="exact", num_tokens=100, num_rows=10, first_layer=5), (10,) * 7 + (8,)),  # a short chunk
    ],
)
def test_replay_rows_table(kwargs: dict, expected: tuple[int, ...]) -> None:
    assert replay_rows(mini(), **kwargs).layer_rows == expected


def test_prefill_plan_is_the_decoder_staircase() -> None:
    c = tiny()  # 7 decoder layers, W = 128
    plan = prefill_plan(c, 4096, 4096)
    assert plan.layer_rows[:9] == (4096,) * 9
    assert plan.layer_rows[9:] == tuple(1 + (7 - j) * 127 for j in range(7))
    assert sum(plan.output_rows(i) for i in c.decoder_layer_ids) == 7 + 127 * 7 * 6 // 2


# ---------------------------------------------------------------------- exact replay


def test_exact_decoder_tail_replay_equals_full_recompute_and_one_row_less_does_not(engine: CEDEngine) -> None:
    tokens = make_tokens(48, seed=1)
    full = full_state(engine, tokens)
    torch.testing.assert_close(full.last_logits, engine.reference_logits(tokens)[-1], rtol=0, atol=EXACT)
    layers, window = len(engine.config.decoder_layer_ids), engine.config.sliding_window
    r = layers * (window - 1) + 1  # 22
    encoder = (48,) * len(engine.config.encoder_layer_ids)

    state = persisted(engine, full, 48)
    logits = engine.replay(state, tokens, RowPlan(encoder + (r,) * layers))
    torch.testing.assert_close(logits, full.last_logits, rtol=0, atol=EXACT)
    assert_rings_close(state, full)
    assert state.is_live()

    short = persisted(engine, full, 48)
    off = engine.replay(short, tokens, RowPlan(encoder + (r - 1,) * layers))
    delta = (off - full.last_logits).abs().max().item()
    print(f"\nR = {r - 1} (one row short): max |dlogit| = {delta:.3e}")
    assert delta > 1e-6


def test_exact_replay_of_the_whole_stack_from_tokens(engine: CEDEngine) -> None:
    tokens = make_tokens(96, seed=2)
    full = full_state(engine, tokens)
    plan = replay_rows(engine.config, "exact", 96, published_tokens=96)
    assert plan.token_rows == 1 + 8 * 7
    state = persisted(engine, full, 96)
    logits = engine.replay(state, tokens, plan)
    torch.testing.assert_close(logits, full.last_logits, rtol=0, atol=EXACT)
    assert_rings_close(state, full)
    for token in (3, 250, 17):  # and decoding continues as if never interrupted
        torch.testing.assert_close(engine.decode_step([state], [token])[0], engine.decode_step([full], [token])[0],
                                   rtol=0, atol=EXACT)


@pytest.mark.parametrize("published", [50, 80, 94])
def test_replay_publishes_only_tokens_past_the_persisted_range(engine: CEDEngine, published: int) -> None:
    tokens = make_tokens(95, seed=3)  # odd: the ratio-2 source ends with a one-row tail
    full = full_state(engine, tokens)
    state = persisted(engine, full, published)
    before = engine.export_global(state, 0, published)
    plan = replay_rows(engine.config, "exact", 95, published_tokens=published)
    logits = engine.replay(state, tokens, plan)
    torch.testing.assert_close(logits, full.last_logits, rtol=0, atol=EXACT)
    assert engine.export_global(state, 0, published) == before  # never rewritten
    assert engine.export_global(state, 0, 95) == engine.export_global(full, 0, 95)  # new entries exact
    for sid in (2,):  # the ratio-2 source's tail, rebuilt from the replayed rows
        torch.testing.assert_close(state.sources[sid].tail_kv, full.sources[sid].tail_kv, rtol=0, atol=EXACT)
        torch.testing.assert_close(state.sources[sid].tail_gate, full.sources[sid].tail_gate, rtol=0, atol=EXACT)
    assert_rings_close(state, full)


def test_replay_keeps_persisted_entries_even_when_they_differ(engine: CEDEngine) -> None:
    """Global reads use the persisted entries as they are: replay never recomputes them."""
    tokens, other = make_tokens(40, seed=4), make_tokens(40, seed=5)
    foreign = full_state(engine, other)
    state = persisted(engine, foreign, 40)
    engine.replay(state, tokens, replay_rows(engine.config, "exact", 40, published_tokens=40))
    assert engine.export_global(state, 0, 40) == engine.export_global(foreign, 0, 40)


def test_replay_checks_its_plan(engine: CEDEngine) -> None:
    tokens = make_tokens(60, seed=6)
    full = full_state(engine, tokens)
    state = persisted(engine, full, 40)
    with pytest.raises(ValueError, match=r"reads rows from 41, but its entries end at 40"):
        engine.replay(state, tokens, RowPlan((19,) * 8))
    with pytest.raises(ValueError, match="the plan has 3 layers"):
        engine.replay(state, tokens, RowPlan((60, 60, 60)))
    with pytest.raises(ValueError, match="not live"):
        engine.decode_step([persisted(engine, full, 40)], [1])


# ---------------------------------------------------------------------- bounded replay


def test_bounded_replay_diverges_and_by_how_much(engine: CEDEngine) -> None:
    """V4.1 replays W (+ slack) rows: cheap, not exact. Measured against the exact replay."""
    c, w = engine.config, engine.config.sliding_window
    sequences = [make_tokens(96, seed=100 + seed) for seed in range(6)]
    fulls = [full_state(engine, tokens) for tokens in sequences]
    exact = [engine.replay(persisted(engine, f, 96), t, replay_rows(c, "exact", 96, published_tokens=96))
             for t, f in zip(sequences, fulls)]
    print()
    worst = {}
    for rows in (w, 2 * w, 4 * w):
        deltas, agree, kls = [], 0, []
        for tokens, full, ref in zip(sequences, fulls, exact):
            plan = replay_rows(c, "bounded", 96, published_tokens=96, bounded_rows=rows)
            got = engine.replay(persisted(engine, full, 96), tokens, plan)
            deltas.append((got - ref).abs().max().item())
            agree += int(got.argmax() == ref.argmax())
            kls.append(torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                                  reduction="sum").item())
        worst[rows] = max(deltas)
        print(f"bounded R = {rows:2d} (W = {w}, whole stack) vs exact, 6 sequences: max |dlogit| = {max(deltas):.3e}, "
              f"top-1 agreement = {agree}/6, mean KL = {sum(kls) / len(kls):.3e}")
    assert worst[w] > 1e-6  # not exact by design
    assert worst[4 * w] < worst[w]
