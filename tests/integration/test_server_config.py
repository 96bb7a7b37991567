"""Service configuration: the embedded default, TOML, STATESTORE_* overrides, clear errors,
and the proto stubs' freshness (regenerated into a temp dir, compared byte for byte)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from statestore.auth import AuthError, TokenAuth
from statestore.config import ConfigError, ServiceConfig, default_data_dir, load_config
from statestore.server import load_secret

ROOT = Path(__file__).resolve().parents[2]


def test_embedded_default_needs_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    c = load_config(env={})
    assert c.listen == "127.0.0.1:7450" and c.host == "127.0.0.1" and c.port == 7450
    assert c.data_dir == tmp_path / "statestore" == default_data_dir()
    assert c.redis_url == "" and c.tokens == {} and c.engine_preset == "tiny" and c.metrics_port == 0
    assert c.tls_cert is None and c.max_message_bytes == 4 << 20


def test_toml_then_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[server]\nlisten = "0.0.0.0:9000"\nmax_message_bytes = 1048576\n'
                    '[auth]\ntokens = { alice = "aaaaaaaa1", bob = "bbbbbbbb2" }\n'
                    '[storage]\ndata_dir = "~/ss"\nhost_budget_bytes = 1000000\n'
                    '[engine]\npreset = "mini"\n[metrics]\nport = 9464\n')
    c = load_config(path, env={"STATESTORE_ENGINE_PRESET": "tiny", "STATESTORE_LISTEN": "127.0.0.1:0",
                               "STATESTORE_SESSIONS_DEFAULT_MODE": "exact"})
    assert c.listen == "127.0.0.1:0" and c.max_message_bytes == 1 << 20 and c.engine_preset == "tiny"
    assert c.tokens == {"alice": "aaaaaaaa1", "bob": "bbbbbbbb2"} and c.metrics_port == 9464
    assert c.data_dir == Path("~/ss").expanduser() and c.host_budget_bytes == 1_000_000 and c.default_mode == "exact"
    assert load_config(env={"STATESTORE_TOKENS": "a=12345678,b=87654321"}).tokens == {"a": "12345678", "b": "87654321"}


@pytest.mark.parametrize("setting", ["ssd_loop_reads", "redis_bulk_reads"])
def test_storage_switches_from_toml_and_env(tmp_path: Path, setting: str) -> None:
    """On by default; off from the TOML file; the environment's word (any of the bool words)
    wins over the file either way."""
    env_name = f"STATESTORE_STORAGE_{setting.upper()}"
    path = tmp_path / "s.toml"
    path.write_text(f"[storage]\n{setting} = false\n")
    assert getattr(load_config(env={}), setting) is True
    assert getattr(load_config(path, env={}), setting) is False
    assert getattr(load_config(path, env={env_name: "on"}), setting) is True
    assert getattr(load_config(env={env_name: "0"}), setting) is False


def test_ssd_read_poll_us_from_toml_and_env(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[storage]\nssd_read_poll_us = 0\n")
    assert load_config(env={}).ssd_read_poll_us == 2000
    assert load_config(path, env={}).ssd_read_poll_us == 0
    assert load_config(path, env={"STATESTORE_STORAGE_SSD_READ_POLL_US": "500"}).ssd_read_poll_us == 500


def test_cache_kinds_from_toml_and_env(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[storage]\ncache_kinds = [\"OPAQUE\", 3]\n")
    assert load_config(path, env={}).cache_kind_codes == {6, 3}
    assert load_config(path, env={"STATESTORE_STORAGE_CACHE_KINDS": "swa_ring"}).cache_kind_codes == {3}
    assert load_config(env={}).cache_kind_codes == frozenset()


@pytest.mark.parametrize("text, env, message", [
    ("[server]\nlisten = \"0.0.0.0:7450\"\n", {}, "not a loopback address and no auth.tokens"),
    ("[server]\nlisten = \"nonsense\"\n", {}, "server.listen: 'nonsense' is not HOST:PORT"),
    ("[engine]\npreset = \"huge\"\n", {}, "engine.preset: 'huge' is not one of mini, tiny"),
    ("[storage]\nhost_budget_bytes = \"lots\"\n", {}, "host_budget_bytes from"),
    ("[storage]\nhost_budget_bytes = 0\n", {}, "storage.host_budget_bytes: 0 <= 0"),
    ("[storage]\ncolour = 3\n", {}, "unknown setting storage.colour"),
    ("[tls]\ncert = \"a.pem\"\n", {}, "give both tls.cert and tls.key"),
    ("[auth]\ntokens = { a = \"short\" }\n", {}, "tenant 'a' needs a token of at least 8 characters"),
    ("[sessions]\ndurability = \"cloud\"\n", {}, "sessions.durability: 'cloud'"),
    ("not toml [", {}, "is not valid TOML"),
    ("", {"STATESTORE_SERVER_MAX_MESSAGE_BYTES": "12"}, "server.max_message_bytes: 12 outside"),
    ("", {"STATESTORE_TOKENS": "alice"}, "expected tenant=token"),
    ("[storage]\ncache_kinds = [\"lmcache\"]\n", {}, "storage.cache_kinds: 'lmcache' is not a kind: one of"),
    ("[storage]\ncache_kinds = \"opaque\"\n", {"STATESTORE_STORAGE_CACHE_KINDS": "0"}, "'0' is not a kind"),
    ("[storage]\ncache_kinds = [1.5]\n", {}, "expected kind names or codes"),
    ("", {"STATESTORE_STORAGE_SSD_RECYCLE_BYTES": "-2"}, "storage.ssd_recycle_bytes: -2 < -1"),
    ("[storage]\nssd_loop_reads = 1\n", {}, "ssd_loop_reads from"),
    ("", {"STATESTORE_STORAGE_SSD_LOOP_READS": "maybe"}, "expected true or false"),
    ("[storage]\nredis_bulk_reads = 2\n", {}, "redis_bulk_reads from"),
    ("[storage]\nssd_read_poll_us = -1\n", {}, "storage.ssd_read_poll_us: -1 outside [0, 1000000] (0: never poll)"),
    ("", {"STATESTORE_STORAGE_SSD_READ_POLL_US": "2ms"}, "ssd_read_poll_us from STATESTORE_STORAGE_SSD_READ_POLL_US"),
])
def test_invalid_settings_are_named(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env)
    assert message in str(info.value)


def test_missing_file_and_non_loopback_with_tokens(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "nope.toml", env={})
    c = ServiceConfig(listen="0.0.0.0:0", tokens={"alice": "aaaaaaaa1"})
    assert c.host == "0.0.0.0"


def test_token_auth_constant_time_lookup() -> None:
    auth = TokenAuth({"alice": "aaaaaaaa1", "bob": "bbbbbbbb2"})
    assert auth.tenant_for([("authorization", "Bearer bbbbbbbb2")]) == "bob"
    assert auth.tenant_for([("Authorization", "bearer aaaaaaaa1")]) == "alice"
    for metadata, message in (([], "missing credentials"), ([("authorization", "Bearer x")], "unknown bearer token"),
                              ([("authorization", "Token aaaaaaaa1")], "expected 'Bearer <token>'")):
        with pytest.raises(AuthError, match=message):
            auth.tenant_for(metadata)
    assert TokenAuth({}).tenant_for([]) == "default"


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    """`scripts/gen_proto.sh` reproduces the committed stubs byte for byte."""
    env = {**os.environ, "OUT_DIR": str(tmp_path), "PYTHON": sys.executable}
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh")], check=True, env=env, timeout=60)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert len(generated) == 9
    for rel in generated:
        committed = ROOT / rel
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} is stale: run scripts/gen_proto.sh"


def test_generated_modules_do_not_shadow_the_statestore_package() -> None:
    import statestore
    from proto.statestore.v1 import statestore_pb2

    assert Path(statestore.__file__).parent == ROOT / "statestore"
    assert statestore_pb2.DESCRIPTOR.package == "statestore.v1"
    assert [s.full_name for s in statestore_pb2.DESCRIPTOR.services_by_name.values()] == ["statestore.v1.StateStore"]


def test_secret_file_defaults_to_the_data_dir_and_can_be_shared_between_nodes(tmp_path: Path) -> None:
    """Nodes that resume each other's sessions must derive the same tenant salts: one secret file."""
    shared = tmp_path / "shared-secret"
    a = load_config(env={"STATESTORE_DATA_DIR": str(tmp_path / "a")})
    assert a.secret_path == tmp_path / "a" / "secret"
    b = load_config(env={"STATESTORE_DATA_DIR": str(tmp_path / "b"), "STATESTORE_STORAGE_SECRET_FILE": str(shared)})
    c = load_config(env={"STATESTORE_DATA_DIR": str(tmp_path / "c"), "STATESTORE_STORAGE_SECRET_FILE": str(shared)})
    assert b.secret_path == c.secret_path == shared
    assert load_secret(b.secret_path) == load_secret(c.secret_path)
    assert load_secret(a.secret_path) != load_secret(b.secret_path)


