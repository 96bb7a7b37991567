"""The Redis tier's own reply reader (`tiers.redis_bulk.ReplyParser`), fed byte patterns the way
the event loop's transport feeds it: into the buffer it asks for, in pieces of any size. The
reader against a real Redis is in tests/integration/test_redis_tier.py."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis import exceptions as rex

from tiers.redis_bulk import MAX_VALUE_BYTES, SCRATCH_BYTES, ReplyParser, encode_command


def bulk(value: bytes | None) -> bytes:
    return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)


def feed(parser: ReplyParser, data: bytes, pieces: list[int]) -> None:
    """Deliver `data` as a transport would: each read fills at most the buffer the parser
    hands out, and at most the next of `pieces` bytes (cycled)."""
    pos, i = 0, 0
    while pos < len(data):
        assert not parser.done, "the parser finished before its reply ended"
        buf = parser.buffer()
        assert len(buf) > 0
        n = min(len(buf), len(data) - pos, max(1, pieces[i % len(pieces)]))
        buf[:n] = data[pos:pos + n]
        buf.release()
        parser.landed(n)
        pos, i = pos + n, i + 1


def plain(result: Any) -> Any:
    """A parsed reply with its values as bytes (they come as read-only views)."""
    if isinstance(result, list):
        return [plain(v) for v in result]
    if isinstance(result, memoryview):
        assert result.readonly
        return bytes(result)
    return result


# Values around the sizes where the parser changes how it reads: the direct-read threshold
# (a quarter of the scratch buffer) and the scratch buffer itself.
_EDGE_SIZES = [0, 1, 2, SCRATCH_BYTES // 4 - 1, SCRATCH_BYTES // 4 + 1, SCRATCH_BYTES - 3, SCRATCH_BYTES + 7]
values = st.one_of(st.none(), st.binary(max_size=300),
                   st.sampled_from(_EDGE_SIZES).map(lambda n: (b"\r\n" * n)[:n]),
                   st.sampled_from(_EDGE_SIZES).flatmap(lambda n: st.binary(min_size=n, max_size=n)))
pieces = st.lists(st.sampled_from([1, 2, 3, 5, 7, 168, 4096, 1 << 20]), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(value=values, split=pieces)
def test_a_bulk_string_comes_back_exactly_however_it_is_split(value: bytes | None, split: list[int]) -> None:
    parser = ReplyParser()
    feed(parser, bulk(value), split)
    assert parser.done and plain(parser.result) == value


@settings(max_examples=100, deadline=None)
@given(items=st.lists(values, max_size=12), split=pieces)
def test_an_array_of_bulk_strings_comes_back_exactly(items: list[bytes | None], split: list[int]) -> None:
    parser = ReplyParser()
    feed(parser, b"*%d\r\n" % len(items) + b"".join(bulk(v) for v in items), split)
    assert parser.done and plain(parser.result) == items


@settings(max_examples=40, deadline=None)
@given(first=values, second=st.lists(values, max_size=4), split=pieces)
def test_one_parser_reads_reply_after_reply(first: bytes | None, second: list[bytes | None],
                                            split: list[int]) -> None:
    parser = ReplyParser()
    feed(parser, bulk(first), split)
    assert plain(parser.result) == first
    parser.reset()
    feed(parser, b"*%d\r\n" % len(second) + b"".join(bulk(v) for v in second), split)
    assert plain(parser.result) == second


@pytest.mark.parametrize("reply, want", [
    (b"+OK\r\n", "OK"),
    (b":42\r\n", 42),
    (b"*-1\r\n", None),
    (b"*0\r\n", []),
])
def test_simple_replies(reply: bytes, want: Any) -> None:
    parser = ReplyParser()
    feed(parser, reply, [1])
    assert parser.done and parser.result == want


def test_an_error_reply_is_a_response_error_with_its_text() -> None:
    parser = ReplyParser()
    feed(parser, b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n", [4])
    assert isinstance(parser.result, rex.ResponseError)
    assert "WRONGTYPE" in str(parser.result)


@pytest.mark.parametrize("reply, says", [
    (b"$abc\r\n", "not an integer"),
    (b"$-2\r\n", "bulk length -2"),
    (b"$%d\r\n" % (MAX_VALUE_BYTES + 1), "outside"),  # refused before anything is allocated
    (b"$3\r\nabcXY", "not followed by CRLF"),
    (b"?what\r\n", "unexpected redis reply line"),
    (b"*2\r\n+OK\r\n", "unexpected redis reply line"),  # GET and MGET arrays hold bulk strings only
    (b"*1\r\n*1\r\n", "unexpected redis reply line"),
])
def test_a_reply_that_breaks_the_protocol_is_refused_by_name(reply: bytes, says: str) -> None:
    parser = ReplyParser()
    with pytest.raises(rex.InvalidResponse, match=says):
        feed(parser, reply, [1 << 20])


def test_a_line_longer_than_the_scratch_buffer_is_refused() -> None:
    parser = ReplyParser()
    with pytest.raises(rex.InvalidResponse, match="longer than"):
        feed(parser, b"+" + b"x" * (SCRATCH_BYTES + 10) + b"\r\n", [1 << 20])


def test_bytes_beyond_the_reply_are_refused_at_the_next_call() -> None:
    parser = ReplyParser()
    feed(parser, b"+OK\r\n+OK\r\n", [1 << 20])  # one read delivers two replies
    assert parser.result == "OK"
    with pytest.raises(rex.InvalidResponse, match="beyond the reply"):
        parser.reset()


def test_a_large_value_is_read_into_its_own_buffer_not_the_scratch() -> None:
    """Once a large bulk string's length is known the parser hands out the value's buffer: the
    transport's reads land there, and the value is not copied again."""
    value = bytes(range(256)) * 4096  # 1 MiB
    parser = ReplyParser()
    data = bulk(value)
    head = data.index(b"\r\n") + 2
    feed(parser, data[:head], [head])
    buf = parser.buffer()
    assert len(buf) == len(value) + 2  # the value and its CRLF, nothing else
    buf[:] = data[head:]
    buf.release()
    parser.landed(len(value) + 2)
    assert parser.done and plain(parser.result) == value


@given(parts=st.lists(st.one_of(st.binary(max_size=40), st.text(max_size=20)), min_size=1, max_size=6))
def test_commands_are_resp_arrays_of_bulk_strings(parts: list[bytes | str]) -> None:
    """What `encode_command` writes parses back (with the same parser) to its parts."""
    parser = ReplyParser()
    feed(parser, encode_command(*parts), [7])
    assert plain(parser.result) == [p.encode() if isinstance(p, str) else p for p in parts]
