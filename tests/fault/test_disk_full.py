"""The SSD tier's file system fills up under the service.

The SSD directory is a 4 MiB tmpfs (else a 4 MiB loop-mounted ext4; the test runs as root). With
no SSD byte budget configured, the file system itself refuses: LOCAL puts then fail with
RESOURCE_EXHAUSTED and a message that says the device is full; nothing torn or half-written is
left behind (no temp file; every record file verifies; a restart's scan discards nothing),
reads and MEMORY puts keep working, and freeing records makes room again.

Mounting needs root (or CAP_SYS_ADMIN): elsewhere the test skips with the reason, except in CI
(CI=true), where it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from statestore.client import ServiceError, StateStoreClient
from statestore.server import StateStoreServer
from statestore.types import Durability, TierName
from tests.service import start_mini_server
from tiers.record import Record, decode_record, make_record

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

FS_BYTES = 4 << 20
RECORD_BYTES = 192 << 10


def _mount_small_fs(where: Path, scratch: Path) -> str:
    """Mount a FS_BYTES file system at `where`; returns how. Raises OSError when impossible."""
    size = f"size={FS_BYTES // (1 << 20)}m"
    tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(where)], capture_output=True, text=True)
    if tmpfs.returncode == 0:
        return "tmpfs"
    image = scratch / "ssd.img"
    with image.open("wb") as f:
        f.truncate(FS_BYTES)
    for cmd in (["mkfs.ext4", "-q", "-F", str(image)], ["mount", "-o", "loop", str(image), str(where)]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"cannot mount a small file system: tmpfs: {tmpfs.stderr.strip()}; "
                          f"{cmd[0]}: {done.stderr.strip()}")
    return "ext4 on loop"


@pytest.fixture
def small_ssd_dir(tmp_path: Path) -> Iterator[Path]:
    """<tmp>/data/ssd on its own 4 MiB file system, unmounted at teardown."""
    data_dir = tmp_path / "data"
    ssd = data_dir / "ssd"
    ssd.mkdir(parents=True)
    if shutil.which("mount") is None:
        problem = "no mount command"
    else:
        try:
            kind = _mount_small_fs(ssd, tmp_path)
            problem = ""
        except OSError as exc:
            problem = str(exc)
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"disk-full test cannot run in CI: {problem}")
        pytest.skip(f"disk-full test needs a small mounted file system: {problem}")
    print(f"\nSSD dir on a {FS_BYTES >> 20} MiB {kind}")
    try:
        yield data_dir
    finally:
        subprocess.run(["umount", "-l", str(ssd)], check=False, capture_output=True)


@pytest.fixture
async def server(small_ssd_dir: Path) -> AsyncIterator[StateStoreServer]:
    srv = await start_mini_server(small_ssd_dir)
    try:
        yield srv
    finally:
        await srv.stop(0)


def record(server: StateStoreServer, i: int, nbytes: int = RECORD_BYTES) -> Record:
    return make_record(1, 1, os.urandom(nbytes), model_fingerprint=server.adapter.model_fingerprint,
                       tenant_id=bytes(16), block_key=i.to_bytes(32, "big"), token_start=64 * i, token_end=64 * i + 64)


def record_files(ssd: Path) -> tuple[list[Path], list[Path]]:
    """(record files, anything else) under the tier's fan-out directories."""
    files = [p for p in ssd.glob("??/??/*") if p.is_file()]
    return [p for p in files if p.suffix == ".rec"], [p for p in files if p.suffix != ".rec"]


async def test_disk_full_refuses_local_puts_cleanly_and_keeps_serving(server: StateStoreServer) -> None:
    ssd = server.config.ssd_dir
    async with StateStoreClient(f"127.0.0.1:{server.port}") as c:
        stored = []
        for i in range(1, 4 * FS_BYTES // RECORD_BYTES):
            r = record(server, i)
            try:
                await c.put_records([r], Durability.LOCAL)
            except ServiceError as exc:
                refused = exc
                break
            stored.append(r)
        else:
            raise AssertionError(f"{len(stored)} records of {RECORD_BYTES} B fit a {FS_BYTES} B file system")
        assert 5 <= len(stored) < FS_BYTES // RECORD_BYTES, len(stored)
        assert refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert refused.message.startswith(f"LOCAL put of {record(server, len(stored) + 1).key.hex()} not acknowledged: "
                                          "the file system under the ssd tier refused the write (no space left on "
                                          "device"), refused.message
        assert "no ssd byte budget configured" in refused.message, refused.message

        # Nothing half-written: no temp file, every record file is whole and verifies.
        recs, others = record_files(ssd)
        assert others == [] and len(recs) == len(stored)
        for path in recs:
            decode_record(path.read_bytes())

        # The service keeps serving: reads from the SSD (host copies dropped first), MEMORY puts.
        await c.evict([r.key for r in stored], tiers=["host"])
        got = await c.get_records([r.key for r in stored])
        assert [g.payload if g else None for g in got] == [r.payload for r in stored]
        await c.put_records([record(server, 10_000, 4096)], Durability.MEMORY)
        assert await c.health() == "SERVING"

        # Freeing records makes room again.
        await c.evict([r.key for r in stored[:3]])
        await c.put_records([record(server, 20_000)], Durability.LOCAL)
        kept = len(stored) - 3 + 1

    # A restart's scan finds exactly the records, and discards nothing.
    await server.stop(0)
    again = await start_mini_server(server.config.data_dir)
    try:
        assert again.open_report.discarded.get(TierName.SSD) == []
        assert again.open_report.indexed[TierName.SSD] == kept
    finally:
        await again.stop(0)