async def test_cost_policy_runs_in_the_service_from_a_calibration_profile(tmp_path: Path) -> None:
    """`storage.policy = "cost"` loads the profile; Inspect then shows the cost policy's reasoning."""
    from statestore.client import StateStoreClient
    from statestore.profile import CostProfile, ProfileError
    from statestore.server import StateStoreServer
    from tiers.record import make_record

    missing = ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path / "a", engine_preset="mini", policy="cost",
                            profile=tmp_path / "nope.json")
    with pytest.raises(ProfileError, match="statestore calibrate"):
        await StateStoreServer(missing).start()
    profile = CostProfile.v41_h200().save(tmp_path / "profile.json")
    config = ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path / "a", engine_preset="mini", policy="cost",
                           profile=profile)
    async with StateStoreServer(config) as srv:  # the failed start above left no SSD lock behind
        async with StateStoreClient(f"127.0.0.1:{srv.port}") as client:
            record = make_record(1, 1, b"x" * 4096, model_fingerprint=srv.adapter.model_fingerprint,
                                 tenant_id=bytes(16), block_key=bytes(range(32)), token_end=256)
            await client.lookup([record.header.block_key], kinds=[1])
            await client.put_records([record])
            explained = (await client.inspect(record.key)).explain
            # The request is over: its output length refines what the policy learns of the block.
            assert await client.request_done([record.header.block_key], 7, kinds=[1]) == 1
            refined = (await client.inspect(record.key)).explain
    assert refined is not None and "the request generated 0-15 tokens" in refined["policy"]["reuse_source"]
    assert explained is not None and "generated" not in explained["policy"]["reuse_source"]
    assert explained is not None and explained["policy"]["policy"] == "cost"
    assert explained["policy"]["retention"] == "MUST_KEEP" and explained["policy"]["rebuild_s"] > 0
    assert "rebuild" in explained["policy"]["summary"] and "P(reuse" in explained["policy"]["summary"]


