"""bench.server's raw gRPC echo, the reference of the service benchmark: it moves messages of
the sizes ours moves, and both of its sides take records off a stream as ours do (each record's
chunks joined, the call's records held), over real gRPC on loopback."""

from __future__ import annotations

import os

from bench.server import START, RecordJoiner, channel, echo_frames, echo_get, echo_put, start_echo
from statestore.wire import record_frames, split_data_frame
from tiers.record import HEADER_SIZE, make_record


def test_joiner_joins_each_records_chunks_and_keeps_one_chunk_records_uncopied() -> None:
    joiner = RecordJoiner()
    one = os.urandom(100)
    for message in (START, b"ab", b"cd", START, one, START, b"e"):
        joiner.feed(message)
    got = joiner.finish()
    assert got == [b"abcd", one, b"e"]
    assert got[1] is one  # a one-chunk record is the message itself, as ours keeps a view


def test_echo_frames_are_the_sizes_of_our_frames() -> None:
    for size, chunk in ((3000, 1024), (1 << 20, 1 << 20), (4 << 20, 1 << 20), (256 << 10, 1 << 20)):
        payload = os.urandom(size)
        record = make_record(1, 1, payload, model_fingerprint=bytes(16), tenant_id=bytes(16), block_key=bytes(32))
        ours = list(record_frames(record, chunk))
        echo = list(echo_frames(payload, chunk))
        assert [len(f) for f in echo] == [len(f) for f in ours], (size, chunk)
        carried = b"".join(bytes(split_data_frame(f)) for f in echo)  # each is a valid data frame
        assert carried[HEADER_SIZE:] == payload


async def test_echo_put_and_get_move_every_record_in_chunks() -> None:
    size, chunk = 3000, 1024  # three frames a record, the last one short
    payloads = {size: [os.urandom(size) for _ in range(3)]}
    framed = sum(map(len, echo_frames(payloads[size][0], chunk)))
    assert framed > size + HEADER_SIZE  # the header and each frame's few bytes of framing
    server, port = await start_echo(payloads)
    ch = channel(port)
    try:
        assert await echo_put(ch, payloads[size][0], 5, chunk) == 5 * framed
        got = await echo_get(ch, 1, 4, size, chunk)
        assert got == [b"".join(echo_frames(payloads[size][i % 3], chunk)) for i in range(1, 5)]  # in turn
    finally:
        await ch.close()
        await server.stop(0)
