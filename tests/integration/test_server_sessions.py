"""The Sessions service end to end on loopback: create, append, streamed generate, checkpoint,
drop, plan, resume (exact continues with the same tokens as an uninterrupted run), get, list,
delete; bad input and unknown sessions get the right codes; tenants see only their sessions.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from statestore.client import StateStoreClient
from statestore.config import ServiceConfig
from statestore.server import StateStoreServer
from statestore.types import Durability
from tests.service import assert_rejected

pytestmark = pytest.mark.timeout(90)

TOKENS = {"alice": "alice-token-0001", "bob": "bob-token-000002"}


@pytest_asyncio.fixture
async def server(tmp_path: Path) -> AsyncIterator[StateStoreServer]:
    config = ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path, engine_preset="mini", tokens=TOKENS,
                           block_size=64)
    async with StateStoreServer(config) as srv:
        yield srv


@pytest_asyncio.fixture
async def alice(server: StateStoreServer) -> AsyncIterator[StateStoreClient]:
    async with StateStoreClient(f"127.0.0.1:{server.port}", token=TOKENS["alice"]) as c:
        yield c


@pytest_asyncio.fixture
async def bob(server: StateStoreServer) -> AsyncIterator[StateStoreClient]:
    async with StateStoreClient(f"127.0.0.1:{server.port}", token=TOKENS["bob"]) as c:
        yield c


def messages(seed: int = 0, sizes: tuple[int, ...] = (90, 57, 120)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in sizes]


async def test_checkpoint_drop_resume_exact_continues_like_an_uninterrupted_run(alice: StateStoreClient) -> None:
    for sid in ("straight", "resumed"):
        info = await alice.create_session(sid)
        assert (info.num_tokens, info.live, info.checkpoint_version) == (0, True, 0)
        for msg in messages():
            info = await alice.append(sid, msg)
        assert info.num_tokens == 267 and info.message_boundaries == (90, 147, 267)
    expected = await alice.generate("straight", 12)
    chunks = [c async for c in alice.generate_stream("straight", 5, chunk_tokens=2)]
    assert [len(c) for c in chunks] == [2, 2, 1]

    report = await alice.checkpoint("resumed", Durability.LOCAL)
    assert (report.version, report.num_tokens, report.new_blocks) == (1, 267, 4)
    assert report.total_bytes == sum(report.bytes_written.values()) and "manifest" in report.bytes_written
    assert await alice.drop_session("resumed")
    info = await alice.get_session("resumed")
    assert (info.live, info.checkpoint_version, info.checkpointed_tokens) == (False, 1, 267)
    plan = await alice.plan_resume("resumed", "exact")
    assert plan.num_tokens == 267 and plan.missing_blocks == 0 and plan.replay.mode == "exact"
    assert sum(plan.bytes_by_tier.values()) > 0
    resumed = await alice.resume("resumed", "exact")
    assert resumed.mode == "exact" and resumed.num_tokens == 267 and resumed.persisted_tokens > 0
    assert resumed.replay_tokens == plan.replay.replay_tokens
    assert await alice.generate("resumed", 12) == expected
    assert [s.session_id for s in await alice.list_sessions()] == ["resumed", "straight"]
    assert await alice.delete_session("resumed")
    await assert_rejected(alice.get_session("resumed"), grpc.StatusCode.NOT_FOUND, "no session 'resumed'")


async def test_second_checkpoint_shares_blocks_and_bounded_resume_works(alice: StateStoreClient) -> None:
    await alice.create_session("s")
    await alice.append("s", messages()[0] * 2)
    first = await alice.checkpoint("s")
    await alice.append("s", messages()[1])
    second = await alice.checkpoint("s")
    assert second.version == first.version + 1 and second.shared_blocks + second.new_blocks >= 1
    await alice.drop_session("s")
    report = await alice.resume("s")  # the server default: bounded
    assert report.mode == "bounded" and report.num_tokens == 180 + 57
    assert len(await alice.generate("s", 3)) == 3


BAD = {
    "empty session id": (lambda c: c.get_session(""), grpc.StatusCode.INVALID_ARGUMENT, "session_id '' is invalid"),
    "bad session id": (lambda c: c.create_session("a b/c"), grpc.StatusCode.INVALID_ARGUMENT,
                       "session_id 'a b/c' is invalid"),
    "unknown session get": (lambda c: c.get_session("ghost"), grpc.StatusCode.NOT_FOUND, "no session 'ghost'"),
    "unknown session append": (lambda c: c.append("ghost", [1]), grpc.StatusCode.NOT_FOUND, "'ghost' is not active"),
    "unknown session resume": (lambda c: c.resume("ghost"), grpc.StatusCode.NOT_FOUND, "no session 'ghost'"),
    "unknown session delete": (lambda c: c.delete_session("ghost"), grpc.StatusCode.NOT_FOUND, "no session 'ghost'"),
    "unknown session drop": (lambda c: c.drop_session("ghost"), grpc.StatusCode.NOT_FOUND, "'ghost' is not active"),
    "create existing": (lambda c: c.create_session("live"), grpc.StatusCode.ALREADY_EXISTS, "already exists"),
    "negative token": (lambda c: c.append("live", [5, -1]), grpc.StatusCode.INVALID_ARGUMENT,
                       "token_ids: id -1 outside the model's vocabulary [0, 256)"),
    "token beyond vocab": (lambda c: c.append("live", [256]), grpc.StatusCode.INVALID_ARGUMENT, "id 256 outside"),
    "empty append": (lambda c: c.append("live", []), grpc.StatusCode.INVALID_ARGUMENT, "token_ids: 0 ids"),
    "huge generate": (lambda c: c.generate("live", 10**9), grpc.StatusCode.INVALID_ARGUMENT,
                      "num_tokens: 1000000000 outside [1, 65536]"),
    "negative generate": (lambda c: c.generate("live", -3), grpc.StatusCode.INVALID_ARGUMENT, "num_tokens: -3"),
    "bad temperature": (lambda c: c.generate("live", 1, temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT,
                        "temperature: -1.0"),
    "bad durability": (lambda c: c.checkpoint("live", 9), grpc.StatusCode.INVALID_ARGUMENT,  # type: ignore[arg-type]
                       "durability: unknown durability 9"),
    "shared without redis": (lambda c: c.checkpoint("live", Durability.SHARED), grpc.StatusCode.FAILED_PRECONDITION,
                             "no redis tier is configured"),
    "bad resume mode": (lambda c: c.resume("live", "fast"), grpc.StatusCode.INVALID_ARGUMENT, "mode: 'fast'"),
    "resume active": (lambda c: c.resume("live"), grpc.StatusCode.FAILED_PRECONDITION, "already active"),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_session_calls(case: str, alice: StateStoreClient) -> None:
    await alice.create_session("live")
    await alice.append("live", [1, 2, 3])
    make, code, fragment = BAD[case]
    await assert_rejected(make(alice), code, fragment)
    info = await alice.get_session("live")
    assert (info.num_tokens, info.live, info.checkpoint_version) == (3, True, 0)
    assert await alice.health() == "SERVING"


async def test_tenants_cannot_see_each_others_sessions(alice: StateStoreClient, bob: StateStoreClient) -> None:
    await alice.create_session("shared-name")
    await alice.append("shared-name", messages()[0])
    await alice.checkpoint("shared-name")
    await assert_rejected(bob.get_session("shared-name"), grpc.StatusCode.NOT_FOUND)
    await assert_rejected(bob.resume("shared-name"), grpc.StatusCode.NOT_FOUND)
    await assert_rejected(bob.delete_session("shared-name"), grpc.StatusCode.NOT_FOUND)
    assert await bob.list_sessions() == []
    assert (await bob.list_records())[0] == []
    info = await bob.create_session("shared-name")  # the same id, another tenant: a separate session
    assert info.num_tokens == 0
    assert (await alice.get_session("shared-name")).num_tokens == 90
