"""Per-tenant quotas: how many bytes of records and how many sessions a tenant may keep.

Configured in `ServiceConfig` (config.py): `[quotas]` gives the defaults of every tenant,
`[tenants.<name>]` overrides them for one tenant; 0 means unbounded. Enforced where state
enters the service, so a tenant over its quota gets RESOURCE_EXHAUSTED with a message naming
the quota and the numbers:

    PutRecords           the whole stream is admitted (or refused, storing nothing) before its
                         first put
    session checkpoints  the session layer writes through `QuotaStore`, whose `put` refuses a
                         record that would take its tenant over `max_bytes`. The manifest is
                         written last, so a refused checkpoint leaves the previous one intact;
                         block records it stored before the refusal stay (counted, and reused
                         by the next checkpoint)
    Sessions.Create      `max_sessions`: live and checkpointed sessions of the tenant together

Accounting. A tenant's bytes are the `size_bytes` (header + raw payload) of its records in
this node's index, each counted once however many tiers hold a copy. The store keeps them per
tenant where its index changes (`TieredStore.acked_bytes`: updated where an entry is set and
where one is dropped, the only two places), not in a ledger beside it, so nothing can drift:
an eviction, a delete or a restart's re-index frees quota at once, and a check costs a dict
lookup, not a pass over the index (which, with a million records, held every put of a tenant
with `max_bytes` up for a noticeable part of a second). Puts in flight (their index entries
are not yet `acked`) are counted by reservation instead, so concurrent puts of one tenant
cannot together overshoot. Quotas are per node: records only a shared tier holds (written by
another node) are not counted until this node indexes them.

Isolation needs no help from here (auth.py, keys.py, store_service.py): a tenant's keys are MAC'd
with its salt, and every per-record answer is filtered by tenant. The store-wide totals of
`Stats` (bytes and records per tier and kind, hit/miss counters, live sessions) name no key
and no session, and another tenant's keys cannot be computed without its salt, so they
reveal how busy the node is, never what another tenant stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from statestore.auth import DEFAULT_TENANT
from statestore.config import QUOTA_NAMES, TenantQuota
from statestore.keys import tenant_id
from statestore.types import Durability, PutHints, PutResult

if TYPE_CHECKING:
    from statestore.store import TieredStore
    from tiers.record import Record

__all__ = ["QUOTA_NAMES", "QuotaExceeded", "QuotaStore", "TenantQuota", "TenantQuotas"]


class QuotaExceeded(Exception):
    """A put or create would take the tenant over a quota (RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, *, tenant: str, quota: str, limit: int, used: int, need: int) -> None:
        super().__init__(message)
        self.tenant, self.quota, self.limit, self.used, self.need = tenant, quota, limit, used, need


