"""Helpers the service tests share: start a server on the mini engine, open one client per
token, and assert that a call is rejected with a given status and message."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from statestore.client import ServiceError, StateStoreClient
from statestore.config import ServiceConfig
from statestore.server import StateStoreServer


async def start_mini_server(data_dir: Path, **config: Any) -> StateStoreServer:
    """A started server on loopback (any port), mini engine, blocks of 64, no shutdown grace
    (`config`: other `ServiceConfig` fields)."""
    server = StateStoreServer(ServiceConfig(listen="127.0.0.1:0", data_dir=data_dir, engine_preset="mini",
                                            block_size=64, grace_s=0, **config))
    await server.start()
    return server


@asynccontextmanager
async def clients_for(server: StateStoreServer, tokens: Mapping[str, str]) -> AsyncIterator[dict[str, StateStoreClient]]:
    """One open client per tenant, each with its bearer token; all closed on exit."""
    out = {t: StateStoreClient(f"127.0.0.1:{server.port}", token=tok) for t, tok in tokens.items()}
    for c in out.values():
        c.open()
    try:
        yield out
    finally:
        for c in out.values():
            await c.aclose()


async def assert_rejected(coro: object, code: grpc.StatusCode, *fragments: str) -> ServiceError:
    """The awaited call fails with `code` and a message containing every fragment."""
    with pytest.raises(ServiceError) as info:
        await coro  # type: ignore[misc]
    assert info.value.code == code, info.value
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message
    return info.value
