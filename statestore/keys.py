"""Block keys: what addresses a block of state, and the namespaces that keep keys apart.

A block key is a 32-byte chain hash over (parent key, the block's token ids, model
fingerprint), keyed (BLAKE2b's MAC mode) by the tenant's secret salt:

    key_0 = H_salt(ROOT,        tokens[0:B],  fp)
    key_i = H_salt(key_{i-1},   tokens[iB:(i+1)B], fp)

Invariants:
- Equal keys mean equal prefix: the key of block i covers every token of blocks 0..i, the
  model fingerprint and the tenant. Sessions that share a system prompt share blocks.
- Partial blocks are never keyed: `BlockHasher` hashes full blocks only.
- Keys do not depend on the process: no Python `hash()`, so PYTHONHASHSEED does not matter
  (vLLM needs `init_none_hash` for that; we need no seed).
- A tenant without the salt can neither compute nor probe another tenant's keys: the
  salt is the MAC key, not hashed in the clear.
- The fingerprint covers weights identity, config, codecs and layout version, so state of
  another model or layout can never be addressed by our keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine_adapter.fingerprint import make_model_fingerprint
from tiers.record import (
    FINGERPRINT_BYTES,
    KEY_BYTES,
    TENANT_BYTES,
    BlockKey,
    RecordKey,
    make_record_key,
)

__all__ = [
    "BlockHasher",
    "BlockKey",
    "check_block_size",
    "derive_tenant_salt",
    "hash_block",
    "make_block_hasher",
    "make_model_fingerprint",
    "make_record_keys",
    "tenant_id",
]

MIN_SALT_BYTES = 16
MAX_SALT_BYTES = 64  # BLAKE2b key limit
INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1

# BLAKE2b personalisation strings (<= 16 bytes): one domain per kind of hash, so a block key
# can never equal a salt, a tenant id or a fingerprint computed from the same bytes.
_PERSON_BLOCK = b"ss.block-key.v1"
_PERSON_SALT = b"ss.tenant-salt1"
_PERSON_TENANT = b"ss.tenant-id.v1"
_ROOT_MARK = b"\x00" + bytes(KEY_BYTES)  # "no parent", distinct from any "parent" marker


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32; a clear error names the first one out of range."""
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error:
        for pos, tok in enumerate(token_ids):
            if isinstance(tok, bool) or not hasattr(tok, "__index__") or not INT32_MIN <= int(tok) <= INT32_MAX:
                raise ValueError(f"token id {tok!r} at position {pos} is not an int32 "
                                 f"({INT32_MIN}..{INT32_MAX})") from None
        raise


def _check_salt(value: bytes, what: str = "tenant salt") -> None:
    if not isinstance(value, (bytes, bytearray)) or not MIN_SALT_BYTES <= len(value) <= MAX_SALT_BYTES:
        got = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise ValueError(f"{what} must be {MIN_SALT_BYTES}..{MAX_SALT_BYTES} bytes, got {got}")


def hash_block(
    parent: BlockKey | None,
    token_ids: Sequence[int],
    model_fingerprint: bytes,
    tenant_salt: bytes,
) -> BlockKey:
    """The key of one block given its parent's key (None for the first block).

    Pure and deterministic across processes. The token count is hashed too, so blocks of
    different sizes never collide by concatenation.
    """
    if parent is not None and len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    if len(model_fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"model fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(model_fingerprint)}")
    if not token_ids:
        raise ValueError("a block has at least one token")
    _check_salt(tenant_salt)
    h = hashlib.blake2b(digest_size=KEY_BYTES, key=bytes(tenant_salt), person=_PERSON_BLOCK)
    h.update(_ROOT_MARK if parent is None else b"\x01" + bytes(parent))
    h.update(bytes(model_fingerprint))
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(_pack_tokens(token_ids))
    return BlockKey(h.digest())


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Hashes the full blocks of a growing token sequence (vLLM's request block hasher).

    Call it with the sequence's token ids and the keys already computed for it; it returns
    only the keys of the blocks completed since, chaining from the last known key. Partial
    blocks are never keyed: the trailing `len(token_ids) % block_size` tokens wait until
    their block fills.
    """

    block_size: int
    model_fingerprint: bytes
    tenant_salt: bytes

    def __post_init__(self) -> None:
        check_block_size(self.block_size, ())
        if len(self.model_fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"model fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(self.model_fingerprint)}")
        _check_salt(self.tenant_salt)

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size

    def __call__(self, token_ids: Sequence[int], known: Sequence[BlockKey] = ()) -> list[BlockKey]:
        if len(known) > self.num_full_blocks(len(token_ids)):
            raise ValueError(f"{len(known)} keys already known but {len(token_ids)} tokens hold only "
                             f"{self.num_full_blocks(len(token_ids))} full blocks of {self.block_size}")
        parent: BlockKey | None = known[-1] if known else None
        new: list[BlockKey] = []
        b = self.block_size
        for start in range(len(known) * b, self.num_full_blocks(len(token_ids)) * b, b):
            parent = hash_block(parent, token_ids[start:start + b], self.model_fingerprint, self.tenant_salt)
            new.append(parent)
        return new


def make_block_hasher(block_size: int, model_fingerprint: bytes, tenant_salt: bytes) -> BlockHasher:
    """A hasher for one (model, tenant) namespace; resumes from the keys already computed."""
    return BlockHasher(block_size, bytes(model_fingerprint), bytes(tenant_salt))


def make_record_keys(kind_code: int, block_keys: Iterable[bytes]) -> list[RecordKey]:
    """The record keys of one kind of state along a chain of block keys (what tiers index)."""
    return [make_record_key(kind_code, k) for k in block_keys]


def check_block_size(block_size: int, compression_ratios: Iterable[int]) -> None:
    """B must be a positive multiple of every compression ratio > 0.

    A ratio-r source stores one entry per r tokens; a block boundary inside a group of r
    tokens would split an entry between two records. Ratio 0 means "SWA only" (no global
    entries) and constrains nothing.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block size must be a positive int, got {block_size!r}")
    ratios = list(compression_ratios)
    for r in ratios:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"compression ratio {r!r} must be an int >= 0 (ratios {ratios})")
        if r > 0 and block_size % r:
            raise ValueError(f"block size {block_size} is not a multiple of compression ratio {r} "
                             f"(ratios {sorted(set(ratios))}); pick a multiple of every ratio")


def tenant_id(tenant: str) -> bytes:
    """16 public bytes naming a tenant in record headers (not secret: keys are, via the salt)."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty str, got {tenant!r}")
    return hashlib.blake2b(tenant.encode("utf-8"), digest_size=TENANT_BYTES, person=_PERSON_TENANT).digest()


def derive_tenant_salt(secret: bytes, tenant: str) -> bytes:
    """The tenant's 32-byte key-hash salt, derived from the service secret (16..64 bytes).

    Whoever lacks `secret` cannot derive any tenant's salt; a tenant given its own salt learns
    nothing about another's.
    """
    _check_salt(secret, "secret")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty str, got {tenant!r}")
    return hashlib.blake2b(tenant.encode("utf-8"), digest_size=KEY_BYTES, key=bytes(secret),
                           person=_PERSON_SALT).digest()