class TenantQuotas:
    """The quotas of every tenant, and the checks that enforce them.

    Args:
        per_tenant: tenant name -> its quota (overrides `default`).
        default: the quota of a tenant without an entry.
        tenants: every tenant the server knows (from its tokens), so a record header's
            tenant id can be named; the tenants of `per_tenant` are known anyway.
    """

    def __init__(self, per_tenant: Mapping[str, TenantQuota] | None = None,
                 default: TenantQuota | None = None, tenants: Iterable[str] = ()) -> None:
        self._per_tenant = dict(per_tenant or {})
        self._default = default or TenantQuota()
        self._names: dict[bytes, str] = {tenant_id(t): t for t in (*tenants, *self._per_tenant)}
        self._reserved: dict[str, int] = {}
        self._session_locks: dict[str, asyncio.Lock] = {}

    @classmethod
    def from_config(cls, config: Any) -> TenantQuotas:
        """From a `ServiceConfig`: `tenant_quotas`, the `[quotas]` defaults, the tenants of its tokens."""
        return cls(config.tenant_quotas, TenantQuota(config.quota_max_bytes, config.quota_max_sessions),
                   tenants=config.tokens or (DEFAULT_TENANT,))

    def for_tenant(self, tenant: str) -> TenantQuota:
        return self._per_tenant.get(tenant, self._default)

    def tenant_of(self, tid: bytes) -> str | None:
        """The name of the tenant a record header's tenant id names (None: not a known tenant)."""
        return self._names.get(tid)

    # ----- bytes -------------------------------------------------------------------------------

    @staticmethod
    def stored_bytes(store: TieredStore, tenant: str) -> int:
        """Bytes of the tenant's acknowledged records in `store`'s index."""
        return store.acked_bytes(tenant_id(tenant))

    def used_bytes(self, store: TieredStore, tenant: str) -> int:
        """Stored bytes plus the bytes of the tenant's puts in flight."""
        return self.stored_bytes(store, tenant) + self._reserved.get(tenant, 0)

    def _need_bytes(self, store: TieredStore, tenant: str, records: Sequence[Record]) -> tuple[int, int]:
        """(net new bytes, bytes to reserve) of putting `records`: a re-put of one of the
        tenant's own keys needs only the difference; a key repeated in the batch counts once."""
        last = {r.key: r.nbytes for r in records}
        tid = tenant_id(tenant)
        replaced = 0
        for key in last:
            meta = store.meta(key)
            if meta is not None and meta.acked and meta.tenant_id == tid:
                replaced += meta.size_bytes
        reserve = sum(last.values())
        return reserve - replaced, reserve

    @asynccontextmanager
    async def admit_bytes(self, store: TieredStore, tenant: str, records: Sequence[Record]) -> AsyncIterator[None]:
        """Hold room for `records` while they are put; QuotaExceeded (nothing held) if they
        would take the tenant over `max_bytes`."""
        limit = self.for_tenant(tenant).max_bytes
        if not limit:
            yield
            return
        need, reserve = self._need_bytes(store, tenant, records)
        used = self.used_bytes(store, tenant)
        if used + need > limit:
            raise QuotaExceeded(
                f"tenant {tenant!r} is over its max_bytes quota: {limit} bytes allowed, {used} stored, "
                f"this put needs {need} more ({used + need} > {limit}); delete sessions or evict records, "
                f"or raise [tenants.{tenant}] max_bytes", tenant=tenant, quota="max_bytes", limit=limit,
                used=used, need=need)
        self._reserved[tenant] = self._reserved.get(tenant, 0) + reserve
        try:
            yield
        finally:
            left = self._reserved[tenant] - reserve
            if left:
                self._reserved[tenant] = left
            else:
                del self._reserved[tenant]

    def guard(self, store: TieredStore) -> TieredStore:
        """`store` as the session layer should see it: puts checked against `max_bytes`."""
        if not any(q.max_bytes for q in (self._default, *self._per_tenant.values())):
            return store
        return QuotaStore(store, self)  # type: ignore[return-value]

    # ----- sessions ----------------------------------------------------------------------------

    @asynccontextmanager
    async def admit_session(self, tenant: str, count_sessions: Callable[[], Awaitable[int]]) -> AsyncIterator[None]:
        """Around the creation of one session: QuotaExceeded if the tenant already has
        `max_sessions`. Creations of one tenant are serialized so two cannot both pass."""
        limit = self.for_tenant(tenant).max_sessions
        if not limit:
            yield
            return
        lock = self._session_locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            used = await count_sessions()
            if used + 1 > limit:
                raise QuotaExceeded(
                    f"tenant {tenant!r} is at its max_sessions quota: {limit} sessions allowed, {used} exist; "
                    f"delete a session, or raise [tenants.{tenant}] max_sessions", tenant=tenant,
                    quota="max_sessions", limit=limit, used=used, need=1)
            yield


class QuotaStore:
    """A `TieredStore` whose `put` refuses a record that would take its tenant (from the
    record header) over `max_bytes`; everything else is the store's own."""

    def __init__(self, store: TieredStore, quotas: TenantQuotas) -> None:
        self._store = store
        self._quotas = quotas

    async def put(self, record: Record, durability: Durability = Durability.MEMORY, *, pin: bool = False,
                  hints: PutHints | None = None) -> PutResult:
        tenant = self._quotas.tenant_of(record.header.tenant_id)
        if tenant is None:  # not a tenant of the server's tokens: nothing to enforce
            return await self._store.put(record, durability, pin=pin, hints=hints)
        async with self._quotas.admit_bytes(self._store, tenant, [record]):
            return await self._store.put(record, durability, pin=pin, hints=hints)

    def __len__(self) -> int:
        return len(self._store)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
