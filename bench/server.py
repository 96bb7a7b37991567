"""Service benchmark (DESIGN.md §7): Lookup ops/s and p50/p99 latency with 1..64 concurrent
clients, and PutRecords/GetRecords GB/s for 256 KiB..4 MiB records, each against a raw gRPC
echo service (a generic handler moving the same bytes in the same chunks) in the same run.

    python -m bench.server [--quick]

Both servers live in this process on loopback, as do the clients, so the ratio measures what
the statestore layer (record encoding, checksums, verification, the store) costs on top of
gRPC itself; absolute figures on a shared 2-core CPU are relative only.

The echo moves the same payloads the natural raw-gRPC way, with everything ours gets: the
same channel and server options (message limits), the same messages per record (a start
message, then the payload in 1 MiB data messages; our 168-byte record header rides in the
first data message), the same process. Both of its sides handle a record as ours do: they
join each record's chunks (no copy for a one-chunk record: PutRecords and `get_records` keep
such a record as a view into its message) and hold the call's records until the call ends
(PutRecords stores nothing before all are verified; `get_records` returns them). It checks,
stores and copies nothing else: those are the costs the ratio is about. Its Get serves
`records` distinct payload buffers (copies of the records' payload made before the rounds),
as the store serves distinct records from its pages: serving one buffer over and over would
read it from the CPU cache, which no real get does.

Two earlier versions of the echo did less or more than a client and server of these records
must, and are fixed: until 2026-11-30 its Get served one cached buffer (1 MiB gets read ~64 MiB
from DRAM against its ~1 MiB from cache); and until the session after that, its get client
dropped each record once joined, so the allocator handed the same few mapped buffers back
for every message while `get_records` holds a call's 32 MiB (with the servers in a child
process, the echo's client took 654 us of CPU per 256 KiB record dropping them and 840
keeping them; ours 850-1084), and its put handler joined the whole stream into one fresh
32 MiB buffer, a copy into unmapped memory that PutRecords never makes for one-chunk records.

Rounds run ours and the echo back to back, in alternating order (ours first, then the echo
first), so drift and order effects cancel; a ratio is the median of the rounds' ratios, and
its spread (the 25th..75th percentile of the rounds' ratios) is reported beside it.

Floors: record streaming (put and get, at every record size) >= 70% of the raw echo.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from bench.common import Floor, print_floors, print_table, write_results
from statestore.client import ClientOptions, StateStoreClient
from statestore.config import ServiceConfig
from statestore.server import StateStoreServer
from statestore.types import Durability
from tiers.record import Record, make_record

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 8 << 20
ECHO = "/bench.v1.Echo/"


# ----- the raw echo service --------------------------------------------------------------------


START = b"\x00" * 64  # the echo's per-record start message (no data message here is 64 bytes long)


class RecordJoiner:
    """How both sides of the echo take records off a stream, as ours do: a start message begins
    a record, a record's chunks are joined (no copy for a one-chunk record), and the call's
    records are held until it ends (`finish`)."""

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self._parts: list[bytes] = []

    def feed(self, message: bytes) -> None:
        if len(message) == len(START):
            self._join()
        else:
            self._parts.append(message)

    def finish(self) -> list[bytes]:
        self._join()
        return self.records

    def _join(self) -> None:
        if self._parts:
            self.records.append(b"".join(self._parts))
            self._parts = []


def echo_handler(payloads: dict[int, list[bytes]]) -> grpc.GenericRpcHandler:
    """Put: take the records off the stream (`RecordJoiner`) and answer their total bytes; Get:
    stream records of `payloads[size]` (distinct buffers, taken in turn) in chunks; Lookup: echo
    the request bytes. No serialisation: handlers see raw bytes."""

    async def put(request_iterator: AsyncIterator[bytes], context: Any) -> bytes:
        joiner = RecordJoiner()
        async for chunk in request_iterator:
            joiner.feed(chunk)
        return sum(map(len, joiner.finish())).to_bytes(8, "little")

    async def get(request: bytes, context: Any) -> AsyncIterator[bytes]:
        first, count, size, chunk = struct.unpack("<QQQQ", request)
        stored = payloads[size]
        for i in range(first, first + count):
            view = memoryview(stored[i % len(stored)])
            yield START
            for offset in range(0, size, chunk):
                yield bytes(view[offset:min(size, offset + chunk)])

    async def lookup(request: bytes, context: Any) -> bytes:
        return request

    return grpc.method_handlers_generic_handler("bench.v1.Echo", {
        "Put": grpc.stream_unary_rpc_method_handler(put),
        "Get": grpc.unary_stream_rpc_method_handler(get),
        "Lookup": grpc.unary_unary_rpc_method_handler(lookup),
    })


async def echo_chunks(payload: bytes, count: int, chunk: int) -> AsyncIterator[bytes]:
    """The echo put client's stream: `count` records of `payload`, each a start message and
    its bytes in `chunk`-byte messages (copied out of the payload, as our frames are)."""
    view = memoryview(payload)
    for _ in range(count):
        yield START
        for offset in range(0, len(payload), chunk):
            yield bytes(view[offset:offset + chunk])


async def echo_put(ch: grpc.aio.Channel, payload: bytes, count: int, chunk: int) -> int:
    """One echo Put call of `count` records; the bytes the server took."""
    reply = await ch.stream_unary(ECHO + "Put")(echo_chunks(payload, count, chunk))
    return int.from_bytes(reply, "little")


async def echo_get(ch: grpc.aio.Channel, first: int, count: int, size: int, chunk: int) -> list[bytes]:
    """One echo Get call: records first..first+count of `size` bytes, as the client holds them."""
    joiner = RecordJoiner()
    async for message in ch.unary_stream(ECHO + "Get")(struct.pack("<QQQQ", first, count, size, chunk)):
        joiner.feed(message)
    return joiner.finish()


async def start_echo(payloads: dict[int, list[bytes]]) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    server.add_generic_rpc_handlers((echo_handler(payloads),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def channel(port: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])


# ----- measurement helpers ---------------------------------------------------------------------


async def closed_loop(concurrency: int, seconds: float, make_call: Callable[[int], Callable[[], Awaitable[Any]]]) -> dict[str, float]:
    """`concurrency` clients calling back to back for `seconds`; ops/s and latency percentiles."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client(i: int) -> None:
        call = make_call(i)
        await call()  # warm-up
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - t0
    latencies.sort()
    return {"ops_s": len(latencies) / elapsed, "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


async def bench_lookup(srv: StateStoreServer, echo_port: int, levels: list[int], seconds: float,
                       chain: list[bytes]) -> list[dict[str, Any]]:
    from proto.statestore.v1 import statestore_pb2

    rows = []
    request = statestore_pb2.LookupRequest(block_keys=chain, num_tokens=len(chain) * 256).SerializeToString()
    for level in levels:
        clients = [StateStoreClient(f"127.0.0.1:{srv.port}") for _ in range(level)]
        channels = [channel(echo_port) for _ in range(level)]
        for c in clients:
            c.open()
        ours = await closed_loop(level, seconds, lambda i: lambda: clients[i].lookup(chain, num_tokens=len(chain) * 256))
        echo = await closed_loop(level, seconds, lambda i: lambda: channels[i].unary_unary(ECHO + "Lookup")(request))
        for c in clients:
            await c.aclose()
        for ch in channels:
            await ch.close()
        rows.append({"case": "lookup", "clients": level, "ops_s": ours["ops_s"], "p50_ms": ours["p50_ms"],
                     "p99_ms": ours["p99_ms"], "echo_ops_s": echo["ops_s"], "echo_p50_ms": echo["p50_ms"],
                     "echo_p99_ms": echo["p99_ms"], "ratio": ours["ops_s"] / echo["ops_s"]})
    return rows


def make_records(srv: StateStoreServer, size: int, count: int, tag: int) -> list[Record]:
    payload = os.urandom(size)
    return [make_record(1, 1, payload, model_fingerprint=srv.adapter.model_fingerprint, tenant_id=bytes(16),
                        block_key=struct.pack("<QQ", tag, i) + bytes(16)) for i in range(count)]


async def timed(fn: Callable[[], Awaitable[Any]], repeats: int) -> float:
    """Best of `repeats` runs, in seconds (the bench calls it with 1 and alternates itself)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        best = min(best, time.perf_counter() - t0)
    return best


async def bench_stream(srv: StateStoreServer, echo_port: int, echo_payloads: dict[int, list[bytes]], size: int,
                       total_bytes: int, repeats: int) -> dict[str, Any]:
    count = max(2, total_bytes // size)
    batch = max(1, min(count, (32 << 20) // size))  # records per call
    records = make_records(srv, size, count, size)
    options = ClientOptions(chunk_bytes=CHUNK_BYTES, max_message_bytes=MAX_MESSAGE_BYTES)

    async def put(c: StateStoreClient) -> None:
        for i in range(0, count, batch):
            await c.put_records(records[i:i + batch], Durability.MEMORY)

    async def get(c: StateStoreClient) -> None:
        keys = [r.key for r in records]
        for i in range(0, count, batch):
            got = await c.get_records(keys[i:i + batch], chunk_bytes=CHUNK_BYTES)
            assert all(r is not None for r in got)

    payload = records[0].payload
    echo_payloads[size] = [bytes(bytearray(payload)) for _ in range(count)]  # distinct buffers, as records are
    ch = channel(echo_port)

    async def echo_puts() -> None:
        for i in range(0, count, batch):
            await echo_put(ch, payload, min(batch, count - i), CHUNK_BYTES)

    async def echo_gets() -> None:
        for i in range(0, count, batch):
            got = await echo_get(ch, i, min(batch, count - i), size, CHUNK_BYTES)
            assert len(got) == min(batch, count - i)

    # The machine is shared, so noise is large and comes in phases: each round runs ours and the
    # echo back to back (ABBA: ours first in even rounds, the echo first in odd ones), each
    # round gives one ratio, and the figure is their median. GB/s columns are the best run of each.
    times: dict[str, list[float]] = {"put": [], "echo_put": [], "get": [], "echo_get": []}
    async with StateStoreClient(f"127.0.0.1:{srv.port}", options=options) as c:
        await put(c)  # one warm-up call each (the first put maps the host tier's slabs)
        await echo_puts()
        for d, ours, echo in (("put", lambda: put(c), echo_puts), ("get", lambda: get(c), echo_gets)):
            for i in range(repeats):
                pair = [(d, ours), (f"echo_{d}", echo)]
                for name, fn in pair if i % 2 == 0 else pair[::-1]:
                    times[name].append(await timed(fn, 1))
        for r in records:
            await srv.store.evict(r.key, force=True)
    await ch.close()
    del echo_payloads[size]
    moved = count * size
    row: dict[str, Any] = {"case": "stream", "record_bytes": size, "records": count}
    for name, runs in times.items():
        row[f"{name}_gb_s"] = moved / min(runs) / 1e9
    for d in ("put", "get"):
        ratios = sorted(e / o for e, o in zip(times[f"echo_{d}"], times[d]))
        row[f"{d}_ratio"] = statistics.median(ratios)
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        row[f"{d}_ratio_iqr"] = f"{q1:.2f}-{q3:.2f}"
    return row


async def run(quick: bool, results_name: str = "server") -> None:
    levels = [1, 4, 16, 64]
    sizes = [256 << 10, 1 << 20, 4 << 20]
    seconds = 1.0 if quick else 3.0
    total = (16 << 20) if quick else (64 << 20)
    repeats = 8 if quick else 16
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        config = ServiceConfig(listen="127.0.0.1:0", data_dir=Path(tmp), engine_preset="mini",
                               max_message_bytes=MAX_MESSAGE_BYTES, host_budget_bytes=2 * total + (64 << 20))
        srv = StateStoreServer(config)
        await srv.start()
        gc.freeze()  # as `statestore serve` does once it is up: start-up's objects leave the collector's walks
        echo_payloads: dict[int, list[bytes]] = {}
        echo, echo_port = await start_echo(echo_payloads)
        try:
            chain = [struct.pack("<Q", i) + bytes(24) for i in range(16)]
            lookup_rows = await bench_lookup(srv, echo_port, levels, seconds, chain)
            stream_rows = [await bench_stream(srv, echo_port, echo_payloads, size, total, repeats) for size in sizes]
        finally:
            await echo.stop(0)
            await srv.stop(0)
    print("Lookup (16-block chain) vs raw gRPC echo of the same request")
    print_table(lookup_rows, ["clients", "ops_s", "p50_ms", "p99_ms", "echo_ops_s", "echo_p50_ms", "echo_p99_ms",
                              "ratio"])
    print("\nRecord streaming (1 MiB chunks) vs raw gRPC echo of the same bytes")
    print_table(stream_rows, ["record_bytes", "records", "put_gb_s", "echo_put_gb_s", "put_ratio", "put_ratio_iqr",
                              "get_gb_s", "echo_get_gb_s", "get_ratio", "get_ratio_iqr"])
    floors = {f"{d}_{r['record_bytes'] >> 10}KiB_vs_echo": Floor(r[f"{d}_ratio"], 0.7)
              for r in stream_rows for d in ("put", "get")}
    print_floors(floors)
    path = write_results(results_name, device="cpu",
                         params={"quick": quick, "lookup_seconds": seconds, "stream_total_bytes": total,
                                 "chunk_bytes": CHUNK_BYTES, "clients": levels, "record_sizes": sizes,
                                 "engine": "mini", "repeats": repeats},
                         rows=lookup_rows + stream_rows, floors=floors)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under a minute on 2 cores")
    parser.add_argument("--results-name", default="server",
                        help="results file bench/results/<name>.json (e.g. server-h200-host for another machine's CPU)")
    args = parser.parse_args()
    asyncio.run(run(args.quick, args.results_name))


if __name__ == "__main__":
    main()
