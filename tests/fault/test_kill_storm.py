"""SIGKILL of the server during a storm of concurrent checkpoints.

32 sessions append messages and checkpoint (LOCAL) concurrently through one `statestore serve`
process. Once every session has an acknowledged checkpoint, the server is frozen (SIGSTOP)
until a put is visibly in flight (a temp file of the SSD tier exists) and SIGKILLed there.
After a restart on the same data directory (in this process: a child's start costs seconds of
imports on 2 cores; tests/integration/test_server_restart.py restarts the CLI itself):

- the start-up scan reports what it discarded (log lines and `StateStoreServer.open_report`):
  exactly the temp files that were in flight, removed, plus at most torn files of
  unacknowledged puts, quarantined;
- every record the server indexes reads back whole (checksums verified): none is torn;
- every session resumes at its last acknowledged checkpoint, or at the one in flight when the
  kill came after its manifest was durable but before the reply, and an `exact` resume
  continues token for token like an uninterrupted run of the same messages.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from statestore.client import ServiceError, StateStoreClient
from statestore.config import ServiceConfig
from statestore.server import StateStoreServer
from statestore.types import Durability, TierName
from tests.fault.nodes import BLOCK_SIZE, Node, NodeSet
from tests.proc import freeze, thaw

pytestmark = [pytest.mark.subprocess, pytest.mark.timeout(90), pytest.mark.usefixtures("one_torch_thread")]

NUM_SESSIONS = 32
NUM_CONVERSATIONS = 4  # session s speaks conversation s % 4: fewer uninterrupted runs to compare with
MAX_MESSAGES = 40
CONTINUE_TOKENS = 4


def message(conversation: int, k: int) -> list[int]:
    """Message k of a conversation: 9..48 tokens, so checkpoints cross blocks of 64 at varied points."""
    rng = random.Random(1000 * conversation + k)
    return [rng.randrange(256) for _ in range(9 + (7 * k + 5 * conversation) % 40)]


def tokens_after(conversation: int, num_messages: int) -> int:
    return sum(len(message(conversation, k)) for k in range(num_messages))


@dataclass
class Storm:
    """What the clients saw: per session the acknowledged checkpoints and the one in flight."""

    acks: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)  # sid -> [(messages, T, version)]
    in_flight: dict[str, tuple[int, int]] = field(default_factory=dict)  # sid -> (messages, T) being checkpointed
    errors: dict[str, ServiceError] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def acked_sessions(self) -> int:
        return sum(1 for acks in self.acks.values() if acks)


async def run_session(c: StateStoreClient, sid: str, conversation: int, storm: Storm) -> None:
    storm.acks[sid] = []
    try:
        await c.create_session(sid)
        for k in range(MAX_MESSAGES):
            if storm.stop.is_set():
                return
            info = await c.append(sid, message(conversation, k))
            storm.in_flight[sid] = (k + 1, info.num_tokens)
            report = await c.checkpoint(sid, Durability.LOCAL)
            storm.acks[sid].append((k + 1, report.num_tokens, report.version))
            del storm.in_flight[sid]
    except ServiceError as exc:  # the server died under the call
        storm.errors[sid] = exc


def run_storm(target: str, storm: Storm) -> None:
    async def main() -> None:
        async with StateStoreClient(target) as c:
            await asyncio.gather(*(run_session(c, f"s{i:02d}", i % NUM_CONVERSATIONS, storm)
                                   for i in range(NUM_SESSIONS)))

    asyncio.run(main())


def kill_with_a_put_in_flight(node: Node, ssd: Path, attempts: int = 3000) -> list[str]:
    """Freeze the server until a temp file shows a put in flight, then SIGKILL it; the temp files."""
    for _ in range(attempts):
        freeze(node.pid)
        temps = sorted(str(p.relative_to(ssd)) for p in ssd.glob("??/??/*.tmp"))
        if temps:
            assert node.kill() == -signal.SIGKILL
            return temps
        thaw(node.pid)
        time.sleep(0.002)
    raise AssertionError("never caught the server with a put in flight")


async def test_sigkill_during_a_checkpoint_storm(nodes: NodeSet, caplog: pytest.LogCaptureFixture) -> None:
    node = nodes.make("node").start().wait_ready()
    storm = Storm()
    clients = threading.Thread(target=run_storm, args=(node.target, storm))
    clients.start()
    try:
        deadline = time.monotonic() + 40
        while storm.acked_sessions() < NUM_SESSIONS or sum(map(len, storm.acks.values())) < 2 * NUM_SESSIONS:
            assert clients.is_alive() and time.monotonic() < deadline, f"storm stalled: {storm.errors}"
            await asyncio.sleep(0.02)
        temps = kill_with_a_put_in_flight(node, node.data_dir / "ssd")
    finally:
        storm.stop.set()
        clients.join(timeout=30)
    assert all(e.code.name == "UNAVAILABLE" for e in storm.errors.values()), storm.errors
    num_acks = sum(map(len, storm.acks.values()))
    print(f"\nkilled after {num_acks} acknowledged checkpoints, {len(storm.in_flight)} in flight, temps {temps}")

    caplog.set_level(logging.WARNING, logger="statestore.server")
    server = StateStoreServer(ServiceConfig(listen="127.0.0.1:0", data_dir=node.data_dir, engine_preset="mini",
                                            block_size=BLOCK_SIZE, grace_s=0))
    await server.start()
    try:
        discarded = server.open_report.discarded[TierName.SSD]
        logged = [r.getMessage() for r in caplog.records if r.name == "statestore.server"]
        assert logged == [f"ssd scan discarded {d}" for d in discarded]
        removed = sorted(line.split(": ", 1)[0] for line in discarded if line.endswith("(removed)"))
        assert removed == temps, discarded
        torn = [line for line in discarded if not line.endswith("(removed)")]
        # A new key is written in place (create, write, fdatasync): the kill can leave its file
        # empty or short of a header as well as short of its payload. Each is quarantined.
        torn_shapes = r": (file is \d+ bytes but the header says \d+|truncated header: \d+ of 168 bytes) \(quarantined\)$"
        assert all(re.search(torn_shapes, t) for t in torn), torn
        await check_after_restart(f"127.0.0.1:{server.port}", storm)
    finally:
        await server.stop(0)


async def check_after_restart(target: str, storm: Storm) -> None:
    async with StateStoreClient(target) as c:
        assert await c.health() == "SERVING"
        records, truncated = await c.list_records(limit=100_000)
        assert not truncated and records
        got = await c.get_records([r.key for r in records])  # from the SSD tier: host RAM is empty
        assert [g is not None for g in got] == [True] * len(records), "a record indexed at start-up did not verify"

        resumed: dict[str, tuple[int, list[int]]] = {}
        for i in range(NUM_SESSIONS):
            sid = f"s{i:02d}"
            messages, t_acked, version = storm.acks[sid][-1]
            info = await c.get_session(sid)
            if info.checkpoint_version != version:  # the kill came after the manifest, before the reply
                assert (info.checkpoint_version, info.checkpointed_tokens) == (version + 1, storm.in_flight[sid][1])
                messages, t_acked = storm.in_flight[sid]
            assert info.checkpointed_tokens == t_acked == tokens_after(i % NUM_CONVERSATIONS, messages)
            assert len(info.message_boundaries) == messages
            report = await c.resume(sid, "exact")
            assert (report.mode, report.num_tokens, report.persisted_tokens) == ("exact", t_acked, t_acked)
            resumed[sid] = (messages, await c.generate(sid, CONTINUE_TOKENS))

        expected: dict[tuple[int, int], list[int]] = {}
        for i in range(NUM_SESSIONS):
            messages, tokens = resumed[f"s{i:02d}"]
            conversation = i % NUM_CONVERSATIONS
            if (conversation, messages) not in expected:
                ref = f"ref-{conversation}-{messages}"
                await c.create_session(ref)
                for k in range(messages):
                    await c.append(ref, message(conversation, k))
                expected[conversation, messages] = await c.generate(ref, CONTINUE_TOKENS)
            assert tokens == expected[conversation, messages], f"s{i:02d} after {messages} messages"
