"""How the Redis tier paces a SET batch onto the socket (`tiers.redis._write_groups`): groups of
at most the limit, in order, that concatenate back to the commands, without copying payloads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiers.redis import _pack_set, _write_groups


@given(st.lists(st.binary(max_size=300), max_size=12), st.integers(1, 257))
def test_groups_concatenate_to_the_chunks_and_respect_the_limit(chunks: list[bytes], limit: int) -> None:
    groups = list(_write_groups(chunks, limit))
    assert b"".join(bytes(part) for group in groups for part in group) == b"".join(chunks)
    for group in groups:
        assert group and all(len(part) for part in group)
        assert sum(len(part) for part in group) <= limit
    for group in groups[:-1]:  # every group but the last is full: no more sends than needed
        assert sum(len(part) for part in group) == limit


def test_a_large_payload_is_sliced_into_views_and_small_chunks_pass_as_they_are() -> None:
    payload = bytes(range(256)) * 40_000  # ~10 MB
    chunks = _pack_set(b"key", b"h" * 168, payload, None)
    groups = list(_write_groups(chunks, 1 << 20))
    assert len(groups) == -(-sum(map(len, chunks)) // (1 << 20))
    assert groups[0][0] is chunks[0] and groups[0][1] is chunks[1]  # the command prefix and header, uncopied
    views = [part for group in groups for part in group if isinstance(part, memoryview)]
    assert views and all(v.obj is payload for v in views)  # the payload is sliced, never copied
    assert b"".join(bytes(p) for g in groups for p in g) == b"".join(chunks)


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit"):
        list(_write_groups([b"x"], 0))
