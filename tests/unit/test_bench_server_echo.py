"""bench.server's raw gRPC echo, the reference of the service benchmark: both of its sides take
records off a stream as ours do (each record's chunks joined, the call's records held), over real
gRPC on loopback."""

from __future__ import annotations

import os

from bench.server import START, RecordJoiner, channel, echo_get, echo_put, start_echo


def test_joiner_joins_each_records_chunks_and_keeps_one_chunk_records_uncopied() -> None:
    joiner = RecordJoiner()
    one = os.urandom(100)
    for message in (START, b"ab", b"cd", START, one, START, b"e"):
        joiner.feed(message)
    got = joiner.finish()
    assert got == [b"abcd", one, b"e"]
    assert got[1] is one  # a one-chunk record is the message itself, as ours keeps a view


async def test_echo_put_and_get_move_every_record_in_chunks() -> None:
    size, chunk = 3000, 1024  # three chunks a record, the last one short
    payloads = {size: [os.urandom(size) for _ in range(3)]}
    server, port = await start_echo(payloads)
    ch = channel(port)
    try:
        assert await echo_put(ch, payloads[size][0], 5, chunk) == 5 * size
        got = await echo_get(ch, 1, 4, size, chunk)
        assert got == [payloads[size][i % 3] for i in range(1, 5)]  # distinct buffers, taken in turn
    finally:
        await ch.close()
        await server.stop(0)
