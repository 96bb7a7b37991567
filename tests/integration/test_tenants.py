"""Tenant isolation and quotas, end to end on loopback (port 0, the `mini` engine).

- With two tenants' tokens, neither can list, inspect, look up, fetch, pin, unpin, evict,
  overwrite, resume, plan, append to, checkpoint, drop or delete the other's sessions or
  records. The answers are the ones a tenant gets for things that do not exist (NOT_FOUND,
  a miss, an empty list, nothing evicted), so they do not reveal existence either; the one
  exception is documented in statestore.proto: a PutRecords of a key another tenant holds is
  PERMISSION_DENIED (the caller must already know the key, and session-layer keys are MAC'd
  with the tenant's secret salt, so they cannot be guessed).
- Identical prompts of two tenants never share blocks: the salted block keys differ, both
  are stored, and tenant B's lookup of tenant A's keys is a miss. That is also why hit/miss
  timing reveals nothing: B cannot even name A's key for a prompt.
- Session ids and record keys cannot name a path: hostile ids get INVALID_ARGUMENT, and every
  file the server wrote is a hex-named record (or its fixed files) inside the data dir.
- Per-tenant quotas (`[tenants.<name>] max_bytes / max_sessions`) give RESOURCE_EXHAUSTED with
  a message naming the quota and the numbers; other tenants are unaffected.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from proto.statestore.v1 import common_pb2
from statestore.client import StateStoreClient
from statestore.config import ConfigError, ServiceConfig, TenantQuota, load_config
from statestore.keys import tenant_id
from statestore.server import StateStoreServer
from statestore.types import Durability
from tests.service import assert_rejected, clients_for
from tiers.record import Record, encode_record, make_record

pytestmark = pytest.mark.timeout(90)

TOKENS = {"alice": "alice-token-0001", "bob": "bob-token-000002", "carol": "carol-token-0003",
          "dave": "dave-token-000004"}
BLOCK = 64
PROMPT = [random.Random(7).randrange(256) for _ in range(2 * BLOCK + 22)]  # two complete blocks and a tail
GLOBAL_KV, INDEX_K = 1, 2


def make_server_config(data_dir: Path, **changes: object) -> ServiceConfig:
    return ServiceConfig(listen="127.0.0.1:0", data_dir=data_dir, engine_preset="mini", tokens=TOKENS,
                         block_size=BLOCK, **changes)  # type: ignore[arg-type]


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[StateStoreServer]:
    async with StateStoreServer(make_server_config(tmp_path / "data")) as srv:
        yield srv


@pytest_asyncio.fixture
async def clients(server: StateStoreServer) -> AsyncIterator[dict[str, StateStoreClient]]:
    async with clients_for(server, TOKENS) as out:
        yield out


def record(server: StateStoreServer, block_key: bytes, nbytes: int = 1000, kind: int = GLOBAL_KV) -> Record:
    return make_record(kind, 1, os.urandom(nbytes), model_fingerprint=server.adapter.model_fingerprint,
                       tenant_id=bytes(16), block_key=block_key, token_start=0, token_end=BLOCK)


async def block_keys(c: StateStoreClient) -> list[bytes]:
    """The caller's complete-block keys (GLOBAL_KV records one block long), first block first."""
    records, _ = await c.list_records(kind=GLOBAL_KV)
    blocks = sorted((r for r in records if r.token_end - r.token_start == BLOCK), key=lambda r: r.token_start)
    return [r.key[2:] for r in blocks]


async def checkpointed(c: StateStoreClient, session_id: str, *, drop: bool = True) -> None:
    await c.create_session(session_id)
    await c.append(session_id, PROMPT)
    await c.checkpoint(session_id)
    if drop:
        await c.drop_session(session_id)


def session_calls(c: StateStoreClient, sid: str) -> list[Callable[[], Awaitable[object]]]:
    """Every Sessions RPC on `sid` but Create and List."""
    return [lambda: c.get_session(sid), lambda: c.resume(sid), lambda: c.plan_resume(sid),
            lambda: c.append(sid, [1]), lambda: c.generate(sid, 1), lambda: c.checkpoint(sid),
            lambda: c.drop_session(sid), lambda: c.delete_session(sid)]


# ----- isolation ---------------------------------------------------------------------------


async def test_a_tenant_cannot_reach_another_tenants_sessions(clients: dict[str, StateStoreClient]) -> None:
    alice, bob = clients["alice"], clients["bob"]
    await checkpointed(alice, "idle")  # checkpointed, not in memory
    await alice.create_session("busy")  # in memory, never checkpointed
    await alice.append("busy", PROMPT[:10])
    assert await bob.list_sessions() == []
    for sid in ("idle", "busy"):
        for call in session_calls(bob, sid):
            await assert_rejected(call(), grpc.StatusCode.NOT_FOUND, repr(sid))
    assert [s.session_id for s in await alice.list_sessions()] == ["busy", "idle"]
    idle = await alice.get_session("idle")
    assert (idle.live, idle.checkpoint_version, idle.num_tokens) == (False, 1, len(PROMPT))
    assert (await alice.get_session("busy")).num_tokens == 10
    assert (await alice.resume("idle")).num_tokens == len(PROMPT)


