"""Device-side import of global state (the GPU resume path) equals the bytes import, on the CPU."""

from __future__ import annotations

import torch

from engine_adapter.ced import CEDEngine, get_preset, transfer


def test_rows_from_block_pages_import_like_bytes() -> None:
    config = get_preset("mini")
    engine = CEDEngine(config, seed=1)
    tokens = torch.randint(0, config.vocab_size, (96,), generator=torch.Generator().manual_seed(2)).tolist()
    live = engine.new_state()
    engine.prefill([live], [tokens])
    block = 32
    by_bytes, by_rows = engine.new_state(), engine.new_state()
    mains, indexes = [], []
    for b0 in range(0, 96, block):
        sl = engine.export_global(live, b0, b0 + block)
        engine.import_global(by_bytes, b0, b0 + block, sl)
        mains.append(torch.frombuffer(bytearray(sl.main_payload), dtype=torch.uint8))
        indexes.append(torch.frombuffer(bytearray(sl.index_payload), dtype=torch.uint8))
    pad = 7  # pages may be longer than the payload (padding)
    main_pages = torch.nn.functional.pad(torch.stack(mains), (0, pad))
    index_pages = torch.stack(indexes)
    main_rows = transfer.split_block_rows(config, main_pages, block, config.main_row_bytes)
    index_rows = transfer.split_block_rows(config, index_pages, block, config.index_row_bytes)
    transfer.import_global_rows(config, by_rows, 0, 96, main_rows, index_rows, engine.dtype)
    for sid in config.kv_source_layer_ids:
        a, b = by_bytes.sources[sid], by_rows.sources[sid]
        for name in ("main_codes", "main_scales", "index_codes", "index_scales", "main_values", "index_values"):
            assert torch.equal(getattr(a, name).view(), getattr(b, name).view()), (sid, name)
