"""Service benchmark (DESIGN.md §7): Lookup ops/s and p50/p99 latency with 1..64 concurrent
clients, and PutRecords/GetRecords GB/s for 256 KiB..4 MiB records, each against a raw gRPC
echo service (a generic handler moving the same bytes in the same chunks) in the same run.

    python -m bench.server [--quick] [--topology both|sidecar|in-process]

Two shapes, both in each run by default. `sidecar` (the floors'): `statestore serve` and the
echo each in a child process on loopback, the clients in this one, as the service is deployed
beside an inference server. `in-process` (the only shape until this benchmark's last change):
both servers on the clients' event loop, where client and server work share one loop and one
interpreter lock, which no deployment does, so the ratio charges our client's and our server's
per-record work in series. Either way the ratio measures what the statestore layer (record
encoding, checksums, verification, the store) costs on top of gRPC itself; absolute figures on
a shared 2-core CPU are relative only.

The echo moves the same payloads the natural raw-gRPC way, with everything ours gets: the same
channel and server options (message limits), the same messages per record, of the same sizes
(a start message, then data messages the size of ours: `echo_frames`), the same kind of
process (in the sidecar shape one of its own, with the allocator setting `statestore serve`
makes). Both of its sides handle a record as ours do: they join each record's chunks (no copy
for a one-chunk record: PutRecords and `get_records` keep such a record as a view into its
message) and hold the call's records until the call ends (PutRecords stores nothing before all
are verified; `get_records` returns them). It checks, stores and copies nothing else: those
are the costs the ratio is about. Its Get serves distinct payload buffers, one per record of a
pass, as the store serves distinct records from its pages: serving one buffer over and over
would read it from the CPU cache, which no real get does.

Earlier versions of the echo did less or more than a client and server of these records must,
each found and fixed: it served one cached buffer (1 MiB gets read ~64 MiB from DRAM against its
~1 MiB from cache); its get client dropped each record once joined, so the allocator handed the
same few mapped buffers back for every message while `get_records` holds a call's 32 MiB (with
the servers in a child process, the echo's client took 654 us of CPU per 256 KiB record
dropping them, 840 keeping them; ours 850-1084); its put handler joined the whole stream into
one fresh 32 MiB buffer, a copy into unmapped memory that PutRecords never makes for one-chunk
records; and its data messages were bare 1 MiB chunks, where gRPC sends messages of exactly
1 MiB at under half the rate of ours (1 MiB + 173 bytes): in three runs its put client took
1797-2461 us of CPU a message against 625-703 padded like ours.

Rounds run ours and the echo back to back, in alternating order (ours first, then the echo
first), so drift and order effects cancel; a ratio is the median of the rounds' ratios, and
its spread (the 25th..75th percentile of the rounds' ratios) is reported beside it.

Floors: record streaming (put and get, at every record size) >= 70% of the raw echo.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import re
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.common import Floor, print_floors, print_table, write_results
from engine_adapter.base import StateKind
from statestore.allocator import keep_large_buffers_in_heap
from statestore.client import ClientOptions, StateStoreClient
from statestore.config import ServiceConfig
from statestore.server import StateStoreServer
from statestore.spawn import spawn_serve, spawn_until_ready
from statestore.types import Durability
from statestore.wire import frame_slices
from tiers.record import HEADER_SIZE, Record, make_record

LOOKUP_KINDS = (int(StateKind.GLOBAL_KV), int(StateKind.INDEX_K))  # what a Lookup without `kinds` asks for

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 8 << 20
ECHO = "/bench.v1.Echo/"
ECHO_READY = re.compile(r"echo serving on 127\.0\.0\.1:(\d+)")  # the echo child's first line


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
            yield START
            for frame in echo_frames(stored[i % len(stored)], chunk):
                yield frame

    async def lookup(request: bytes, context: Any) -> bytes:
        return request

    return grpc.method_handlers_generic_handler("bench.v1.Echo", {
        "Put": grpc.stream_unary_rpc_method_handler(put),
        "Get": grpc.unary_stream_rpc_method_handler(get),
        "Lookup": grpc.unary_unary_rpc_method_handler(lookup),
    })


def echo_frames(payload: bytes, chunk: int) -> Iterator[bytes]:
    """One record's data messages, each the size of ours (`statestore.wire.frame_slices`: a few
    bytes of framing, the 168-byte header in the first, then up to `chunk` payload bytes),
    copied out of the payload as ours are. Sizes matter: an echo of bare 1 MiB chunks measured
    a gRPC quirk with messages of exactly 1 MiB (see the module's docstring)."""
    view = memoryview(payload)
    for prefix, start, stop in frame_slices(chunk)(bytes(HEADER_SIZE), len(payload)):
        yield b"".join((prefix, view[start:stop]))


async def echo_chunks(payload: bytes, count: int, chunk: int) -> AsyncIterator[bytes]:
    """The echo put client's stream: `count` records of `payload`, each a start message and
    its data messages (`echo_frames`)."""
    for _ in range(count):
        yield START
        for frame in echo_frames(payload, chunk):
            yield frame


async def echo_put(ch: grpc.aio.Channel, payload: bytes, count: int, chunk: int) -> int:
    """One echo Put call of `count` records; the bytes the server took (framing included)."""
    reply = await ch.stream_unary(ECHO + "Put")(echo_chunks(payload, count, chunk))
    return int.from_bytes(reply, "little")


async def echo_get(ch: grpc.aio.Channel, first: int, count: int, size: int, chunk: int) -> list[bytes]:
    """One echo Get call: records first..first+count of `size` bytes, as the client holds them
    (each its frames joined, framing included)."""
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


def records_for(size: int, total_bytes: int) -> int:
    """Records of `size` bytes a stream case moves per pass."""
    return max(2, total_bytes // size)


def echo_payloads(sizes: list[int], total_bytes: int) -> dict[int, list[bytes]]:
    """Per record size, the distinct payloads the echo's Get serves in turn, one per record of a
    pass, as the store serves distinct records from its pages."""
    return {size: [os.urandom(size) for _ in range(records_for(size, total_bytes))] for size in sizes}


def host_budget(total_bytes: int) -> int:
    """Our host tier's budget: room for a pass's records twice over, so that puts never evict."""
    return 2 * total_bytes + (64 << 20)


@dataclass(frozen=True, slots=True)
class Servers:
    """Where the two servers listen, and the fingerprint of the model ours hosts."""

    ours_port: int
    echo_port: int
    fingerprint: bytes
    ours_pid: int = 0  # the processes serving them (this one in the in-process shape), for CPU readings
    echo_pid: int = 0


async def serve_echo(sizes: list[int], total_bytes: int) -> None:
    """The echo as a process of its own (`--serve-echo`): one ready line, then serve until killed.
    It keeps large buffers in the heap as `statestore serve` does (`statestore.allocator`):
    without that, each 1 MiB message it received cost fresh pages, and its puts ran at 0.6-0.7
    of ours."""
    keep_large_buffers_in_heap()
    server, port = await start_echo(echo_payloads(sizes, total_bytes))
    gc.freeze()
    print(f"echo serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


@contextlib.asynccontextmanager
async def sidecar_servers(sizes: list[int], total_bytes: int, tmp: Path) -> AsyncIterator[Servers]:
    """`statestore serve` and the echo each in a child process: the deployed shape (a sidecar
    beside its client), where client and server work on their own cores and event loops."""
    env = {**os.environ, "STATESTORE_SERVER_MAX_MESSAGE_BYTES": str(MAX_MESSAGE_BYTES),
           "STATESTORE_STORAGE_HOST_BUDGET_BYTES": str(host_budget(total_bytes))}
    ours, ours_port = await asyncio.to_thread(spawn_serve, tmp / "data", env=env)
    try:
        echo, echo_port = await asyncio.to_thread(spawn_until_ready, [
            sys.executable, "-m", "bench.server", "--serve-echo", "--sizes", ",".join(map(str, sizes)),
            "--total-bytes", str(total_bytes)], ECHO_READY, "the echo server")
    except BaseException:
        ours.kill()
        ours.wait()
        raise
    try:
        async with StateStoreClient(f"127.0.0.1:{ours_port}") as c:
            fingerprint = (await c.stats()).model_fingerprint
        yield Servers(ours_port, echo_port, fingerprint, ours.pid, echo.pid)
    finally:
        for proc in (echo, ours):
            proc.kill()
            proc.wait()


@contextlib.asynccontextmanager
async def in_process_servers(sizes: list[int], total_bytes: int, tmp: Path) -> AsyncIterator[Servers]:
    """Both servers in this process, on the clients' event loop (`--topology in-process`): client
    and server work then share one loop and one interpreter lock, which no deployment does."""
    config = ServiceConfig(listen="127.0.0.1:0", data_dir=tmp / "data", engine_preset="mini",
                           max_message_bytes=MAX_MESSAGE_BYTES, host_budget_bytes=host_budget(total_bytes))
    srv = StateStoreServer(config)
    await srv.start()
    echo, echo_port = await start_echo(echo_payloads(sizes, total_bytes))
    gc.freeze()  # as `statestore serve` does once it is up: start-up's objects leave the collector's walks
    try:
        yield Servers(srv.port, echo_port, srv.adapter.model_fingerprint, os.getpid(), os.getpid())
    finally:
        await echo.stop(0)
        await srv.stop(0)


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


LONG_CHAIN_BLOCKS = 512  # a 128K-token prompt at 256 tokens per block
LONG_CHAIN_RECORD_BYTES = 4096  # its records' size: Lookup reads the index, never a payload


async def store_chain(servers: Servers, blocks: int) -> list[bytes]:
    """A chain of `blocks` block keys whose records (both kinds a Lookup asks for by default)
    are stored in our server, as a returning session's are: Lookup then walks the whole chain."""
    chain = [struct.pack("<QQ", 1 << 40, i) + bytes(16) for i in range(blocks)]
    payload = os.urandom(LONG_CHAIN_RECORD_BYTES)
    records = [make_record(kind, 1, payload, model_fingerprint=servers.fingerprint, tenant_id=bytes(16),
                           block_key=block_key) for block_key in chain for kind in LOOKUP_KINDS]
    async with StateStoreClient(f"127.0.0.1:{servers.ours_port}") as c:
        for i in range(0, len(records), 256):
            await c.put_records(records[i:i + 256], Durability.MEMORY)
    return chain


async def bench_lookup(servers: Servers, levels: list[int], seconds: float,
                       chain: list[bytes], case: str = "lookup") -> list[dict[str, Any]]:
    from proto.statestore.v1 import statestore_pb2

    rows = []
    request = statestore_pb2.LookupRequest(block_keys=chain, num_tokens=len(chain) * 256).SerializeToString()
    for level in levels:
        clients = [StateStoreClient(f"127.0.0.1:{servers.ours_port}") for _ in range(level)]
        channels = [channel(servers.echo_port) for _ in range(level)]
        for c in clients:
            c.open()
        ours = await closed_loop(level, seconds, lambda i: lambda: clients[i].lookup(chain, num_tokens=len(chain) * 256))
        echo = await closed_loop(level, seconds, lambda i: lambda: channels[i].unary_unary(ECHO + "Lookup")(request))
        for c in clients:
            await c.aclose()
        for ch in channels:
            await ch.close()
        rows.append({"case": case, "blocks": len(chain), "clients": level, "ops_s": ours["ops_s"],
                     "p50_ms": ours["p50_ms"], "p99_ms": ours["p99_ms"], "echo_ops_s": echo["ops_s"],
                     "echo_p50_ms": echo["p50_ms"], "echo_p99_ms": echo["p99_ms"], "ratio": ours["ops_s"] / echo["ops_s"]})
    return rows


def make_records(fingerprint: bytes, size: int, count: int, tag: int) -> list[Record]:
    payload = os.urandom(size)
    return [make_record(1, 1, payload, model_fingerprint=fingerprint, tenant_id=bytes(16),
                        block_key=struct.pack("<QQ", tag, i) + bytes(16)) for i in range(count)]


async def timed(fn: Callable[[], Awaitable[Any]], repeats: int) -> float:
    """Best of `repeats` runs, in seconds (the bench calls it with 1 and alternates itself)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        best = min(best, time.perf_counter() - t0)
    return best


async def put_calls(c: StateStoreClient, records: list[Record], batch: int) -> list[float]:
    """Our side of a stream case: `records` put `batch` per PutRecords call (MEMORY); each call's seconds."""
    took = []
    for i in range(0, len(records), batch):
        t0 = time.perf_counter()
        await c.put_records(records[i:i + batch], Durability.MEMORY)
        took.append(time.perf_counter() - t0)
    return took


async def echo_put_calls(ch: grpc.aio.Channel, payload: bytes, count: int, batch: int) -> list[float]:
    """The echo's side: `count` records of `payload`, `batch` per call; each call's seconds."""
    took = []
    for i in range(0, count, batch):
        t0 = time.perf_counter()
        await echo_put(ch, payload, min(batch, count - i), CHUNK_BYTES)
        took.append(time.perf_counter() - t0)
    return took


async def bench_stream(servers: Servers, size: int, total_bytes: int, repeats: int) -> dict[str, Any]:
    count = records_for(size, total_bytes)
    batch = max(1, min(count, (32 << 20) // size))  # records per call
    records = make_records(servers.fingerprint, size, count, size)
    options = ClientOptions(chunk_bytes=CHUNK_BYTES, max_message_bytes=MAX_MESSAGE_BYTES)

    async def put(c: StateStoreClient) -> None:
        await put_calls(c, records, batch)

    async def get(c: StateStoreClient) -> None:
        keys = [r.key for r in records]
        for i in range(0, count, batch):
            got = await c.get_records(keys[i:i + batch], chunk_bytes=CHUNK_BYTES)
            assert all(r is not None for r in got)

    payload = records[0].payload
    ch = channel(servers.echo_port)

    async def echo_puts() -> None:
        await echo_put_calls(ch, payload, count, batch)

    async def echo_gets() -> None:
        for i in range(0, count, batch):
            got = await echo_get(ch, i, min(batch, count - i), size, CHUNK_BYTES)
            assert len(got) == min(batch, count - i)

    # The machine is shared, so noise is large and comes in phases: each round runs ours and the
    # echo back to back (ABBA: ours first in even rounds, the echo first in odd ones), each
    # round gives one ratio, and the figure is their median. GB/s columns are the best run of each.
    times: dict[str, list[float]] = {"put": [], "echo_put": [], "get": [], "echo_get": []}
    async with StateStoreClient(f"127.0.0.1:{servers.ours_port}", options=options) as c:
        await put(c)  # one warm-up call each (the first put maps the host tier's slabs)
        await echo_puts()
        for d, ours, echo in (("put", lambda: put(c), echo_puts), ("get", lambda: get(c), echo_gets)):
            for i in range(repeats):
                pair = [(d, ours), (f"echo_{d}", echo)]
                for name, fn in pair if i % 2 == 0 else pair[::-1]:
                    times[name].append(await timed(fn, 1))
        await c.evict([r.key for r in records], force=True)
    await ch.close()
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


TOPOLOGIES = {  # name: (how the servers start, the title its tables print under)
    "sidecar": (sidecar_servers, "statestore serve and the echo each in a child process (the floors')"),
    "in-process": (in_process_servers, "both servers on the clients' event loop (no floors)"),
}


async def run(quick: bool, topologies: list[str], results_name: str = "server") -> None:
    levels = [1, 4, 16, 64]
    long_levels = [1] if quick else [1, 16]
    sizes = [256 << 10, 1 << 20, 4 << 20]
    seconds = 1.0 if quick else 3.0
    total = (16 << 20) if quick else (64 << 20)
    repeats = 8 if quick else 16
    rows: list[dict[str, Any]] = []
    for topology in topologies:
        with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
            async with TOPOLOGIES[topology][0](sizes, total, Path(tmp)) as servers:
                chain = [struct.pack("<Q", i) + bytes(24) for i in range(16)]
                found = await bench_lookup(servers, levels, seconds, chain)
                found += await bench_lookup(servers, long_levels, seconds,
                                            await store_chain(servers, LONG_CHAIN_BLOCKS), "lookup_long")
                found += [await bench_stream(servers, size, total, repeats) for size in sizes]
        rows += [{"topology": topology, **row} for row in found]
    for topology in topologies:
        print(f"\n== {topology}: {TOPOLOGIES[topology][1]}")
        print("Lookup (16-block chain) vs raw gRPC echo of the same request")
        print_table([r for r in rows if r["topology"] == topology and r["case"] == "lookup"],
                    ["clients", "ops_s", "p50_ms", "p99_ms", "echo_ops_s", "echo_p50_ms", "echo_p99_ms", "ratio"])
        print(f"Lookup of a stored {LONG_CHAIN_BLOCKS}-block chain (a 128K-token prompt's, both kinds) "
              "vs raw gRPC echo of the same request")
        print_table([r for r in rows if r["topology"] == topology and r["case"] == "lookup_long"],
                    ["clients", "ops_s", "p50_ms", "p99_ms", "echo_ops_s", "echo_p50_ms", "echo_p99_ms", "ratio"])
        print("Record streaming (1 MiB chunks) vs raw gRPC echo of the same bytes")
        print_table([r for r in rows if r["topology"] == topology and r["case"] == "stream"],
                    ["record_bytes", "records", "put_gb_s", "echo_put_gb_s", "put_ratio", "put_ratio_iqr",
                     "get_gb_s", "echo_get_gb_s", "get_ratio", "get_ratio_iqr"])
    # The floors are the deployed shape's (a sidecar process); in-process figures are shown beside.
    floors = {f"{d}_{r['record_bytes'] >> 10}KiB_vs_echo": Floor(r[f"{d}_ratio"], 0.7)
              for r in rows if r["case"] == "stream" and r["topology"] == "sidecar" for d in ("put", "get")}
    print_floors(floors)
    path = write_results(results_name, device="cpu",
                         params={"quick": quick, "topologies": topologies, "lookup_seconds": seconds,
                                 "stream_total_bytes": total, "chunk_bytes": CHUNK_BYTES, "clients": levels,
                                 "long_chain_blocks": LONG_CHAIN_BLOCKS, "long_chain_clients": long_levels,
                                 "record_sizes": sizes, "engine": "mini", "repeats": repeats},
                         rows=rows, floors=floors)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run under a minute on 2 cores")
    parser.add_argument("--topology", choices=["both", *TOPOLOGIES], default="both",
                        help="where the servers run: child processes (sidecar, the floors'), this process, or both")
    parser.add_argument("--results-name", default="server",
                        help="results file bench/results/<name>.json (e.g. server-h200-host for another machine's CPU)")
    parser.add_argument("--serve-echo", action="store_true", help=argparse.SUPPRESS)  # the sidecar's echo child
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    parser.add_argument("--total-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_echo:
        asyncio.run(serve_echo([int(x) for x in args.sizes.split(",")], args.total_bytes))
        return
    topologies = list(TOPOLOGIES) if args.topology == "both" else [args.topology]
    asyncio.run(run(args.quick, topologies, args.results_name))


if __name__ == "__main__":
    main()