async def test_a_tenant_cannot_reach_another_tenants_records(server: StateStoreServer,
                                                            clients: dict[str, StateStoreClient]) -> None:
    alice, bob = clients["alice"], clients["bob"]
    await checkpointed(alice, "s")
    theirs = [r.key for r in (await alice.list_records())[0]]
    assert len(theirs) >= 2 * 2 + 1  # two blocks of GLOBAL_KV + INDEX_K, tails, tokens, manifest
    before = {k: (await alice.inspect(k)).tiers for k in theirs}

    assert (await bob.list_records())[0] == []
    for key in theirs[:3]:
        await assert_rejected(bob.inspect(key), grpc.StatusCode.NOT_FOUND, "is not stored on this node")
    assert await bob.get_records(theirs) == [None] * len(theirs)
    await assert_rejected(bob.pin(theirs), grpc.StatusCode.NOT_FOUND, f"{len(theirs)} of {len(theirs)} keys")
    await assert_rejected(bob.unpin(theirs[:1]), grpc.StatusCode.NOT_FOUND, "nothing was changed")
    assert await bob.evict(theirs, force=True) == {k: () for k in theirs}
    looked = await bob.lookup(await block_keys(alice))
    assert looked.combined_blocks == 0 and set(looked.per_tier.values()) == {0}
    stolen = record(server, theirs[0][2:], kind=int.from_bytes(theirs[0][:2], "big"))
    await assert_rejected(bob.put_records([stolen]), grpc.StatusCode.PERMISSION_DENIED, "belongs to another tenant")
    # A header naming another tenant is refused whatever the key.
    mine = record(server, b"\x42" * 32)
    forged = Record(replace(mine.header, tenant_id=tenant_id("alice")), mine.payload)
    await assert_rejected(bob.put_raw(_raw_chunks(forged)), grpc.StatusCode.PERMISSION_DENIED,
                          "header names another tenant")

    assert {k: (await alice.inspect(k)).tiers for k in theirs} == before  # untouched
    assert all(r is not None for r in await alice.get_records(theirs))
    stats = await bob.stats()  # store-wide totals: counts and bytes, no key, no session id
    assert stats.num_records >= len(theirs) and not hasattr(stats, "records")


def _raw_chunks(r: Record) -> list[common_pb2.RecordChunk]:
    data = encode_record(r)
    return [common_pb2.RecordChunk(start=common_pb2.RecordStart(key=r.key, total_bytes=len(data))),
            common_pb2.RecordChunk(data=data)]


async def test_identical_prompts_of_two_tenants_never_share_blocks(clients: dict[str, StateStoreClient]) -> None:
    alice, bob = clients["alice"], clients["bob"]
    await checkpointed(alice, "same")
    await bob.create_session("same")
    await bob.append("same", PROMPT)
    report = await bob.checkpoint("same")
    assert (report.new_blocks, report.shared_blocks) == (2, 0)  # nothing of alice's was reused

    a_keys, b_keys = await block_keys(alice), await block_keys(bob)
    assert len(a_keys) == len(b_keys) == 2 and not set(a_keys) & set(b_keys)
    a_records = {r.key for r in (await alice.list_records())[0]}
    b_records = {r.key for r in (await bob.list_records())[0]}
    assert a_records and b_records and not a_records & b_records  # both stored, nothing shared
    assert (await alice.lookup(a_keys)).combined_blocks == 2
    assert (await bob.lookup(b_keys)).combined_blocks == 2
    # Tenant B cannot even name tenant A's key for the prompt: a lookup of A's keys is a miss.
    assert (await bob.lookup(a_keys)).combined_blocks == 0
    assert (await alice.lookup(b_keys)).combined_blocks == 0


# ----- hostile names -----------------------------------------------------------------------

HOSTILE_IDS = [
    "", ".", "..", "../../etc/passwd", "..%2f..%2fetc%2fpasswd", "/etc/passwd", "/", "a/b", "a\\b", "C:\\x",
    "a\x00b", "\x00", "x" * 129, "x" * 100_000, " a", "a b", "a\tb", "\n", "-rf", ".hidden",
    "ｅｔｃ", "a\u202eb", "caf\u00e9", "a\u2215b", "\u2024\u2024", "\U0001F600", "a\ud7ffb", "\ufeffa",
]


