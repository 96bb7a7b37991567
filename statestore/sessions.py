"""Agent sessions: create, append, generate, checkpoint, go idle, resume anywhere, continue.

A session (tenant, session id) lives in memory as an engine state while it is active. A
checkpoint persists only what must be kept::

    block records   GLOBAL_KV + INDEX_K of each new complete block of B tokens, keyed by the
                    prefix chain (shared with every session of the tenant with that prefix)
    tail records    the global entries of the last (T mod B) tokens (a ratio-r source holds
                    the groups completed by T; the rest of a group is rebuildable: kept with
                    the rings, else replayed); versioned, rewritten at each checkpoint
    tokens record   all T token ids (int32); versioned
    rings           optional: SWA rings + compressor tails + last logits (REBUILDABLE, host
                    RAM, expires after `keep_rings_ttl_s`)
    manifest        one record naming all of the above: written last, in one atomic put

Because the manifest is one record written after everything it names is durable, a crash
mid-checkpoint leaves the previous manifest, whose versioned records are deleted only after
the new manifest is durable. A resume loads the manifest, the blocks and the tail through the
store's tiers, then replays the rest through the engine (replay/): `exact`, `bounded` or `off`.

Engine work (torch) runs on one worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import struct
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from engine_adapter.base import Codec, EngineAdapter, StateKind, StatePayload
from replay import ReplayPlan, execute_replay, plan_replay
from statestore.keys import BlockHasher, check_block_size, derive_tenant_salt, tenant_id
from statestore.store import TieredStore
from statestore.types import TIER_ORDER, Durability, PutHints, TierName
from tiers.offload import wait_through_cancel
from tiers.record import HEADER_SIZE, KEY_BYTES, ZERO_KEY, Record, RecordKey, make_record, make_record_key

logger = logging.getLogger(__name__)

MANIFEST_KIND = 0x100
"""Record kind code of session manifests (beyond the model's `StateKind`s)."""
MANIFEST_FORMAT = 1
OBJECT_LAYOUT = 2
"""How a checkpoint's versioned records (tail, token ids, rings) are keyed. Layout 1: one block
key per object and kind ("tail-GLOBAL_KV", "tokens", "rings-SWA_RING", ...). Layout 2: one
block key per checkpoint version for all of them (their kinds tell them apart), so they share
one Redis Cluster hash tag, i.e. one slot, as the kinds of a block do. A manifest names its
layout; manifests written before the field existed are layout 1."""
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
REPLAY_MODES = ("exact", "bounded", "off")
# Block pairs a resume loads at once. After a restart they come from the SSD tier, whose reads
# then overlap (worker threads; native AIO from the loop for records below 2 MiB): 256 records of
# 228 KB (V4.1 global-KV blocks) from a cold SSD tier through `TieredStore.get`, 144 ms one at a
# time against 92 ms eight at a time on the development VM.
LOAD_BLOCKS_IN_FLIGHT = 8
_PERSON_SESSION = b"ss.session.v1"
_PERSON_OBJECT = b"ss.sess-obj.v1"
T = TypeVar("T")


class SessionError(Exception):
    """Base of the errors a session call reports to its caller."""


class SessionNotFound(SessionError):
    """No such session (neither live nor checkpointed) for this tenant."""


class SessionExists(SessionError):
    """`create` of a session id the tenant already uses."""


class ModelMismatch(SessionError):
    """The checkpoint was written by another model (fingerprint differs)."""


class CheckpointIncomplete(SessionError):
    """The records a manifest names are gone from every tier (and cannot be recomputed)."""


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """Knobs of the session layer."""

    secret: bytes  # service secret: per-tenant key salts derive from it (16..64 bytes)
    block_size: int = 256
    durability: Durability = Durability.LOCAL  # checkpoint default
    default_mode: str = "bounded"
    keep_rings_ttl_s: float | None = None  # keep SWA rings of the last checkpoint in host RAM this long


@dataclass(frozen=True, slots=True)
class Manifest:
    """The durable description of a session's last checkpoint (JSON in one record)."""

    tenant: str
    session_id: str
    version: int
    model_fingerprint: str  # hex
    block_size: int
    num_tokens: int
    block_keys: tuple[str, ...]  # hex, one per complete block
    tail_start: int
    tail_end: int  # global entries of [tail_start, tail_end) are in the tail records
    message_boundaries: tuple[int, ...]
    durability: int
    created_at: float
    rings_until: float | None = None  # rings record valid until this wall-clock time
    object_layout: int = 1  # how the versioned records are keyed (OBJECT_LAYOUT)

    def to_bytes(self) -> bytes:
        doc = {"format": MANIFEST_FORMAT, **asdict(self)}
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, payload: bytes | memoryview) -> Manifest:
        """Parse and validate; a malformed manifest raises ValueError naming the field. (A tier may
        hand back a large payload as a read-only view, which json.loads does not take.)"""
        try:
            doc = json.loads(bytes(payload) if isinstance(payload, memoryview) else payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"manifest is not JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {doc.get('format') if isinstance(doc, dict) else doc!r} is not "
                             f"{MANIFEST_FORMAT}")
        try:
            m = cls(tenant=str(doc["tenant"]), session_id=str(doc["session_id"]), version=int(doc["version"]),
                    model_fingerprint=str(doc["model_fingerprint"]), block_size=int(doc["block_size"]),
                    num_tokens=int(doc["num_tokens"]), block_keys=tuple(str(k) for k in doc["block_keys"]),
                    tail_start=int(doc["tail_start"]), tail_end=int(doc["tail_end"]),
                    message_boundaries=tuple(int(b) for b in doc["message_boundaries"]),
                    durability=int(doc["durability"]), created_at=float(doc["created_at"]),
                    rings_until=None if doc.get("rings_until") is None else float(doc["rings_until"]),
                    object_layout=int(doc.get("object_layout", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"manifest field missing or mistyped: {exc}") from exc
        m.validate()
        return m

    def validate(self) -> None:
        if self.object_layout not in (1, OBJECT_LAYOUT):
            raise ValueError(f"manifest: unknown object_layout {self.object_layout}")
        if self.block_size < 1 or self.num_tokens < 0 or self.version < 1:
            raise ValueError("manifest: block_size, num_tokens or version out of range")
        if len(self.block_keys) != self.num_tokens // self.block_size:
            raise ValueError(f"manifest: {len(self.block_keys)} block keys for {self.num_tokens} tokens "
                             f"of blocks of {self.block_size}")
        if any(len(k) != 2 * KEY_BYTES for k in self.block_keys):
            raise ValueError("manifest: a block key is not 32 bytes of hex")
        if not len(self.block_keys) * self.block_size == self.tail_start <= self.tail_end <= self.num_tokens:
            raise ValueError(f"manifest: tail [{self.tail_start}, {self.tail_end}) does not follow the blocks")


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What `get`/`list` report of a session."""

    session_id: str
    num_tokens: int
    live: bool
    checkpoint_version: int | None
    checkpointed_tokens: int | None
    message_boundaries: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CheckpointReport:
    version: int
    num_tokens: int
    new_blocks: int  # block records written by this checkpoint
    shared_blocks: int  # blocks already stored (this session's earlier checkpoint or another session)
    bytes_written: dict[str, int]  # per kind name (+ "manifest")
    seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_written.values())


@dataclass(frozen=True, slots=True)
class ResumePlan:
    """What a resume would do, computed without doing it."""

    session_id: str
    num_tokens: int
    bytes_by_tier: dict[str, int]  # bytes to load, per tier holding them (fastest copy)
    missing_blocks: int  # blocks gone from every tier: recomputed by the replay
    rings_available: bool
    replay: ReplayPlan
    est_load_seconds: float

    @property
    def est_seconds(self) -> float:
        return self.est_load_seconds + (0.0 if self.rings_available else self.replay.est_seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "num_tokens": self.num_tokens, "bytes_by_tier": self.bytes_by_tier,
                "missing_blocks": self.missing_blocks, "rings_available": self.rings_available,
                "replay": self.replay.to_dict(), "est_load_seconds": self.est_load_seconds,
                "est_seconds": self.est_seconds}


@dataclass(frozen=True, slots=True)
class ResumeReport:
    mode: str  # the replay mode used, or "rings" when the kept rings made replay unnecessary
    num_tokens: int
    persisted_tokens: int
    bytes_loaded: int  # payload bytes read from the tiers: token ids, global state used, rings
    replay_tokens: int
    row_layers: int
    load_seconds: float
    replay_seconds: float

    @property
    def seconds(self) -> float:
        return self.load_seconds + self.replay_seconds


@dataclass(eq=False)
class _Live:
    """An active session: its engine state and what has been persisted of it."""

    state: object
    block_keys: list[bytes] = field(default_factory=list)
    persisted_blocks: int = 0  # block records known durable at the checkpoint level
    version: int = 0
    boundaries: list[int] = field(default_factory=list)
    generated: int = 0  # tokens generated since the last checkpoint: the turn's outcome it reports
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionManager:
    """Sessions of every tenant over one store and one engine adapter.

    Args:
        store: the tiered store (opened by the caller).
        adapter: the engine.
        config: `SessionConfig`.
    """

    def __init__(self, store: TieredStore, adapter: EngineAdapter, config: SessionConfig) -> None:
        align = adapter.token_alignment
        check_block_size(config.block_size, [align])
        if config.default_mode not in REPLAY_MODES:
            raise ValueError(f"default_mode must be one of {REPLAY_MODES}, got {config.default_mode!r}")
        self.store = store
        self.adapter = adapter
        self.config = config
        self._live: dict[tuple[str, str], _Live] = {}
        store.track_kind(MANIFEST_KIND)  # a tenant's manifests are found without a pass over the index
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._salts: dict[str, bytes] = {}

    async def aclose(self) -> None:
        """Drop live sessions (they are not checkpointed) and stop the engine thread."""
        self._live.clear()
        self._executor.shutdown(wait=True)

    # ----- keys ------------------------------------------------------------------------------

    def _salt(self, tenant: str) -> bytes:
        if tenant not in self._salts:
            self._salts[tenant] = derive_tenant_salt(self.config.secret, tenant)
        return self._salts[tenant]

    def _hasher(self, tenant: str) -> BlockHasher:
        return BlockHasher(self.config.block_size, self.adapter.model_fingerprint, self._salt(tenant))

    def _session_key(self, tenant: str, session_id: str) -> bytes:
        return hashlib.blake2b(session_id.encode(), digest_size=KEY_BYTES, key=self._salt(tenant),
                               person=_PERSON_SESSION).digest()

    def _object_key(self, tenant: str, session_id: str, what: str, version: int) -> bytes:
        data = self._session_key(tenant, session_id) + f"{what}:{version}".encode()
        return hashlib.blake2b(data, digest_size=KEY_BYTES, key=self._salt(tenant), person=_PERSON_OBJECT).digest()

    def _version_key(self, tenant: str, session_id: str, what: str, kind: StateKind, version: int,
                     layout: int | None = None) -> bytes:
        """Block key of a checkpoint's versioned object ("tail", "tokens" or "rings") of `kind`,
        in `layout` (default: the one new checkpoints use)."""
        if (OBJECT_LAYOUT if layout is None else layout) == 1:
            return self._object_key(tenant, session_id, what if what == "tokens" else f"{what}-{kind.name}", version)
        return self._object_key(tenant, session_id, "checkpoint", version)

    def _manifest_key(self, tenant: str, session_id: str) -> RecordKey:
        return make_record_key(MANIFEST_KIND, self._session_key(tenant, session_id))

    # ----- validation ------------------------------------------------------------------------

    @staticmethod
    def check_session_id(session_id: str) -> None:
        if not isinstance(session_id, str) or not SESSION_ID_PATTERN.fullmatch(session_id):
            raise ValueError(f"session_id {session_id!r} is invalid: use 1..128 characters of letters, digits "
                             f"and . _ : @ -, starting with a letter or digit")

    def _check_tokens(self, token_ids: Sequence[int]) -> list[int]:
        tokens = [int(t) for t in token_ids]
        vocab = getattr(getattr(self.adapter, "config", None), "vocab_size", None)
        if vocab is not None:
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"token id {bad} outside the model's vocabulary [0, {vocab})")
        return tokens

    # ----- engine thread -----------------------------------------------------------------------

    async def _run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the engine thread. A cancellation is raised only once it returned: the
        caller holds the session's lock until the engine is done with its state (else the next
        call on the session read the state on the loop while the engine thread still wrote it)."""
        return await wait_through_cancel(asyncio.get_running_loop().run_in_executor(self._executor, fn, *args))

    # ----- life cycle of a session ---------------------------------------------------------------

    async def create(self, tenant: str, session_id: str) -> SessionInfo:
        """A new, empty session. Refused if the tenant already has one of that id."""
        self.check_session_id(session_id)
        if (tenant, session_id) in self._live or await self._load_manifest(tenant, session_id) is not None:
            raise SessionExists(f"session {session_id!r} already exists")
        live = _Live(state=await self._run(self.adapter.new_state))
        self._live[tenant, session_id] = live
        return await self.get(tenant, session_id)

    async def append(self, tenant: str, session_id: str, token_ids: Sequence[int]) -> SessionInfo:
        """Prefill new tokens (a message) through the engine; marks a message boundary."""
        tokens = self._check_tokens(token_ids)
        if not tokens:
            raise ValueError("append needs at least one token")
        live = self._get_live(tenant, session_id)
        async with live.lock:
            before = self.adapter.num_tokens(live.state)
            try:
                await self._run(self.adapter.append, live.state, tokens)
            finally:  # a cancelled append that the engine did still marks its boundary
                if (after := self.adapter.num_tokens(live.state)) != before:
                    live.boundaries.append(after)
        return await self.get(tenant, session_id)

    async def generate(self, tenant: str, session_id: str, num_tokens: int, temperature: float = 0.0,
                       seed: int | None = None) -> list[int]:
        """Generate and append `num_tokens` tokens (greedy at temperature 0)."""
        if not 1 <= num_tokens <= 1 << 16:
            raise ValueError(f"num_tokens must lie in [1, 65536], got {num_tokens}")
        if not 0.0 <= temperature <= 100.0:
            raise ValueError(f"temperature must lie in [0, 100], got {temperature}")
        live = self._get_live(tenant, session_id)
        async with live.lock:
            if self.adapter.num_tokens(live.state) == 0:
                raise ValueError(f"session {session_id!r} is empty: append a prompt before generating")
            before = self.adapter.num_tokens(live.state)
            try:
                tokens = await self._run(self.adapter.generate, live.state, num_tokens, temperature, seed)
            except asyncio.CancelledError:  # raised once the engine is done: count what it generated
                live.generated += self.adapter.num_tokens(live.state) - before
                raise
            live.generated += len(tokens)
            return tokens

    async def drop(self, tenant: str, session_id: str) -> bool:
        """Forget the in-memory state (what a checkpoint saved stays)."""
        return self._live.pop((tenant, session_id), None) is not None

    def live_state(self, tenant: str, session_id: str) -> object:
        """The engine state of an active session, opaque (only the adapter looks inside).

        For diagnostics and tests (e.g. comparing a resumed state's logits with an
        uninterrupted run's); do not mutate it while the session is in use.
        """
        return self._get_live(tenant, session_id).state

    def _get_live(self, tenant: str, session_id: str) -> _Live:
        self.check_session_id(session_id)
        live = self._live.get((tenant, session_id))
        if live is None:
            raise SessionNotFound(f"session {session_id!r} is not active: resume it first (or create it)")
        return live

    async def get(self, tenant: str, session_id: str) -> SessionInfo:
        self.check_session_id(session_id)
        return self._info(session_id, self._live.get((tenant, session_id)),
                          await self._load_manifest(tenant, session_id))

    def _info(self, session_id: str, live: _Live | None, manifest: Manifest | None) -> SessionInfo:
        """What `get` says of a session that is live, checkpointed, or both (SessionNotFound: neither)."""
        if live is not None:
            num_tokens, boundaries = self.adapter.num_tokens(live.state), tuple(live.boundaries)
        elif manifest is not None:
            num_tokens, boundaries = manifest.num_tokens, manifest.message_boundaries
        else:
            raise SessionNotFound(f"no session {session_id!r}")
        return SessionInfo(session_id=session_id, num_tokens=num_tokens, live=live is not None,
                           checkpoint_version=manifest.version if manifest else None,
                           checkpointed_tokens=manifest.num_tokens if manifest else None,
                           message_boundaries=boundaries)

    async def list(self, tenant: str) -> list[SessionInfo]:
        """Live sessions and checkpointed ones this node's store knows of, sorted by id (each
        manifest read once)."""
        manifests = {m.session_id: m for m in await self._known_manifests(tenant)}
        ids = {sid for (t, sid) in self._live if t == tenant} | set(manifests)
        return [self._info(sid, self._live.get((tenant, sid)), manifests.get(sid)) for sid in sorted(ids)]

    def count(self, tenant: str) -> int:
        """How many sessions `list` would list, from the index alone (no manifest is read): a
        `max_sessions` check on every Create. (A manifest that no longer reads is counted here
        and not listed there.)"""
        keys = set(self.store.keys_of_kind(tenant_id(tenant), MANIFEST_KIND))
        keys.update(self._manifest_key(tenant, sid) for (t, sid) in self._live if t == tenant)
        return len(keys)

    async def _known_manifests(self, tenant: str) -> list[Manifest]:
        tid = tenant_id(tenant)
        out = []
        for key in self.store.keys_of_kind(tid, MANIFEST_KIND):
            record = await self.store.get(key, expect_tenant=tid)
            if record is not None:
                out.append(Manifest.from_bytes(record.payload))
        return out

    # ----- checkpoint ------------------------------------------------------------------------

    async def checkpoint(self, tenant: str, session_id: str, durability: Durability | None = None) -> CheckpointReport:
        """Persist what must be kept of the session, atomically (see the module docstring)."""
        durability = Durability(durability or self.config.durability)
        live = self._get_live(tenant, session_id)
        async with live.lock:
            if self.adapter.num_tokens(live.state) == 0:  # a resume could not replay it (plan_replay needs T >= 1)
                raise ValueError(f"session {session_id!r} is empty: append a prompt before checkpointing")
            start = time.perf_counter()
            previous = await self._load_manifest(tenant, session_id)
            written, new_blocks, shared = await self._put_blocks(tenant, live, durability)
            version = max(live.version, previous.version if previous else 0) + 1
            num_tokens = self.adapter.num_tokens(live.state)
            tail_start = len(live.block_keys) * self.config.block_size
            # The tail runs to T, not to T aligned down: with odd T a ratio-1 source's last entry
            # exists nowhere else, and kept rings (which carry no global entries) need it.
            tail_end = num_tokens
            exported = await self._run(self._export_checkpoint, live.state, tail_start, tail_end)
            parent = live.block_keys[-1] if live.block_keys else ZERO_KEY
            for payload in exported["tail"]:
                written[payload.kind.name] = written.get(payload.kind.name, 0) + await self._put_payload(
                    tenant, self._version_key(tenant, session_id, "tail", payload.kind, version),
                    parent, payload, durability)
            written["TOKENS"] = await self._put_payload(
                tenant, self._version_key(tenant, session_id, "tokens", StateKind.TOKENS, version), ZERO_KEY,
                exported["tokens"], durability)
            rings_until = await self._maybe_keep_rings(tenant, session_id, version, exported.get("rings", []), written)
            manifest = Manifest(
                tenant=tenant, session_id=session_id, version=version,
                model_fingerprint=self.adapter.model_fingerprint.hex(), block_size=self.config.block_size,
                num_tokens=num_tokens, block_keys=tuple(k.hex() for k in live.block_keys),
                tail_start=tail_start, tail_end=tail_end, message_boundaries=tuple(live.boundaries),
                durability=int(durability), created_at=time.time(), rings_until=rings_until,
                object_layout=OBJECT_LAYOUT)
            written["manifest"] = await self._put_manifest(tenant, session_id, manifest, durability)
            live.version = version
            if previous is not None:
                await self._delete_objects(tenant, session_id, previous)
            if live.generated:  # a turn ended: how long its answer was says whether the agent comes back
                self.store.request_done(self._block_record_keys(manifest), live.generated)
                live.generated = 0
            return CheckpointReport(version, num_tokens, new_blocks, shared, written, time.perf_counter() - start)

    def _export_checkpoint(self, state: object, tail_start: int, tail_end: int) -> dict[str, Any]:
        """Engine thread: the tail's global entries, the token ids and (if kept) the rings."""
        tokens = self.adapter.token_ids(state)
        out: dict[str, Any] = {
            "tail": self.adapter.export_range(state, tail_start, tail_end) if tail_end > tail_start else [],
            "tokens": StatePayload(StateKind.TOKENS, Codec.INT32, 0, len(tokens), _pack_int32(tokens)),
        }
        if self.config.keep_rings_ttl_s:
            out["rings"] = self.adapter.export_rebuildable(state)
        return out

    async def _put_blocks(self, tenant: str, live: _Live, durability: Durability) -> tuple[dict[str, int], int, int]:
        """Key the new complete blocks and persist the ones the store lacks at this durability."""
        tokens = await self._run(self.adapter.token_ids, live.state)
        live.block_keys += self._hasher(tenant)(tokens, live.block_keys)
        written: dict[str, int] = {}
        new = shared = 0
        b = self.config.block_size
        for i in range(live.persisted_blocks, len(live.block_keys)):
            key, parent = live.block_keys[i], live.block_keys[i - 1] if i else ZERO_KEY
            if await self._block_stored(key, durability):
                shared += 1
                continue
            for payload in await self._run(self.adapter.export_range, live.state, i * b, (i + 1) * b):
                written[payload.kind.name] = written.get(payload.kind.name, 0) + await self._put_payload(
                    tenant, key, parent, payload, durability)
            new += 1
        live.persisted_blocks = len(live.block_keys)
        return written, new, shared

    async def _block_stored(self, block_key: bytes, durability: Durability) -> bool:
        for kind in (StateKind.GLOBAL_KV, StateKind.INDEX_K):
            meta = self.store.meta(make_record_key(int(kind), block_key))
            if meta is None or not meta.acked or meta.durability < durability:
                return False
        return True

    async def _put_payload(self, tenant: str, key: bytes, parent: bytes, payload: StatePayload,
                           durability: Durability, hints: PutHints | None = None) -> int:
        record = make_record(int(payload.kind), int(payload.codec), payload.payload,
                             model_fingerprint=self.adapter.model_fingerprint, tenant_id=tenant_id(tenant),
                             block_key=key, parent_key=parent, token_start=payload.token_start,
                             token_end=payload.token_end, entry_count=payload.entry_count)
        await self.store.put(record, durability, hints=hints)
        return record.nbytes

    async def _maybe_keep_rings(self, tenant: str, session_id: str, version: int, payloads: list[StatePayload],
                                written: dict[str, int]) -> float | None:
        """Keep the rebuildable state in host RAM (MEMORY) for the configured TTL, best effort."""
        ttl = self.config.keep_rings_ttl_s
        if not ttl or not payloads:
            return None
        hints = PutHints(expected_return_s=ttl, ttl_s=ttl)
        for payload in payloads:
            key = self._version_key(tenant, session_id, "rings", payload.kind, version)
            written[payload.kind.name] = written.get(payload.kind.name, 0) + await self._put_payload(
                tenant, key, ZERO_KEY, payload, Durability.MEMORY, hints)
        return time.time() + ttl

    async def _put_manifest(self, tenant: str, session_id: str, manifest: Manifest, durability: Durability) -> int:
        record = make_record(MANIFEST_KIND, 0, manifest.to_bytes(), model_fingerprint=self.adapter.model_fingerprint,
                             tenant_id=tenant_id(tenant), block_key=self._session_key(tenant, session_id),
                             token_end=manifest.num_tokens)
        await self.store.put(record, durability)
        return record.nbytes

    async def _load_manifest(self, tenant: str, session_id: str) -> Manifest | None:
        record = await self.store.get(self._manifest_key(tenant, session_id), expect_tenant=tenant_id(tenant))
        if record is None:
            return None
        manifest = Manifest.from_bytes(record.payload)
        if manifest.session_id != session_id or manifest.tenant != tenant:
            logger.warning("manifest under the key of %s names another session; ignored", session_id)
            return None
        return manifest

    def _object_keys(self, tenant: str, session_id: str, manifest: Manifest) -> list[RecordKey]:
        """Record keys of the manifest's versioned objects: tokens, tail (2), rings (3), in that order."""
        objects = [("tokens", StateKind.TOKENS), ("tail", StateKind.GLOBAL_KV), ("tail", StateKind.INDEX_K),
                   ("rings", StateKind.SWA_RING), ("rings", StateKind.COMPRESSOR_TAIL), ("rings", StateKind.OPAQUE)]
        return [make_record_key(int(kind), self._version_key(tenant, session_id, what, kind, manifest.version,
                                                             manifest.object_layout))
                for what, kind in objects]

    async def _delete_objects(self, tenant: str, session_id: str, manifest: Manifest) -> None:
        for key in self._object_keys(tenant, session_id, manifest):
            await self.store.evict(key, force=True)

    # ----- resume ----------------------------------------------------------------------------

    async def plan_resume(self, tenant: str, session_id: str, mode: str | None = None) -> ResumePlan:
        """Bytes to load per tier, rows to replay and the estimated seconds, without resuming.

        Sizes come from the local index; records only a shared tier holds (another node wrote
        them) are sized from the engine's specs, so a fresh node's plan is not empty.
        """
        mode = self._check_mode(mode)
        manifest = await self._require_manifest(tenant, session_id)
        block_records = self._block_record_keys(manifest)
        lookup = await self.store.lookup(block_records)
        loaded_blocks = lookup.combined // 2
        tail_and_tokens = self._object_keys(tenant, session_id, manifest)[:3]
        bytes_by_tier: dict[str, int] = {}
        for i, key in enumerate(block_records[: 2 * loaded_blocks] + tail_and_tokens):
            tier, nbytes = self._fastest_copy(key, manifest, lookup.per_tier, i)
            bytes_by_tier[tier.value] = bytes_by_tier.get(tier.value, 0) + nbytes
        persisted = manifest.tail_end if loaded_blocks == len(manifest.block_keys) else loaded_blocks * manifest.block_size
        plan = plan_replay(self.adapter.replay_geometry(), self.adapter.costs(), mode, manifest.num_tokens, persisted)
        est_load = sum(self.store.load_time_s(TierName(t), b) for t, b in bytes_by_tier.items())
        return ResumePlan(session_id, manifest.num_tokens, bytes_by_tier, len(manifest.block_keys) - loaded_blocks,
                          self._rings_valid(manifest), plan, est_load)

    def _fastest_copy(self, key: RecordKey, manifest: Manifest, prefix_hits: dict[TierName, int],
                      position: int) -> tuple[TierName, int]:
        """Where a resume would read `key` from, and its bytes (estimated from specs if unindexed)."""
        meta = self.store.meta(key)
        if meta is not None and meta.tiers:
            return next(t for t in TIER_ORDER if t in meta.tiers), meta.size_bytes
        tier = next((t for t in TIER_ORDER if prefix_hits.get(t, 0) > position), TierName.REDIS)
        kind = StateKind(int.from_bytes(key[:2], "big"))
        if kind is StateKind.TOKENS:
            tokens = manifest.num_tokens
        elif position < 2 * len(manifest.block_keys):
            tokens = manifest.block_size
        else:
            tokens = manifest.tail_end - manifest.tail_start
        spec = next(s for s in self.adapter.state_specs() if s.kind is kind)
        return tier, HEADER_SIZE + spec.bytes_for_tokens(tokens)

    async def resume(self, tenant: str, session_id: str, mode: str | None = None) -> ResumeReport:
        """Load the last checkpoint into a fresh engine state and make it ready to generate."""
        mode = self._check_mode(mode)
        if (tenant, session_id) in self._live:
            raise ValueError(f"session {session_id!r} is already active; drop it before resuming")
        manifest = await self._require_manifest(tenant, session_id)
        t0 = time.perf_counter()
        tokens = await self._load_tokens(tenant, session_id, manifest)
        rings = await self._load_rings(tenant, session_id, manifest) if self._rings_valid(manifest) else None
        if mode == "off" and rings is None:  # a re-prefill needs the token ids alone: load no global state,
            payloads, nbytes = [], 0      # but count the stored blocks so a checkpoint never rewrites them
            stored = await self.store.lookup(self._block_record_keys(manifest))
            persisted = stored.combined // 2 * manifest.block_size
        else:
            payloads, persisted, nbytes = await self._load_global(tenant, session_id, manifest)
        nbytes += 4 * len(tokens)
        state = await self._run(self.adapter.new_state)
        await self._run(self.adapter.import_range, state, payloads)
        load_s = time.perf_counter() - t0
        if rings is not None and persisted == manifest.tail_end:
            await self._run(self.adapter.import_rebuildable, state, tokens, rings)
            report = ResumeReport("rings", len(tokens), persisted, nbytes + sum(len(p.payload) for p in rings),
                                  0, 0, load_s, time.perf_counter() - t0 - load_s)
        else:
            plan = plan_replay(self.adapter.replay_geometry(), self.adapter.costs(), mode, len(tokens), persisted)
            if plan.rows is None:
                state = await self._run(self.adapter.new_state)  # `off`: re-prefill from tokens alone
            done = await self._run(execute_replay, self.adapter, state, tokens, plan)
            report = ResumeReport(mode, len(tokens), plan.persisted_tokens, nbytes,
                                  done.replay_tokens, done.row_layers, load_s, done.seconds)
        known = [bytes.fromhex(k) for k in manifest.block_keys]
        self._live[tenant, session_id] = _Live(state=state, block_keys=known,
                                               persisted_blocks=persisted // manifest.block_size,
                                               version=manifest.version, boundaries=list(manifest.message_boundaries))
        return report

    def _check_mode(self, mode: str | None) -> str:
        mode = mode or self.config.default_mode
        if mode not in REPLAY_MODES:
            raise ValueError(f"replay mode must be one of {', '.join(REPLAY_MODES)}, got {mode!r}")
        return mode

    async def _require_manifest(self, tenant: str, session_id: str) -> Manifest:
        self.check_session_id(session_id)
        manifest = await self._load_manifest(tenant, session_id)
        if manifest is None:
            raise SessionNotFound(f"no checkpoint of session {session_id!r}")
        if manifest.model_fingerprint != self.adapter.model_fingerprint.hex():
            raise ModelMismatch(f"session {session_id!r} was checkpointed by model {manifest.model_fingerprint}, "
                                f"this engine is {self.adapter.model_fingerprint.hex()}")
        return manifest

    def _rings_valid(self, manifest: Manifest) -> bool:
        return manifest.rings_until is not None and time.time() < manifest.rings_until

    def _block_record_keys(self, manifest: Manifest) -> list[RecordKey]:
        return [make_record_key(int(kind), bytes.fromhex(k)) for k in manifest.block_keys
                for kind in (StateKind.GLOBAL_KV, StateKind.INDEX_K)]

    async def _get(self, tenant: str, key: RecordKey) -> Record | None:
        return await self.store.get(key, expect_fingerprint=self.adapter.model_fingerprint,
                                    expect_tenant=tenant_id(tenant))

    async def _load_tokens(self, tenant: str, session_id: str, manifest: Manifest) -> list[int]:
        key = self._object_keys(tenant, session_id, manifest)[0]
        record = await self._get(tenant, key)
        if record is None:
            raise CheckpointIncomplete(f"session {session_id!r}: the token ids of checkpoint {manifest.version} are "
                                       f"gone from every tier")
        tokens = _unpack_int32(record.payload)
        if len(tokens) != manifest.num_tokens:
            raise CheckpointIncomplete(f"session {session_id!r}: {len(tokens)} token ids stored, manifest says "
                                       f"{manifest.num_tokens}")
        return tokens

    async def _load_rings(self, tenant: str, session_id: str, manifest: Manifest) -> list[StatePayload] | None:
        out = []
        for kind, key in zip((StateKind.SWA_RING, StateKind.COMPRESSOR_TAIL, StateKind.OPAQUE),
                             self._object_keys(tenant, session_id, manifest)[3:]):
            record = await self._get(tenant, key)
            if record is None:
                return None
            h = record.header
            out.append(StatePayload(kind, _codec_of(h.codec), h.token_start, h.token_end, record.payload))
        return out

    async def _load_global(self, tenant: str, session_id: str,
                           manifest: Manifest) -> tuple[list[StatePayload], int, int]:
        """Block records then the tail, stopping at the first block missing from every tier."""
        payloads: list[StatePayload] = []
        nbytes = 0
        b = manifest.block_size
        keys = [bytes.fromhex(hex_key) for hex_key in manifest.block_keys]
        for lo in range(0, len(keys), LOAD_BLOCKS_IN_FLIGHT):
            pairs = await asyncio.gather(*(self._load_pair(tenant, key)
                                           for key in keys[lo:lo + LOAD_BLOCKS_IN_FLIGHT]))
            for i, pair in enumerate(pairs, start=lo):
                if pair is None:
                    logger.warning("session %s: block %d is gone from every tier; it will be recomputed", session_id, i)
                    return payloads, i * b, nbytes
                payloads += pair
                nbytes += sum(len(p.payload) for p in pair)
        if manifest.tail_end > manifest.tail_start:
            keys = [key[2:] for key in self._object_keys(tenant, session_id, manifest)[1:3]]
            pair = await self._load_pair(tenant, *keys)
            if pair is None:
                return payloads, manifest.tail_start, nbytes
            payloads += pair
            nbytes += sum(len(p.payload) for p in pair)
        return payloads, manifest.tail_end, nbytes

    async def _load_pair(self, tenant: str, main_key: bytes, index_key: bytes | None = None) -> list[StatePayload] | None:
        out = []
        for kind, key in ((StateKind.GLOBAL_KV, main_key), (StateKind.INDEX_K, index_key or main_key)):
            record = await self._get(tenant, make_record_key(int(kind), key))
            if record is None:
                return None
            h = record.header
            out.append(StatePayload(kind, _codec_of(h.codec), h.token_start, h.token_end, record.payload, h.entry_count))
        return out

    # ----- delete ----------------------------------------------------------------------------

    async def delete(self, tenant: str, session_id: str) -> bool:
        """Forget the session everywhere: live state, manifest, its versioned records, and the
        blocks no other checkpointed session of the tenant (known to this node) still names."""
        self.check_session_id(session_id)
        live = self._live.pop((tenant, session_id), None)
        manifest = await self._load_manifest(tenant, session_id)
        if live is None and manifest is None:
            raise SessionNotFound(f"no session {session_id!r}")
        if manifest is not None:
            await self.store.evict(self._manifest_key(tenant, session_id), force=True)
            await self._delete_objects(tenant, session_id, manifest)
            others = {k for m in await self._known_manifests(tenant) for k in m.block_keys}
            for key in self._block_record_keys(manifest):
                if key[2:].hex() not in others:
                    await self.store.evict(key, force=True)
        return True


def _codec_of(code: int) -> Codec:
    try:
        return Codec(code)
    except ValueError:
        return Codec.RAW


def _pack_int32(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def _unpack_int32(payload: bytes) -> list[int]:
    if len(payload) % 4:
        raise CheckpointIncomplete(f"token record of {len(payload)} bytes is not whole int32 ids")
    return list(struct.unpack(f"<{len(payload) // 4}i", payload))
