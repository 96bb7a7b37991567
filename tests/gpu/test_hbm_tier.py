"""The hbm tier on CUDA: async loads through pinned staging, byte-exact pages, and the GPU
resume path (pages -> engine state) equal to the bytes import."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine_adapter.ced import CEDEngine, get_preset, transfer
from tiers.hbm import HbmTier
from tiers.record import FINGERPRINT_BYTES, KEY_BYTES, TENANT_BYTES, make_record

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GLOBAL, INDEX = 1, 2


def _record(kind: int, payload: bytes, key: int, start: int = 0, end: int = 0):
    return make_record(kind, 0, payload, model_fingerprint=b"f" * FINGERPRINT_BYTES, tenant_id=b"t" * TENANT_BYTES,
                       block_key=key.to_bytes(KEY_BYTES, "big"), token_start=start, token_end=end)


def test_async_load_many_chunks_byte_exact() -> None:
    g = torch.Generator().manual_seed(0)
    tier = HbmTier({GLOBAL: 4096, INDEX: 1000}, {GLOBAL: 64, INDEX: 64}, staging_bytes=3 * 4096 + 100)
    recs = [_record(GLOBAL if i % 2 else INDEX, torch.randint(0, 256, (4096 if i % 2 else 999,), generator=g,
                                                             dtype=torch.uint8).numpy().tobytes(), i)
            for i in range(100)]
    events = tier.load(recs)
    assert all(isinstance(e, torch.cuda.Event) for e in events)
    torch.cuda.current_stream().wait_event(events[-1])
    for r in recs:
        assert bytes(tier.payload_tensor(r.key).cpu().numpy()) == r.payload
        assert asyncio.run(tier.get(r.key)).payload == r.payload
    assert tier.usage().by_kind[GLOBAL].num_records == 50


def test_gpu_resume_path_equals_bytes_import() -> None:
    config = get_preset("mini")
    engine = CEDEngine(config, seed=3, device="cuda", dtype=torch.float32)
    tokens = torch.randint(0, config.vocab_size, (128,), generator=torch.Generator().manual_seed(4)).tolist()
    live = engine.new_state()
    engine.prefill([live], [tokens])
    block, mains, indexes = 32, [], []
    by_bytes = engine.new_state()
    for i, b0 in enumerate(range(0, 128, block)):
        sl = engine.export_global(live, b0, b0 + block)
        engine.import_global(by_bytes, b0, b0 + block, sl)
        mains.append(_record(GLOBAL, sl.main_payload, i, b0, b0 + block))
        indexes.append(_record(INDEX, sl.index_payload, i, b0, b0 + block))
    tier = HbmTier({GLOBAL: len(mains[0].payload), INDEX: len(indexes[0].payload)}, {GLOBAL: 4, INDEX: 4},
                   staging_bytes=2 * len(mains[0].payload))
    events = tier.load(mains + indexes, checksums=False)
    for e in events:
        torch.cuda.current_stream().wait_event(e)
    main_rows = transfer.split_block_rows(config, tier.pools[GLOBAL].tensor, block, config.main_row_bytes)
    index_rows = transfer.split_block_rows(config, tier.pools[INDEX].tensor, block, config.index_row_bytes)
    by_rows = engine.new_state()
    transfer.import_global_rows(config, by_rows, 0, 128, main_rows, index_rows, engine.dtype)
    for sid in config.kv_source_layer_ids:
        for name in ("main_codes", "main_scales", "index_codes", "index_scales", "main_values", "index_values"):
            assert torch.equal(getattr(by_bytes.sources[sid], name).view(), getattr(by_rows.sources[sid], name).view())