def written_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() or p.is_symlink()]


def assert_only_records_inside(tmp_path: Path, data_dir: Path) -> None:
    """Everything the server wrote is inside the data dir: its secret, the SSD lock,
    hex-named records under two levels of hex fan-out and the SSD tier's hex-named spares."""
    assert sorted(p.name for p in tmp_path.iterdir()) == [data_dir.name]
    record_name = re.compile(r"^ssd/([0-9a-f]{2})/([0-9a-f]{2})/[0-9a-f]{4}\1\2[0-9a-f]{60}\.rec$"
                             r"|^ssd/spares/[0-9a-f]+\.spare$")
    for path in written_files(data_dir):
        assert not path.is_symlink(), path
        assert path.resolve().is_relative_to(data_dir.resolve()), path
        rel = path.relative_to(data_dir).as_posix()
        assert rel in ("secret", "ssd/.lock") or record_name.match(rel), rel


async def test_hostile_session_ids_are_invalid_and_create_no_file(tmp_path: Path, server: StateStoreServer,
                                                                 clients: dict[str, StateStoreClient]) -> None:
    alice = clients["alice"]
    passwd = Path("/etc/passwd").stat() if Path("/etc/passwd").exists() else None
    for sid in HOSTILE_IDS:
        for call in (lambda: alice.create_session(sid), *session_calls(alice, sid)):
            await assert_rejected(call(), grpc.StatusCode.INVALID_ARGUMENT, "session_id")
    assert await alice.list_sessions() == []
    await checkpointed(alice, "ok.id:1@x-y_z")  # the whole alphabet of a valid id works
    assert_only_records_inside(tmp_path, server.config.data_dir)
    if passwd is not None:
        assert Path("/etc/passwd").stat().st_mtime_ns == passwd.st_mtime_ns


async def test_session_id_with_a_trailing_newline_is_invalid(clients: dict[str, StateStoreClient]) -> None:
    await assert_rejected(clients["alice"].create_session("abc\n"), grpc.StatusCode.INVALID_ARGUMENT, "session_id")


async def test_record_keys_name_no_path(tmp_path: Path, server: StateStoreServer,
                                        clients: dict[str, StateStoreClient]) -> None:
    alice = clients["alice"]
    sneaky = [b"../../../../etc/passwd".ljust(32, b"\x00"), b"/" * 32, b"\x00" * 32, b"..\\..\\" * 5 + b"..",
              "ｅｔｃ/passwd".encode().ljust(32, b"."), b"\xff" * 32]
    results = await alice.put_records([record(server, k) for k in sneaky], Durability.LOCAL)
    assert [r.key[2:] for r in results] == sneaky and all("ssd" in r.tiers for r in results)
    got = await alice.get_records([r.key for r in results])
    assert all(g is not None and g.header.block_key == k for g, k in zip(got, sneaky))
    for bad in (b"", b"../etc/passwd", b"\x00" * 33, b"\x00" * 35, b"/" * 4096):
        await assert_rejected(alice.inspect(bad), grpc.StatusCode.INVALID_ARGUMENT, "key")
        await assert_rejected(alice.get_records([bad]), grpc.StatusCode.INVALID_ARGUMENT, "keys[0]")
        await assert_rejected(alice.evict([bad]), grpc.StatusCode.INVALID_ARGUMENT, "keys[0]")
        await assert_rejected(alice.lookup([bad]), grpc.StatusCode.INVALID_ARGUMENT, "block_keys[0]")
    assert_only_records_inside(tmp_path, server.config.data_dir)
    names = {p.name[:-4] for p in written_files(server.config.data_dir / "ssd") if p.suffix == ".rec"}
    assert {r.key.hex() for r in results} <= names


# ----- quotas ------------------------------------------------------------------------------

RECORD = 1000  # payload bytes of the records the quota tests put (+ the 168-byte header)


@pytest_asyncio.fixture
async def quota_server(tmp_path: Path) -> AsyncIterator[StateStoreServer]:
    size = record_size()
    quotas = {"alice": TenantQuota(max_bytes=3 * size), "bob": TenantQuota(max_sessions=2),
              "carol": TenantQuota(max_bytes=4096)}  # dave: unbounded
    async with StateStoreServer(make_server_config(tmp_path / "data", tenant_quotas=quotas)) as srv:
        yield srv


@pytest_asyncio.fixture
async def quota_clients(quota_server: StateStoreServer) -> AsyncIterator[dict[str, StateStoreClient]]:
    async with clients_for(quota_server, TOKENS) as out:
        yield out


def record_size() -> int:
    return make_record(1, 1, bytes(RECORD), model_fingerprint=bytes(16), tenant_id=bytes(16), block_key=bytes(32)).nbytes


