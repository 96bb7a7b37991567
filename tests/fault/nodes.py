"""`statestore serve` child processes for the multi-node and fault tests.

A `Node` is one server process (`python -m statestore.cli serve`, `mini` engine, port 0) with
its own data directory. Its stdout and stderr go to a log file, never to a pipe (a server that
logs many warnings while nobody reads a pipe would block), and the port comes from the ready
line in that file. Every node gets the same service secret before its first start: tenant key
salts, block keys and session keys derive from it, so nodes that are to resume each other's
sessions must share it (what an operator does by provisioning `<data dir>/secret`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"multi-node-test-secret-0123456789"  # 33 bytes (16..64 allowed)
BLOCK_SIZE = 64
_READY = re.compile(r"statestore serving on 127\.0\.0\.1:(\d+)")


class Node:
    """One `statestore serve` process; `start()` returns at once, `wait_ready()` waits for the port."""

    def __init__(self, data_dir: Path, *, redis_url: str = "", redis_prefix: str = "ss",
                 extra_env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.redis_url = redis_url
        self.redis_prefix = redis_prefix
        self.extra_env = dict(extra_env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = ""
        self.starts = 0
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    def start(self) -> Node:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        secret = self.data_dir / "secret"
        if not secret.exists():
            secret.write_bytes(SECRET)
            secret.chmod(0o600)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "STATESTORE_SESSIONS_BLOCK_SIZE": str(BLOCK_SIZE), "STATESTORE_SERVER_GRACE_S": "1",
               "STATESTORE_STORAGE_REDIS_URL": self.redis_url, "STATESTORE_STORAGE_REDIS_PREFIX": self.redis_prefix,
               **self.extra_env}
        self.starts += 1
        with self.log_path.open("a") as log:
            log.write(f"----- start {self.starts} -----\n")
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "statestore.cli", "serve", "--listen", "127.0.0.1:0",
                 "--data-dir", str(self.data_dir), "--preset", "mini"],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.target = ""
        return self

    def run_log(self) -> str:
        """The output of the current (last) run of the process."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text.rsplit(f"----- start {self.starts} -----\n", 1)[-1]

    def wait_ready(self, timeout_s: float = 60.0) -> Node:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while True:
            match = _READY.search(self.run_log())
            if match:
                self.target = f"127.0.0.1:{match.group(1)}"
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode} before serving:\n{self.run_log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"server not serving after {timeout_s} s:\n{self.run_log()}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> int:
        """SIGKILL (continued first if stopped, so it dies at once) and reap; the exit status."""
        if self.proc is None:
            return 0
        self.signal(signal.SIGKILL)
        code = self.proc.wait(timeout=30)
        self.proc = None
        return code

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (graceful) and reap; SIGKILL if it does not exit in time."""
        if self.proc is None:
            return 0
        self.signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        return code

    def discard_lines(self) -> list[str]:
        """What the current run's start-up scan discarded, as the server logged it."""
        return [line.split("scan discarded ", 1)[1] for line in self.run_log().splitlines()
                if "scan discarded " in line]


def start_all(nodes: Sequence[Node]) -> None:
    """Start the processes together (their imports overlap) and wait until all serve."""
    for node in nodes:
        node.start()
    for node in nodes:
        node.wait_ready()


class NodeSet:
    """The nodes a test made; every one still running is killed at teardown."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.nodes: list[Node] = []

    def make(self, name: str, **kwargs: object) -> Node:
        node = Node(self.base / name, **kwargs)  # type: ignore[arg-type]
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()


def node_set(base: Path) -> Iterator[NodeSet]:
    """Generator body of a `nodes` fixture."""
    nodes = NodeSet(base)
    try:
        yield nodes
    finally:
        nodes.close()


class RedisServer:
    """A private redis-server for fixtures wider than one test (tests/conftest.py's
    `redis_process_factory` is per test): own port, own directory, optional AOF."""

    def __init__(self, data_dir: Path, *, persistent: bool = False) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.data_dir = data_dir
        self.persistent = persistent
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import redis

        self.data_dir.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else \
            ["--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log"), *persistence],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as client:
                    client.ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
