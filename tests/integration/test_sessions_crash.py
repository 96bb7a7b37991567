"""A SIGKILL in the middle of a session checkpoint leaves the previous checkpoint resumable.

The child (`session_checkpoint_child.py`) appends a message and checkpoints, over and over, on
a real SSD tier, printing "ack" only after each checkpoint returned. The test stops it
(SIGSTOP) at instants when a put of a checkpoint is in flight (a temp file of the SSD tier
exists between the child's "begin k" and its "ack k") and SIGKILLs it there, so the kill
provably lands mid-checkpoint. A new manager over a new store in this process then finds the
last acknowledged checkpoint (the manifest is the checkpoint's last put, so a put in flight
means the new manifest is not durable), resumes it `exact` in a new engine and continues
exactly like an uninterrupted engine fed the same messages. A second child resumes from there
and is killed later inside its checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.proc import freeze, thaw
from engine_adapter.ced import CEDEngine, mini
from engine_adapter.ced.adapter import CEDAdapter
from statestore.sessions import SessionConfig, SessionInfo, SessionManager
from statestore.store import TieredStore
from tiers.host import HostTier
from tiers.ssd import SSDTier

CHILD = Path(__file__).with_name("session_checkpoint_child.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
SESSION = "agent-7"
MAX_MESSAGES = 60  # the child stops there if never killed (the test then fails)

pytestmark = pytest.mark.subprocess

sys.path.insert(0, str(CHILD.parent))
from session_checkpoint_child import BLOCK, SECRET, SEED, TENANT, message_tokens  # noqa: E402


@dataclass(frozen=True, slots=True)
class Killed:
    """What the child printed before it was killed, and what was in flight."""

    ready: tuple[int, int]  # (T, version) the child started from
    acks: list[tuple[int, int, int]]  # (message k, T, version), in order
    in_flight: tuple[int, int]  # (message k, T) whose checkpoint the kill interrupted
    temps: list[str]  # temp files of puts in flight at the kill


def _kill_when_a_put_is_in_flight(pid: int, root: Path, skip: int, attempts: int = 2000) -> list[str]:
    """SIGSTOP the child until a temp file shows a put in flight (the `skip`+1-th time), then SIGKILL."""
    for _ in range(attempts):
        freeze(pid)
        temps = sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))
        if temps:
            if skip == 0:
                os.kill(pid, signal.SIGKILL)
                return temps
            skip -= 1
        thaw(pid)
        time.sleep(0.001)
    raise AssertionError("never caught the child with a checkpoint put in flight")


def run_child_and_kill(root: Path, from_message: int, skip: int) -> Killed:
    """Start the child, let it checkpoint up to message `from_message`, kill it inside that (or a
    later) checkpoint while a put is in flight."""
    stderr_path = root.parent / f"child-{from_message}.stderr"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, str(CHILD), str(root), SESSION, str(MAX_MESSAGES)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO_ROOT)
    lines: list[list[str]] = []
    try:
        assert proc.stdout is not None
        while not (lines and lines[-1][0] == "begin" and int(lines[-1][1]) >= from_message):
            line = proc.stdout.readline()
            assert line, f"child exited early ({proc.wait()}) after {lines}: {stderr_path.read_text()}"
            lines.append(line.split())
        temps = _kill_when_a_put_is_in_flight(proc.pid, root, skip)
        assert proc.wait() == -signal.SIGKILL
        lines += [line.split() for line in proc.stdout.read().splitlines()]  # already in the pipe
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert lines[0][0] == "ready" and lines[-1][0] == "begin", lines  # killed between a begin and its ack
    acks = [(int(k), int(t), int(v)) for tag, k, t, v in (x for x in lines if x[0] == "ack")]
    return Killed((int(lines[0][1]), int(lines[0][2])), acks, (int(lines[-1][1]), int(lines[-1][2])), temps)


def uninterrupted(num_messages: int, n: int) -> tuple[torch.Tensor, list[int]]:
    """A fresh engine fed messages 0..num_messages-1 as the child did: last logits and n greedy tokens."""
    adapter = CEDAdapter(CEDEngine(mini(), seed=SEED, dtype=torch.float64))
    state = adapter.new_state()
    for k in range(num_messages):
        adapter.append(state, message_tokens(k))
    logits = state.last_logits.clone()
    return logits, adapter.generate(state, n)


async def resume_and_continue(root: Path, killed: Killed) -> SessionInfo:
    """New store over the directory, new engine: resume the last ack exactly and continue.

    (Appending on top of a resumed state is what the next child does; its checkpoint is checked
    against the uninterrupted run by the next call.)
    """
    k_ack, t_ack, version = killed.acks[-1]
    ssd = await SSDTier.create(root)  # scans the directory: temp files of torn puts are removed
    store = TieredStore(host=HostTier(64 << 20), ssd=ssd)
    await store.open()
    adapter = CEDAdapter(CEDEngine(mini(), seed=SEED, dtype=torch.float64))
    sessions = SessionManager(store, adapter, SessionConfig(secret=SECRET, block_size=BLOCK))
    try:
        assert ssd.last_scan is not None and sorted(ssd.last_scan.discarded) == [
            f"{t}: leftover temp file of an unacknowledged put (removed)" for t in killed.temps]
        assert not list(root.rglob("*.tmp"))
        info = await sessions.get(TENANT, SESSION)
        assert (info.checkpoint_version, info.checkpointed_tokens, len(info.message_boundaries)) == (
            version, t_ack, k_ack + 1)
        report = await sessions.resume(TENANT, SESSION, "exact")
        assert (report.mode, report.num_tokens, report.persisted_tokens) == ("exact", t_ack, t_ack)
        ref_logits, ref_tokens = uninterrupted(k_ack + 1, 8)
        logits = sessions.live_state(TENANT, SESSION).last_logits  # type: ignore[attr-defined]
        assert float((logits - ref_logits).abs().max()) <= 1e-12
        assert await sessions.generate(TENANT, SESSION, 8) == ref_tokens
        return info
    finally:
        await sessions.aclose()
        await store.aclose()


def test_sigkill_mid_checkpoint_leaves_the_last_acknowledged_checkpoint_resumable(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    first = run_child_and_kill(root, from_message=3, skip=0)
    assert first.ready == (0, 0) and len(first.acks) >= 3
    assert first.in_flight[0] == first.acks[-1][0] + 1  # the kill interrupted the next checkpoint
    info = asyncio.run(resume_and_continue(root, first))
    print(f"\nround 1: killed in checkpoint of message {first.in_flight[0]} (T={first.in_flight[1]}) with "
          f"{first.temps} in flight; resumed v{info.checkpoint_version} at T={info.checkpointed_tokens}")

    # The parent did not checkpoint: a second child resumes the same checkpoint and goes on.
    k_ack, t_ack, version = first.acks[-1]
    second = run_child_and_kill(root, from_message=k_ack + 3, skip=2)
    assert second.ready == (t_ack, version)
    assert [a[0] for a in second.acks][:1] == [k_ack + 1]  # continued with the next message
    assert second.acks[-1][2] > version
    info = asyncio.run(resume_and_continue(root, second))
    print(f"round 2: killed in checkpoint of message {second.in_flight[0]} (T={second.in_flight[1]}) with "
          f"{second.temps} in flight; resumed v{info.checkpoint_version} at T={info.checkpointed_tokens}")
