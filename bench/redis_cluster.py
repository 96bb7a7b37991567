"""The Redis tier's reads on a Cluster (a diagnostic, no floor): gets and batched gets of the
tier through its own per-node readers against the same tier reading through redis-py
(`bulk_reads=False`) and against raw redis-py `RedisCluster` GETs (a pipeline of GETs for the
batch) of the same values, alternated in one run, on a Cluster of three masters this script
starts on free ports (`redis-server`, `redis-cli`) and removes afterwards.

    python -m bench.redis_cluster [--sizes 256K,4M,32M] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import wait_until
from bench.tiers import make_records, parse_size
from tiers.redis import RedisTier

TOTAL_BYTES = 64 << 20  # per pass and size: at least 4 records
CLUSTER_DOWN = "the Redis Cluster did not come up"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def cluster(masters: int = 3) -> Iterator[list[int]]:
    """Ports of a fresh Cluster of `masters` masters, no replicas, nothing persisted."""
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        raise SystemExit("bench.redis_cluster needs redis-server and redis-cli on PATH")
    work = Path(tempfile.mkdtemp(prefix="bench-redis-cluster-"))
    ports = [free_port() for _ in range(masters)]
    procs = []
    try:
        for port in ports:
            node = work / str(port)
            node.mkdir()
            procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-port", str(free_port()), "--save", "",
                 "--appendonly", "no", "--dir", str(node)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in ports:
            wait_until(lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode == 0,
                       CLUSTER_DOWN, timeout_s=15.0, poll_s=0.05)
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, timeout=30, capture_output=True)
        for port in ports:
            wait_until(lambda: b"cluster_state:ok" in subprocess.run(
                ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True).stdout,
                CLUSTER_DOWN, timeout_s=15.0, poll_s=0.05)
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def run_size(url: str, size: int, rounds: int) -> dict[str, Any]:
    from redis.asyncio.cluster import RedisCluster

    count = max(4, TOTAL_BYTES // size)
    records = make_records(size, count, "redis-cluster")
    own = RedisTier(url, prefix="bench-own", socket_timeout_s=10.0)
    plain = RedisTier(url, prefix="bench-plain", socket_timeout_s=10.0, bulk_reads=False)
    raw = RedisCluster.from_url(url.replace("redis+cluster://", "redis://"), socket_timeout=10.0)
    try:
        assert own.bulk_reads and not plain.bulk_reads
        for tier in (own, plain):
            assert all(await tier.put_many(records))
        names = [own.redis_key(r.key) for r in records]  # raw reads the values the own-reader tier wrote
        keys = [r.key for r in records]

        async def tier_gets(tier: RedisTier) -> None:
            for k in keys:
                assert await tier.get(k) is not None

        async def tier_batch(tier: RedisTier) -> None:
            assert all(g is not None for g in await tier.get_many(keys))

        async def raw_gets() -> None:
            for n in names:
                assert await raw.get(n) is not None

        async def raw_batch() -> None:
            pipe = raw.pipeline(transaction=False)
            for n in names:
                pipe.get(n)
            assert all(v is not None for v in await pipe.execute())

        cases: dict[str, Callable[[], Awaitable[None]]] = {
            "get_own": lambda: tier_gets(own), "get_redis_py": lambda: tier_gets(plain), "get_raw": raw_gets,
            "batch_own": lambda: tier_batch(own), "batch_redis_py": lambda: tier_batch(plain), "batch_raw": raw_batch,
        }
        taken: dict[str, list[float]] = {name: [] for name in cases}
        for i in range(rounds):
            for name in (list(cases) if i % 2 == 0 else list(reversed(cases))):
                taken[name].append(await timed(cases[name]))
        gbps = {name: count * size / statistics.median(v) / 1e9 for name, v in taken.items()}
        return {"size": size, "records": count, "rounds": rounds, **{f"{k}_GBps": v for k, v in gbps.items()},
                "get_own_vs_raw": gbps["get_own"] / gbps["get_raw"],
                "get_own_vs_redis_py": gbps["get_own"] / gbps["get_redis_py"],
                "batch_own_vs_raw": gbps["batch_own"] / gbps["batch_raw"],
                "batch_own_vs_redis_py": gbps["batch_own"] / gbps["batch_redis_py"]}
    finally:
        for tier in (own, plain):
            for r in records:
                await tier.delete(r.key)
            await tier.aclose()
        await raw.aclose()


async def run(sizes: Sequence[int], rounds: int) -> list[dict[str, Any]]:
    with cluster() as ports:
        url = f"redis+cluster://127.0.0.1:{ports[0]}"
        return [await run_size(url, size, rounds) for size in sizes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256K,4M,32M", help="record payload sizes (default 256K,4M,32M)")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the cases (default 5)")
    args = parser.parse_args()
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    except ValueError as exc:
        parser.error(str(exc))
    if not sizes or args.rounds < 1:
        parser.error("give at least one size and one round")
    print(json.dumps(asyncio.run(run(sizes, args.rounds)), indent=1))


if __name__ == "__main__":
    main()