async def test_max_sessions_quota(quota_clients: dict[str, StateStoreClient]) -> None:
    bob, dave = quota_clients["bob"], quota_clients["dave"]
    await checkpointed(bob, "one")  # a checkpointed, dropped session counts
    await bob.create_session("two")
    await assert_rejected(bob.create_session("three"), grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "tenant 'bob' is at its max_sessions quota: 2 sessions allowed, 2 exist",
                          "[tenants.bob] max_sessions")
    await assert_rejected(bob.create_session("bad id"), grpc.StatusCode.INVALID_ARGUMENT, "session_id")
    for sid in ("one", "two", "three"):  # dave has no quota and the same ids
        await dave.create_session(sid)
    assert len(await dave.list_sessions()) == 3
    assert await bob.delete_session("one")
    await bob.create_session("three")
    assert [s.session_id for s in await bob.list_sessions()] == ["three", "two"]


async def test_max_bytes_quota_on_put_records(quota_server: StateStoreServer,
                                              quota_clients: dict[str, StateStoreClient]) -> None:
    alice, dave = quota_clients["alice"], quota_clients["dave"]
    size = record_size()
    first = [record(quota_server, bytes([i]) * 32, RECORD) for i in (1, 2)]
    await alice.put_records(first)
    await alice.put_records(first[:1])  # a re-put of one's own key needs no new room
    batch = [record(quota_server, bytes([i]) * 32, RECORD) for i in (3, 4)]
    await assert_rejected(alice.put_records(batch), grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"tenant 'alice' is over its max_bytes quota: {3 * size} bytes allowed, {2 * size} stored, "
                          f"this put needs {2 * size} more ({4 * size} > {3 * size})", "[tenants.alice] max_bytes")
    assert {r.key for r in (await alice.list_records())[0]} == {r.key for r in first}  # nothing of the batch
    await dave.put_records([record(quota_server, bytes([i]) * 32, RECORD) for i in range(10, 20)])
    assert len((await dave.list_records())[0]) == 10  # other tenants are unaffected
    await alice.put_records(batch[:1])  # exactly at the quota
    await assert_rejected(alice.put_records(batch[1:]), grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{3 * size} stored, this put needs {size} more")
    await alice.evict([first[0].key])  # eviction frees quota at once
    await alice.put_records(batch[1:])
    assert len((await alice.list_records())[0]) == 3


async def test_max_bytes_quota_on_checkpoints(quota_clients: dict[str, StateStoreClient]) -> None:
    carol, dave = quota_clients["carol"], quota_clients["dave"]
    await carol.create_session("big")
    await carol.append("big", PROMPT)
    error = await assert_rejected(carol.checkpoint("big"), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  "tenant 'carol' is over its max_bytes quota: 4096 bytes allowed",
                                  "[tenants.carol] max_bytes")
    assert re.search(r"\d+ stored, this put needs \d+ more \(\d+ > 4096\)", error.message), error.message
    info = await carol.get_session("big")  # the session lives on, without a checkpoint
    assert (info.live, info.checkpoint_version, info.num_tokens) == (True, 0, len(PROMPT))
    await dave.create_session("big")
    await dave.append("big", PROMPT)
    assert (await dave.checkpoint("big")).version == 1


def test_quota_config_is_validated(tmp_path: Path) -> None:
    path = tmp_path / "statestore.toml"
    path.write_text('[auth]\ntokens = { alice = "alice-token-0001", bob = "bob-token-000002" }\n'
                    '[quotas]\nmax_sessions = 8\n[tenants.alice]\nmax_bytes = 1048576\nmax_sessions = 2\n')
    config = load_config(path, env={"STATESTORE_QUOTAS_MAX_BYTES": "4096"})
    assert config.tenant_quotas == {"alice": TenantQuota(max_bytes=1 << 20, max_sessions=2)}
    assert (config.quota_max_bytes, config.quota_max_sessions) == (4096, 8)
    bad = {
        "[tenants.mallory]\nmax_bytes = 1\n": "tenants.mallory: no such tenant in auth.tokens (known: alice, bob)",
        "[tenants.alice]\nmax_byte = 1\n": "unknown setting(s) max_byte; known: max_bytes, max_sessions",
        "[tenants.alice]\nmax_bytes = -1\n": "max_bytes must be an integer >= 0 (0 = unbounded), got -1",
        "[tenants.alice]\nmax_sessions = \"2\"\n": "max_sessions must be an integer >= 0",
        "[tenants]\nalice = 3\n": "expected a [tenants.alice] table",
        "[quotas]\nmax_bytes = -5\n": "config quotas.max_bytes: -5 < 0",
    }
    for text, message in bad.items():
        path.write_text('[auth]\ntokens = { alice = "alice-token-0001", bob = "bob-token-000002" }\n' + text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(path, env={})
