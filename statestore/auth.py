"""Who is calling: per-tenant bearer tokens in `authorization: Bearer <token>` metadata.

The tenant is never taken from a request field: a session id or a record names nothing
outside the caller's tenant. Without configured tokens every caller is tenant "default", and
`ServiceConfig` refuses to bind anything but loopback in that case. Tokens are compared in
constant time (`hmac.compare_digest`) against every configured token, so the time taken does
not reveal which tenant, or how much of a token, matched.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

DEFAULT_TENANT = "default"


class AuthError(Exception):
    """The call carries no valid credentials (PERMISSION_DENIED)."""


class TokenAuth:
    """Maps the `authorization` metadata of a call to a tenant.

    Args:
        tokens: tenant -> bearer token; empty = no auth (every caller is "default").
    """

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens = [(tenant, token.encode()) for tenant, token in tokens.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The caller's tenant; AuthError with what to send when the token is missing or unknown."""
        if not self._tokens:
            return DEFAULT_TENANT
        header = None
        for key, value in metadata or ():
            if key.lower() == "authorization":
                header = value.decode() if isinstance(value, bytes) else value
                break
        if header is None:
            raise AuthError("missing credentials: send metadata 'authorization: Bearer <token>'")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("malformed authorization metadata: expected 'Bearer <token>'")
        presented = token.strip().encode()
        found = None
        for tenant, expected in self._tokens:  # no early exit: constant time in the match position
            if hmac.compare_digest(presented, expected):
                found = tenant
        if found is None:
            raise AuthError("unknown bearer token: check --token / STATESTORE_TOKEN")
        return found
