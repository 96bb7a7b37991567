"""Service configuration: one TOML file, `STATESTORE_*` environment overrides, and an embedded
default that needs nothing installed (host RAM + an SSD directory under the user's cache
folder, no Redis, loopback only, the bundled `tiny` engine).

Precedence, lowest first: the embedded default, the TOML file, the environment, then the
command line (`with_overrides`). Every value is validated in one place (`ServiceConfig.
__post_init__`) and an error names the setting, where it came from, and what is allowed.

TOML layout (every key optional)::

    [server]   listen = "127.0.0.1:7450"   max_message_bytes = 4194304   max_record_bytes = 67108864
               max_stream_bytes = 268435456   grace_s = 10.0
    [tls]      cert = "server.crt"   key = "server.key"
    [auth]     tokens = { alice = "s3cret-a", bob = "s3cret-b" }     # tenant -> bearer token
    [metrics]  port = 9464   addr = "127.0.0.1"                        # port 0 = no endpoint
    [storage]  data_dir = "~/.cache/statestore"   host_budget_bytes = 1073741824
               ssd_budget_bytes = 0   redis_url = ""   redis_prefix = "ss"
               redis_bulk_reads = true # Redis GETs read in place by the tier's own reader; false: redis-py
               ssd_recycle_bytes = -1  # deleted records' files kept for reuse: -1 automatic, 0 none
               ssd_loop_reads = true   # SSD reads below 2 MiB on the event loop (native AIO); false: threads
               ssd_read_poll_us = 2000 # the loop polls for a lone such read's completion, up to this long; 0: never
               ssd_index_snapshot = true  # a clean stop saves the SSD index; the next start reads it, not every header
               secret_file = ""        # default <data_dir>/secret; nodes sharing a Redis must share it
               policy = "lru"          # or "cost": the cost-aware policy over `statestore calibrate`'s profile
               profile = ""            # cost profile path (default ~/.cache/statestore/profile.json)
               cache_kinds = []        # kinds kept as a cache, e.g. ["opaque"] (LMCache chunks): evictable
                                       # for room even as their only LOCAL/SHARED copy
    [engine]   preset = "tiny"   seed = 0
    [sessions] block_size = 256   durability = "local"   default_mode = "bounded"   keep_rings_ttl_s = 0
    [quotas]   max_bytes = 0   max_sessions = 0                       # every tenant's default; 0 = unbounded
    [tenants.alice]  max_bytes = 1073741824   max_sessions = 64       # one tenant's quotas (statestore/quotas.py)

Environment: `STATESTORE_<SECTION>_<KEY>` (e.g. `STATESTORE_SERVER_LISTEN`,
`STATESTORE_ENGINE_PRESET`, `STATESTORE_QUOTAS_MAX_BYTES`), plus the short forms `STATESTORE_LISTEN`, `STATESTORE_DATA_DIR`
and `STATESTORE_TOKENS` ("alice=tok1,bob=tok2").
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from engine_adapter.base import StateKind

ENGINE_PRESETS = ("mini", "tiny")
DURABILITIES = ("memory", "local", "shared")
REPLAY_MODES = ("exact", "bounded", "off")
POLICIES = ("lru", "cost")
DEFAULT_PORT = 7450
QUOTA_NAMES = ("max_bytes", "max_sessions")


class ConfigError(ValueError):
    """A setting is missing, mistyped or out of range; the message names it."""


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """What one tenant may keep on a node (0 = unbounded); enforced by statestore/quotas.py."""

    max_bytes: int = 0  # record bytes (header + raw payload), each record counted once
    max_sessions: int = 0  # live and checkpointed sessions together

    def __post_init__(self) -> None:
        for name in QUOTA_NAMES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0 (0 = unbounded), got {value!r}")


def default_data_dir() -> Path:
    """`$XDG_CACHE_HOME/statestore`, else `~/.cache/statestore`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "statestore"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Everything `statestore serve` needs. Field comments give units; all are validated."""

    listen: str = f"127.0.0.1:{DEFAULT_PORT}"  # HOST:PORT; port 0 = any free port
    max_message_bytes: int = 4 << 20  # gRPC send/receive limit per message
    max_record_bytes: int = 64 << 20  # largest encoded record a PutRecords stream may carry
    max_stream_bytes: int = 256 << 20  # all records of one PutRecords stream together
    grace_s: float = 10.0  # graceful-shutdown window for in-flight calls (checkpoints)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tokens: Mapping[str, str] = field(default_factory=dict)  # tenant -> bearer token
    metrics_port: int = 0  # Prometheus endpoint; 0 = none
    metrics_addr: str = "127.0.0.1"
    data_dir: Path = field(default_factory=default_data_dir)
    host_budget_bytes: int = 1 << 30
    ssd_budget_bytes: int = 0  # 0 = unbounded
    # Deleted records' files kept for reuse (`tiers.ssd` recycled spares); -1 = automatic
    # (256 MiB, at most a quarter of the budget, none on copy-on-write file systems), 0 = none.
    ssd_recycle_bytes: int = -1
    # SSD reads of records below 2 MiB on the event loop with Linux native AIO where the kernel
    # allows it (`tiers._aio`); False: every read on the tier's worker threads.
    ssd_loop_reads: bool = True
    # While one of those reads is the only one in flight the loop polls for its completion
    # between its other work, for up to this long, instead of sleeping until it wakes it: a
    # core busy meanwhile, for a read that lands without a halted vCPU to wake. 0: never.
    ssd_read_poll_us: int = 2000
    ssd_index_snapshot: bool = True
    redis_url: str = ""  # "" = no Redis tier
    redis_prefix: str = "ss"
    # Redis GET/MGET replies read by the tier's own reader, each value into a buffer of its own
    # (`tiers.redis_bulk`; not on rediss:// URLs); False: through redis-py, as every other call.
    redis_bulk_reads: bool = True
    # Kinds whose records are a cache (names or codes, e.g. "opaque" for LMCache chunks): their
    # only durable copy may still be evicted for room (`StoreConfig.cache_kinds`).
    cache_kinds: tuple[str, ...] = ()
    secret_file: Path | None = None  # tenant key salts derive from it; None = <data_dir>/secret
    policy: str = "lru"  # placement/eviction policy: "lru" or "cost" (needs a calibration profile)
    profile: Path | None = None  # the cost profile "cost" loads; None = statestore calibrate's default path
    engine_preset: str = "tiny"
    engine_seed: int = 0
    block_size: int = 256
    durability: str = "local"  # checkpoint default
    default_mode: str = "bounded"
    keep_rings_ttl_s: float = 0.0
    quota_max_bytes: int = 0  # [quotas]: every tenant's default record bytes; 0 = unbounded
    quota_max_sessions: int = 0  # [quotas]: every tenant's default sessions; 0 = unbounded
    tenant_quotas: Mapping[str, TenantQuota] = field(default_factory=dict)  # [tenants.<name>] overrides

    @property
    def cache_kind_codes(self) -> frozenset[int]:
        return frozenset(code for code in map(parse_kind, self.cache_kinds) if code is not None)

    def __post_init__(self) -> None:
        host, port = split_listen(self.listen)
        _check(0 <= port <= 65535, "server.listen", f"port {port} outside 0..65535")
        _check(64 << 10 <= self.max_message_bytes <= 1 << 30, "server.max_message_bytes",
               f"{self.max_message_bytes} outside [65536, 1073741824]")
        _check(self.max_record_bytes >= 1024, "server.max_record_bytes", f"{self.max_record_bytes} < 1024")
        _check(self.max_stream_bytes >= self.max_record_bytes, "server.max_stream_bytes",
               f"{self.max_stream_bytes} < max_record_bytes {self.max_record_bytes}")
        _check(self.grace_s >= 0, "server.grace_s", f"{self.grace_s} < 0")
        _check((self.tls_cert is None) == (self.tls_key is None), "tls",
               "give both tls.cert and tls.key, or neither")
        for tenant, token in self.tokens.items():
            _check(bool(tenant) and isinstance(token, str) and len(token) >= 8, "auth.tokens",
                   f"tenant {tenant!r} needs a token of at least 8 characters")
        _check(len(set(self.tokens.values())) == len(self.tokens), "auth.tokens", "two tenants share a token")
        _check(0 <= self.metrics_port <= 65535, "metrics.port", f"{self.metrics_port} outside 0..65535")
        _check(self.host_budget_bytes > 0, "storage.host_budget_bytes", f"{self.host_budget_bytes} <= 0")
        _check(self.ssd_budget_bytes >= 0, "storage.ssd_budget_bytes", f"{self.ssd_budget_bytes} < 0")
        _check(self.ssd_recycle_bytes >= -1, "storage.ssd_recycle_bytes",
               f"{self.ssd_recycle_bytes} < -1 (-1: automatic, 0: none)")
        _check(0 <= self.ssd_read_poll_us <= 1_000_000, "storage.ssd_read_poll_us",
               f"{self.ssd_read_poll_us} outside [0, 1000000] (0: never poll)")
        _check(self.redis_url == "" or self.redis_url.startswith(("redis://", "rediss://", "redis+cluster://")),
               "storage.redis_url", f"{self.redis_url!r} is not a redis:// URL")
        _check(self.policy in POLICIES, "storage.policy", f"{self.policy!r} is not one of {', '.join(POLICIES)}")
        _check(self.engine_preset in ENGINE_PRESETS, "engine.preset",
               f"{self.engine_preset!r} is not one of {', '.join(ENGINE_PRESETS)}")
        _check(self.block_size > 0, "sessions.block_size", f"{self.block_size} <= 0")
        _check(self.durability in DURABILITIES, "sessions.durability",
               f"{self.durability!r} is not one of {', '.join(DURABILITIES)}")
        _check(self.default_mode in REPLAY_MODES, "sessions.default_mode",
               f"{self.default_mode!r} is not one of {', '.join(REPLAY_MODES)}")
        _check(self.keep_rings_ttl_s >= 0, "sessions.keep_rings_ttl_s", f"{self.keep_rings_ttl_s} < 0")
        for kind in self.cache_kinds:
            _check(parse_kind(kind) is not None, "storage.cache_kinds",
                   f"{kind!r} is not a kind: one of {', '.join(k.name.lower() for k in StateKind)} or a code")
        _check(self.quota_max_bytes >= 0, "quotas.max_bytes", f"{self.quota_max_bytes} < 0")
        _check(self.quota_max_sessions >= 0, "quotas.max_sessions", f"{self.quota_max_sessions} < 0")
        tenants = set(self.tokens) or {"default"}
        for tenant, quota in self.tenant_quotas.items():
            _check(isinstance(quota, TenantQuota), f"tenants.{tenant}", f"{quota!r} is not a TenantQuota")
            _check(tenant in tenants, f"tenants.{tenant}",
                   f"no such tenant in auth.tokens (known: {', '.join(sorted(tenants))})")
        _check(bool(self.tokens) or is_loopback(host), "server.listen",
               f"{self.listen} is not a loopback address and no auth.tokens are configured: "
               f"configure tenant tokens to serve beyond this machine")

    @property
    def host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return split_listen(self.listen)[1]

    @property
    def ssd_dir(self) -> Path:
        return self.data_dir / "ssd"

    @property
    def secret_path(self) -> Path:
        """The service secret: nodes that resume each other's sessions must share this file."""
        return self.secret_file or self.data_dir / "secret"

    def with_overrides(self, **changes: Any) -> ServiceConfig:
        """A copy with the given fields replaced (None values are ignored), validated."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def split_listen(listen: str) -> tuple[str, int]:
    """"HOST:PORT" or "[v6]:PORT" -> (host, port); ConfigError when malformed."""
    host, sep, port = str(listen).rpartition(":")
    _check(bool(sep) and bool(host) and port.isdigit(), "server.listen", f"{listen!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_kind(name: str) -> int | None:
    """A kind code from its name ("opaque") or its number ("6"); None if it is neither."""
    if name.isdigit():
        return int(name) if 0 < int(name) < 1 << 16 else None
    try:
        return int(StateKind[name.upper()])
    except KeyError:
        return None


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"config {name}: {why}")


# (section, key) -> field name; the environment name is STATESTORE_<SECTION>_<KEY>.
_KEYS: dict[tuple[str, str], str] = {
    ("server", "listen"): "listen",
    ("server", "max_message_bytes"): "max_message_bytes",
    ("server", "max_record_bytes"): "max_record_bytes",
    ("server", "max_stream_bytes"): "max_stream_bytes",
    ("server", "grace_s"): "grace_s",
    ("tls", "cert"): "tls_cert",
    ("tls", "key"): "tls_key",
    ("auth", "tokens"): "tokens",
    ("metrics", "port"): "metrics_port",
    ("metrics", "addr"): "metrics_addr",
    ("storage", "data_dir"): "data_dir",
    ("storage", "host_budget_bytes"): "host_budget_bytes",
    ("storage", "ssd_budget_bytes"): "ssd_budget_bytes",
    ("storage", "ssd_recycle_bytes"): "ssd_recycle_bytes",
    ("storage", "ssd_loop_reads"): "ssd_loop_reads",
    ("storage", "ssd_read_poll_us"): "ssd_read_poll_us",
    ("storage", "ssd_index_snapshot"): "ssd_index_snapshot",
    ("storage", "redis_url"): "redis_url",
    ("storage", "redis_prefix"): "redis_prefix",
    ("storage", "redis_bulk_reads"): "redis_bulk_reads",
    ("storage", "cache_kinds"): "cache_kinds",
    ("storage", "secret_file"): "secret_file",
    ("storage", "policy"): "policy",
    ("storage", "profile"): "profile",
    ("engine", "preset"): "engine_preset",
    ("engine", "seed"): "engine_seed",
    ("sessions", "block_size"): "block_size",
    ("sessions", "durability"): "durability",
    ("sessions", "default_mode"): "default_mode",
    ("sessions", "keep_rings_ttl_s"): "keep_rings_ttl_s",
    ("quotas", "max_bytes"): "quota_max_bytes",
    ("quotas", "max_sessions"): "quota_max_sessions",
}
_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False, "on": True, "off": False}
_SHORT_ENV = {"STATESTORE_LISTEN": "listen", "STATESTORE_DATA_DIR": "data_dir", "STATESTORE_TOKENS": "tokens"}
_TYPES = {f.name: f.type for f in fields(ServiceConfig)}


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert a TOML or environment value to the field's type; ConfigError naming the source."""
    kind = _TYPES[name]
    try:
        if name == "tokens":
            if isinstance(value, str):
                pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
                if any(len(p) != 2 for p in pairs):
                    raise ValueError("expected tenant=token[,tenant=token...]")
                value = {t.strip(): tok.strip() for t, tok in pairs}
            if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
                raise ValueError("expected a table of tenant = \"token\"")
            return dict(value)
        if name == "cache_kinds":
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or not all(isinstance(v, (str, int)) for v in value):
                raise ValueError("expected kind names or codes, e.g. [\"opaque\"] or \"opaque,6\"")
            return tuple(str(v).lower() for v in value)
        if kind == "bool":
            if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
                return _BOOL_WORDS[value.strip().lower()]
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false ({', '.join(_BOOL_WORDS)})")
            return value
        if kind == "int":
            if isinstance(value, bool) or (not isinstance(value, (int, str))):
                raise ValueError("expected an integer")
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if "Path" in kind:
            if not isinstance(value, str):
                raise ValueError("expected a path string")
            return None if value == "" and "None" in kind else Path(value).expanduser()
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value
    except ValueError as exc:
        raise ConfigError(f"config {name} from {source}: {value!r}: {exc}") from None


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> ServiceConfig:
    """The embedded default, updated by the TOML file at `path` (if any), then by `env`."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_from_toml(Path(path)))
    for (section, key), name in _KEYS.items():
        var = f"STATESTORE_{section.upper()}_{key.upper()}"
        if var in env:
            values[name] = _coerce(name, env[var], var)
    for var, name in _SHORT_ENV.items():
        if var in env:
            values[name] = _coerce(name, env[var], var)
    try:
        return ServiceConfig(**values)
    except TypeError as exc:  # a value of the wrong type reached a comparison
        raise ConfigError(f"config: {exc}") from None


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for section, table in doc.items():
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: top-level key {section!r} must be a [section]")
        if section == "tenants":
            values["tenant_quotas"] = _tenant_quotas(table, f"{path} [tenants]")
            continue
        for key, value in table.items():
            name = _KEYS.get((section, key))
            if name is None:
                known = ", ".join(sorted(f"{s}.{k}" for s, k in _KEYS))
                raise ConfigError(f"config file {path}: unknown setting {section}.{key}; known: {known}")
            values[name] = _coerce(name, value, f"{path} [{section}] {key}")
    return values


def _tenant_quotas(table: Mapping[str, Any], source: str) -> dict[str, TenantQuota]:
    """`[tenants.<name>]` tables -> TenantQuota per tenant; ConfigError naming the setting."""
    out = {}
    for tenant, quotas in table.items():
        if not isinstance(quotas, dict):
            raise ConfigError(f"config tenants.{tenant} from {source}: expected a [tenants.{tenant}] table")
        unknown = set(quotas) - set(QUOTA_NAMES)
        if unknown:
            raise ConfigError(f"config tenants.{tenant} from {source}: unknown setting(s) "
                              f"{', '.join(sorted(unknown))}; known: {', '.join(QUOTA_NAMES)}")
        try:
            out[tenant] = TenantQuota(**quotas)
        except ConfigError as exc:
            raise ConfigError(f"config tenants.{tenant} from {source}: {exc}") from None
    return out
