"""A checkpoint acknowledged through the service survives `kill -9` of the server process:
the server (`python -m statestore.cli serve`) is SIGKILLed, restarted on the same data dir,
and an `exact` resume through the service continues with the same tokens as an
uninterrupted run. Also: SIGTERM stops the server gracefully (exit 0)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from statestore.client import StateStoreClient
from statestore.spawn import spawn_serve
from statestore.types import Durability

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`statestore serve` in a child process on a free port; the port comes from its ready line."""

    def __init__(self, data_dir: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "STATESTORE_SESSIONS_BLOCK_SIZE": "64"}
        self.proc, port = spawn_serve(data_dir, env=env, cwd=ROOT)
        self.target = f"127.0.0.1:{port}"

    def stop(self, sig: int = signal.SIGKILL) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.stop()
        if server.proc.stdout is not None:
            server.proc.stdout.close()


def conversation() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(n)] for n in (100, 45, 130)]


async def run_session(target: str, sid: str, checkpoint: bool) -> list[int] | None:
    async with StateStoreClient(target) as c:
        await c.create_session(sid)
        for message in conversation():
            await c.append(sid, message)
        if checkpoint:
            report = await c.checkpoint(sid, Durability.LOCAL)
            assert report.num_tokens == 275
            return None
        return await c.generate(sid, 10)


def test_checkpoint_survives_sigkill_and_exact_resume_continues_identically(tmp_path: Path,
                                                                            spawn: list[ServerProcess]) -> None:
    first = ServerProcess(tmp_path / "data")
    spawn.append(first)
    expected = asyncio.run(run_session(first.target, "uninterrupted", checkpoint=False))
    asyncio.run(run_session(first.target, "agent", checkpoint=True))
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL

    second = ServerProcess(tmp_path / "data")
    spawn.append(second)

    async def resume() -> tuple[object, list[int], object]:
        async with StateStoreClient(second.target) as c:
            info = await c.get_session("agent")
            report = await c.resume("agent", "exact")
            return info, await c.generate("agent", 10), report

    info, tokens, report = asyncio.run(resume())
    assert (info.live, info.checkpoint_version, info.checkpointed_tokens) == (False, 1, 275)  # type: ignore[attr-defined]
    assert report.mode == "exact" and report.num_tokens == 275  # type: ignore[attr-defined]
    assert tokens == expected
    assert second.stop(signal.SIGTERM) == 0  # graceful: health NOT_SERVING, stop(grace), exit 0
