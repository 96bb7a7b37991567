"""Bit flips and truncations in the SSD tier's files: detected by checksum, quarantined, never served.

An in-process server (host RAM + SSD under tmp_path, `mini` engine) holds LOCAL records and a
LOCAL session checkpoint. The test damages record files behind its back, drops the host-RAM
copies (Evict tiers=["host"]) so that reads go to the SSD, and checks what clients see:

- while it runs: a payload bit flip, a header bit flip, a truncation and a flip in a large
  (O_DIRECT) record are each caught by the read (payload or header checksum, size), the file is
  moved to quarantine/ and the client gets a miss, never other bytes; a damaged block of a
  checkpoint is recomputed by an `exact` resume, which continues like an uninterrupted run;
- across a restart: the start-up scan quarantines what it can see from headers and sizes (a
  header flip, a truncation) and reports it (StateStoreServer.open_report, the log); a payload
  flip it cannot see is caught by the first read; a damaged checkpoint tail is replayed.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from statestore.client import StateStoreClient
from statestore.server import StateStoreServer
from statestore.types import Durability, TierName
from tests.service import start_mini_server
from tiers import ssd_snapshot
from tiers.record import HEADER_SIZE, Record, make_record
from tiers.ssd import SSDLayout

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

SIZES = [8192] * 3 + [300 << 10] + [8192] * 5  # record 3 is read with O_DIRECT
MESSAGES = [[(37 * i + 11 * s) % 256 for i in range(n)] for s, n in ((1, 150), (2, 37), (3, 101))]  # 288 tokens


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[list[StateStoreServer]]:
    """Servers the test starts (one data directory); all are stopped at teardown."""
    started: list[StateStoreServer] = []
    yield started
    for server in started:
        await server.stop(0)


def make(server: StateStoreServer, i: int) -> Record:
    payload = bytes((i * 7 + j) % 251 for j in range(256)) * (SIZES[i] // 256)
    return make_record(1, 1, payload, model_fingerprint=server.adapter.model_fingerprint, tenant_id=bytes(16),
                       block_key=bytes([0xC0 + i]) * 32, token_start=100_000 + 64 * i, token_end=100_064 + 64 * i)


def flip(path: Path, offset: int) -> None:
    """Flip one bit of the byte at `offset` (negative: from the end)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path, nbytes: int) -> None:
    os.truncate(path, path.stat().st_size - nbytes)


def quarantined(server: StateStoreServer) -> list[str]:
    """Names of the quarantined files, without the time suffix the move adds."""
    return sorted(p.name.rsplit(".", 1)[0] for p in (server.config.ssd_dir / "quarantine").iterdir())


async def session_and_reference(c: StateStoreClient) -> list[int]:
    """Checkpoint "agent" (LOCAL) and drop it from memory; the uninterrupted run's next 10 tokens."""
    await c.create_session("agent")
    await c.create_session("uninterrupted")
    for m in MESSAGES:
        await c.append("agent", m)
        await c.append("uninterrupted", m)
    report = await c.checkpoint("agent", Durability.LOCAL)
    assert (report.num_tokens, report.new_blocks) == (288, 4)
    await c.drop_session("agent")
    return await c.generate("uninterrupted", 10)


async def session_file(c: StateStoreClient, layout: SSDLayout, token_start: int) -> Path:
    """The GLOBAL_KV record file of the checkpoint that starts at `token_start` (a block or the tail)."""
    records, _ = await c.list_records(kind=1)
    (key,) = [r.key for r in records if r.token_start == token_start and r.token_start < 100_000]
    return layout.path(key)


async def resume_continues(c: StateStoreClient, expected: list[int], replayed_from: int) -> None:
    """Resume "agent" exactly from the SSD, checkpoint it again (rewriting what was lost), and
    check that it continues like the uninterrupted run."""
    records, _ = await c.list_records()
    await c.evict([r.key for r in records], tiers=["host"])  # a resume reads the SSD
    report = await c.resume("agent", "exact")
    assert (report.mode, report.num_tokens, report.persisted_tokens) == ("exact", 288, replayed_from)
    await c.checkpoint("agent", Durability.LOCAL)
    assert await c.generate("agent", 10) == expected
    await c.drop_session("agent")


