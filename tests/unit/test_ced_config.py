"""CEDConfig: presets, derived schedule and sizes, and one ValueError per violated rule."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine_adapter.ced import CEDEngine, LayerMode, mini, tiny, v41
from engine_adapter.ced.config import get_preset


def test_global_bytes_per_token_of_the_presets() -> None:
    assert mini().global_bytes_per_token == 159
    assert tiny().global_bytes_per_token == 212
    assert v41().global_bytes_per_token == 890
    assert (v41().main_row_bytes, v41().index_row_bytes) == (288, 68)


def test_v41_bytes_from_a_meta_engine_without_weights() -> None:
    engine = CEDEngine(v41(), device="meta", dtype=torch.bfloat16)
    assert next(engine.model.parameters()).is_meta
    assert engine.config.global_bytes_per_token == 890
    assert engine.config.swa_bytes_per_sequence == 40 * 128 * 528  # 2.58 MiB
    params = sum(p.numel() for p in engine.model.parameters())
    assert 15.5e9 < params < 17.5e9  # about 33 GB in bf16 (ENGINE.md §5)


def test_v41_layer_modes_match_the_spec_table() -> None:
    c = v41()
    modes = c.layer_modes
    assert [i for i, m in enumerate(modes) if m is LayerMode.WINDOW] == [0, 1]
    assert [i for i, m in enumerate(modes) if m is LayerMode.FULL] == [2, 8, 14, 20]
    assert [i for i, m in enumerate(modes) if m is LayerMode.REINDEX] == [24, 28, 32, 36]
    assert sum(m is LayerMode.REUSE for m in modes) == 40 - 2 - 4 - 4
    assert c.encoder_layer_ids == tuple(range(21))
    assert c.decoder_layer_ids == tuple(range(21, 40))


def test_sources_of_each_layer() -> None:
    c = mini()  # ratios [0,0,2,2,1,1,1,1], sources [2,4], index sources [2,4,6]
    assert [c.kv_source_of(i) for i in range(8)] == [None, None, 2, 2, 4, 4, 4, 4]
    assert [c.index_source_of(i) for i in range(8)] == [None, None, 2, 2, 4, 4, 6, 6]
    assert [m.name for m in c.layer_modes] == ["WINDOW", "WINDOW", "FULL", "REUSE", "FULL", "REUSE", "REINDEX", "REUSE"]


def test_to_dict_is_stable_json() -> None:
    a, b = json.dumps(tiny().to_dict()), json.dumps(get_preset("tiny").to_dict())
    assert a == b
    assert json.loads(a)["compress_ratios"] == [0, 0] + [2] * 6 + [1] * 8
    assert list(tiny().to_dict())[:3] == ["name", "n_layers", "compress_ratios"]


def test_lists_are_frozen_to_tuples() -> None:
    c = dataclasses.replace(mini(), kv_source_layer_ids=[2, 4])
    assert c.kv_source_layer_ids == (2, 4)
    hash(c)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(compress_ratios=(0, 0, 2, 2, 1, 1, 1)), "compress_ratios: length must equal n_layers=8"),
        (dict(index_source_layer_ids=(4, 6)),
         "every KV source is an index source (missing from index_source_layer_ids: [2])"),
        (dict(compress_ratios=(0, 0, 0, 0, 1, 1, 1, 1)), "kv sources have ratio > 0"),
        (dict(index_source_layer_ids=(1, 2, 4, 6)), "a WINDOW layer (ratio 0) owns nothing"),
        (dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1)), "the first layer with ratio > 0 must be a source"),
        (dict(compress_ratios=(0, 0, 2, 1, 1, 1, 1, 1)),
         "a consumer reads the KV of the most recent source at or below it, with the same ratio"),
        (dict(index_topk=17),
         "pool size candidate_topk_blocks * candidate_block_size = 16 must be >= index_topk = 17"),
        (dict(candidate_source_layer_id=3), "the candidate source must be a FULL layer (a KV source)"),
        (dict(candidate_source_layer_id=2, index_source_layer_ids=(2, 4)),
         "the candidate source must be the last KV source"),
        (dict(index_source_layer_ids=(2, 3, 4, 6)),
         "a REINDEX layer restricts itself to the candidate pool, so it must lie above the candidate "
         "source 4: [3]"),
        (dict(d_rope=15), "d_rope: rope dims must be even"),
        (dict(d_rope=130), "d_rope: rope dims must be even and in (0, d_latent=128]"),
        (dict(index_rope=66), "index_rope: rope dims must be even and in (0, index_dim=64]"),
        (dict(d_latent=120), "d_latent: must be a multiple of 16"),
        (dict(index_dim=48), "index_dim: must be a multiple of 32"),
        (dict(o_groups=3), "o_groups: must divide n_heads=2"),
        (dict(kv_source_layer_ids=(4, 2)), "kv_source_layer_ids: layer ids must be strictly increasing"),
        (dict(index_source_layer_ids=(2, 4, 8)), "index_source_layer_ids: layer ids must lie in [0, n_layers=8)"),
        (dict(sliding_window=0), "sliding_window: must be positive"),
    ],
)
def test_each_rule_names_itself(changes: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        dataclasses.replace(mini(), **changes)
    assert message in str(err.value)
