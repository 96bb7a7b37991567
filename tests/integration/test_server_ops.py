"""Operating the service: graceful stop lets in-flight calls finish, TLS when a certificate is
configured, UNAVAILABLE only when the service cannot serve a durability (Redis down), and the
blocking client."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from pathlib import Path

import grpc
import pytest

from statestore.client import ClientOptions, ServiceError, StateStoreClient, SyncStateStoreClient
from statestore.config import ServiceConfig
from statestore.server import StateStoreServer
from statestore.types import Durability, TierName
from tiers.record import make_record

pytestmark = pytest.mark.timeout(60)


def config(tmp_path: Path, **kw: object) -> ServiceConfig:
    kw.setdefault("listen", "127.0.0.1:0")
    return ServiceConfig(data_dir=tmp_path, engine_preset="mini", **kw)  # type: ignore[arg-type]


async def test_stop_lets_in_flight_calls_finish_then_refuses(tmp_path: Path) -> None:
    srv = StateStoreServer(config(tmp_path))
    await srv.start()
    try:
        async with StateStoreClient(f"127.0.0.1:{srv.port}") as c:
            await c.create_session("s")
            await c.append("s", list(range(100)))
            started = asyncio.Event()

            async def generate() -> list[int]:
                out: list[int] = []
                async for chunk in c.generate_stream("s", 24, chunk_tokens=2):
                    out += chunk
                    started.set()
                return out

            task = asyncio.create_task(generate())
            await asyncio.wait_for(started.wait(), 20)
            await srv.stop(grace=30)
            assert len(await task) == 24  # the in-flight call finished within the grace period
            with pytest.raises(ServiceError) as info:
                await c.stats()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        await srv.stop(0)


async def test_a_client_gone_once_the_puts_began_leaves_the_store_and_its_tiers_agreeing(tmp_path: Path) -> None:
    """A PutRecords whose client cancels once the server began storing the stream's verified
    records: the puts run to completion (its call ends when they are done), so no record is cut
    off halfway. Before, the handler was cancelled mid-put: the SSD tier finished the write on its
    thread and held a record the store had forgotten (never evicted, invisible to lookups)."""
    async with StateStoreServer(config(tmp_path)) as srv:
        fp = srv.adapter.model_fingerprint
        records = [make_record(1, 1, bytes([i]) * (4 << 20), model_fingerprint=fp, tenant_id=bytes(16),
                               block_key=bytes([i + 1]) * 32) for i in range(6)]
        async with StateStoreClient(f"127.0.0.1:{srv.port}") as c:
            task = asyncio.create_task(c.put_records(records, Durability.LOCAL))
            while len(srv.store) == 0:  # the first put began (the store marks it in flight)
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(1000):
                if len(srv.store) == len(records) and all(m is not None and m.acked for m in srv.store.metas(
                        srv.store.keys())):
                    break
                await asyncio.sleep(0.01)
            keys = srv.store.keys()
            assert len(keys) == len(records)
            assert await srv.ssd.contains(keys) == [True] * len(keys)
            assert sorted(srv.ssd._index) == sorted(keys)  # the tier holds nothing the store does not know
            for meta in srv.store.metas(keys):
                assert meta is not None and meta.acked and TierName.SSD in [t for t, _ in meta.resident]
            got = await c.get_records(keys)
            assert sorted(r.payload[:1] for r in got if r is not None) == [bytes([i]) for i in range(len(records))]


def test_blocking_client(tmp_path: Path) -> None:
    async def start() -> StateStoreServer:
        srv = StateStoreServer(config(tmp_path))
        await srv.start()
        return srv

    loop = asyncio.new_event_loop()
    srv = loop.run_until_complete(start())
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with SyncStateStoreClient(f"127.0.0.1:{srv.port}") as c:
            r = make_record(1, 1, b"q" * 3000, model_fingerprint=srv.adapter.model_fingerprint, tenant_id=bytes(16),
                            block_key=b"\x03" * 32)
            assert c.put_records([r])[0].tiers == ("host",)
            (got,) = c.get_records([r.key])
            assert got is not None and got.payload == r.payload
            assert c.health() == "SERVING"
            with pytest.raises(AttributeError, match="generate_stream"):
                c.generate_stream
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def test_shared_put_with_redis_down_is_unavailable_and_local_data_is_kept(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with StateStoreServer(config(tmp_path, redis_url=f"redis://127.0.0.1:{port}/0")) as srv:
        async with StateStoreClient(f"127.0.0.1:{srv.port}") as c:
            local = make_record(1, 1, b"l" * 500, model_fingerprint=srv.adapter.model_fingerprint,
                                tenant_id=bytes(16), block_key=b"\x01" * 32)
            await c.put_records([local], Durability.LOCAL)
            shared = make_record(1, 1, b"s" * 500, model_fingerprint=srv.adapter.model_fingerprint,
                                 tenant_id=bytes(16), block_key=b"\x02" * 32)
            with pytest.raises(ServiceError) as info:
                await c.put_records([shared], Durability.SHARED)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert "the redis tier is unavailable" in info.value.message and "lower durability" in info.value.message
            (got,) = await c.get_records([local.key])
            assert got is not None and got.payload == local.payload
            assert (await c.lookup([b"\x01" * 32], kinds=[1])).combined_blocks == 1  # Redis down: a miss, not an error


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary to make a certificate")
async def test_tls_when_a_certificate_is_configured(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=30)
    async with StateStoreServer(config(tmp_path / "d", tls_cert=cert, tls_key=key)) as srv:
        target = f"127.0.0.1:{srv.port}"
        async with StateStoreClient(target, options=ClientOptions(root_certificates=cert.read_bytes())) as c:
            assert await c.health() == "SERVING"
            assert (await c.stats()).model_name == "ced-mini"
        async with StateStoreClient(target, options=ClientOptions(timeout_s=3)) as plain:
            with pytest.raises(ServiceError) as info:
                await plain.stats()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE


async def test_failed_bind_releases_the_data_dir(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
            await StateStoreServer(config(tmp_path, listen=f"127.0.0.1:{port}")).start()
    async with StateStoreServer(config(tmp_path)) as srv:  # the SSD directory lock was released
        async with StateStoreClient(f"127.0.0.1:{srv.port}") as c:
            assert await c.health() == "SERVING"