@pytest.mark.parametrize("index_snapshot", [False, True], ids=["full-scan", "index-snapshot"])
async def test_corrupt_files_are_quarantined_and_never_served(tmp_path: Path, servers: list[StateStoreServer],
                                                             index_snapshot: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Damage while the server runs is caught by the read; damage while it is stopped by the
    start-up scan, or, where the clean stop saved the SSD index (`tiers.ssd_snapshot`: the
    damage is inside files, which the directories do not show), by the first read: either
    way no damaged byte is served."""
    data_dir = tmp_path / "data"
    server = await start_mini_server(data_dir)
    servers.append(server)
    layout = SSDLayout(server.config.ssd_dir)
    records = [make(server, i) for i in range(len(SIZES))]
    paths = [layout.path(r.key) for r in records]

    async with StateStoreClient(f"127.0.0.1:{server.port}") as c:
        await c.put_records(records, Durability.LOCAL)
        expected = await session_and_reference(c)
        await c.evict([r.key for r in records], tiers=["host"])

        # While the server runs.
        flip(paths[0], HEADER_SIZE + 5000)  # payload
        flip(paths[1], 40)  # header (model fingerprint field)
        truncate(paths[2], 100)
        flip(paths[3], -1)  # last byte of a large record
        flip(await session_file(c, layout, 64), HEADER_SIZE + 10)  # block 1 of the checkpoint
        got = await c.get_records([r.key for r in records])
        assert [g.payload if g else None for g in got] == [None] * 4 + [r.payload for r in records[4:]]
        assert quarantined(server) == sorted(p.name for p in paths[:4])
        assert await c.get_records([r.key for r in records[:4]]) == [None] * 4  # still misses, no error
        assert all(not p.exists() for p in paths[:4])
        await resume_continues(c, expected, replayed_from=64)  # block 1 quarantined: replayed from there
        assert len(quarantined(server)) == 5
        tail = await session_file(c, layout, 256)

    # Across a restart. (No settling margin for the snapshot: the damage below is inside files,
    # which no directory stamp shows anyway, so every leaf comes from the snapshot.)
    monkeypatch.setattr(ssd_snapshot, "SETTLE_NS", 0)
    await server.stop(0)
    flip(paths[4], HEADER_SIZE + 1)  # payload: the scan reads headers only
    truncate(paths[5], 1)
    flip(paths[6], 2)  # magic
    flip(tail, HEADER_SIZE + 3)  # the checkpoint's tail (its payload)
    server = await start_mini_server(data_dir, ssd_index_snapshot=index_snapshot)
    servers.append(server)
    discarded = server.open_report.discarded[TierName.SSD]
    ssd = server.ssd
    if index_snapshot:
        assert discarded == [] and ssd.snapshot_use is not None and ssd.snapshot_use.leaves_scanned == 0
    else:
        assert len(discarded) == 2, discarded
        (short,) = [d for d in discarded if paths[5].name in d]
        assert short.endswith(f": file is {HEADER_SIZE + SIZES[5] - 1} bytes but the header says "
                              f"{HEADER_SIZE + SIZES[5]} (quarantined)"), short
        (magic,) = [d for d in discarded if paths[6].name in d]
        assert magic.endswith("(quarantined)") and "magic" in magic, magic
    async with StateStoreClient(f"127.0.0.1:{server.port}") as c:
        got = await c.get_records([r.key for r in records])
        assert [g.payload if g else None for g in got] == [None] * 7 + [r.payload for r in records[7:]]
        assert len(quarantined(server)) == 5 + 3  # 4 by the read; 5 and 6 by the scan, or by the read
        await resume_continues(c, expected, replayed_from=256)  # the tail is replayed
        assert len(quarantined(server)) == 5 + 3 + 1
