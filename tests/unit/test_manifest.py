"""Session manifests parse from what a tier hands back: bytes, or a read-only view of its buffer."""

from __future__ import annotations

import pytest

from statestore.sessions import Manifest


def _manifest() -> Manifest:
    return Manifest(tenant="t", session_id="s", version=3, model_fingerprint="ab" * 16, block_size=256,
                    num_tokens=700, block_keys=("cd" * 32, "ef" * 32), tail_start=512, tail_end=700,
                    message_boundaries=(0, 300, 700), durability=2, created_at=1.5)


def test_manifest_round_trips_from_bytes_and_from_a_read_only_view() -> None:
    m = _manifest()
    raw = m.to_bytes()
    assert Manifest.from_bytes(raw) == m
    assert Manifest.from_bytes(memoryview(raw).toreadonly()) == m  # SSD gets of >= 1 MiB return views
    with pytest.raises(ValueError, match="not JSON"):
        Manifest.from_bytes(memoryview(raw[:-3]))