@pytest.mark.redis
@pytest.mark.parametrize("bulk_reads", [True, False])
async def test_the_server_reads_redis_as_redis_bulk_reads_says(tmp_path: Path, redis_url: str,
                                                                bulk_reads: bool) -> None:
    """`storage.redis_bulk_reads` reaches the Redis tier: with it on, the server's Redis reads
    come on connections of the tier's own reader (named in CLIENT LIST); off, none exist."""
    from redis.asyncio import Redis

    from statestore.client import StateStoreClient
    from statestore.config import ServiceConfig
    from statestore.server import StateStoreServer
    from statestore.types import Durability
    from tiers.record import make_record
    from tiers.redis_bulk import CLIENT_NAME

    async def readers(raw: Redis) -> int:
        return sum(c.get("name") == CLIENT_NAME for c in await raw.client_list())

    prefix = f"cfg-{tmp_path.name[-12:]}"
    server = StateStoreServer(ServiceConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data", engine_preset="mini",
                                            redis_url=redis_url, redis_prefix=prefix, redis_bulk_reads=bulk_reads))
    await server.start()
    try:
        async with StateStoreClient(f"127.0.0.1:{server.port}") as client, Redis.from_url(redis_url) as raw:
            before = await readers(raw)
            fp = (await client.stats()).model_fingerprint
            record = make_record(1, 1, b"x" * 100_000, model_fingerprint=fp, tenant_id=bytes(16),
                                 block_key=bytes(range(32)))
            await client.put_records([record], Durability.SHARED)
            await client.evict([record.key], ["host", "ssd"])  # the next get has to ask Redis
            got = await client.get_records([record.key])
            assert got[0] is not None and got[0].payload == record.payload
            assert (await readers(raw) > before) is bulk_reads
            keys = [k async for k in raw.scan_iter(match=f"{prefix}:*")]
            if keys:
                await raw.delete(*keys)
    finally:
        await server.stop(0)
