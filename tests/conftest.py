"""Shared test fixtures: real Redis servers, free ports.

The Redis on 127.0.0.1:6379 (or --redis-url) is probed once per session. On a user's machine
without Redis its tests skip with a reason; in CI (STATESTORE_REQUIRE_REDIS=1, set by .ci/run)
a missing Redis fails the run instead of silently skipping.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis-url", default=os.environ.get("STATESTORE_TEST_REDIS_URL", DEFAULT_REDIS_URL),
                     help="Redis for the tests that need a running server")


def _probe_redis(url: str) -> str | None:
    """None when Redis answers PING, else why not."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        client.ping()
        client.close()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable Redis"
        return f"{type(exc).__name__}: {exc}"


def _redis_required() -> bool:
    return os.environ.get("STATESTORE_REQUIRE_REDIS") == "1"


@pytest.fixture(scope="session")
def redis_url(pytestconfig: pytest.Config) -> str:
    """URL of the shared Redis server; skips (or fails in CI) when there is none."""
    url = pytestconfig.getoption("--redis-url")
    problem = _probe_redis(url)
    if problem:
        if _redis_required():
            pytest.fail(f"Redis required (STATESTORE_REQUIRE_REDIS=1) but {url} is unusable: {problem}")
        pytest.skip(f"no Redis at {url}: {problem}")
    return url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisProcess:
    """A redis-server the test owns: it can stop and restart it to simulate outages."""

    port: int
    data_dir: Path
    args: list[str]
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log"), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if _probe_redis(self.url) is None:
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start; see {self.data_dir / 'redis.log'}")

    def stop(self) -> None:
        """Graceful stop (SHUTDOWN saves an RDB when persistence is on)."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_process_factory(tmp_path: Path) -> Iterator[Callable[..., RedisProcess]]:
    """Start private redis-server instances (own port, own dir); all are stopped at teardown."""
    if shutil.which("redis-server") is None:
        if _redis_required():
            pytest.fail("redis-server is not installed but STATESTORE_REQUIRE_REDIS=1")
        pytest.skip("redis-server is not installed")
    started: list[RedisProcess] = []

    def make(*args: str, persistent: bool = False) -> RedisProcess:
        data_dir = tmp_path / f"redis-{len(started)}"
        data_dir.mkdir()
        extra = ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--save", "", "--appendonly", "no"]
        proc = RedisProcess(port=free_port(), data_dir=data_dir, args=[*extra, *args])
        proc.start()
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.kill()
