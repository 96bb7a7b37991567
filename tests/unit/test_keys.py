"""Block keys: determinism across processes, full blocks only, namespaces, block-size rules."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestore.keys import (
    BlockKey,
    check_block_size,
    derive_tenant_salt,
    hash_block,
    make_block_hasher,
    make_model_fingerprint,
    make_record_keys,
    tenant_id,
)

FP = bytes(range(16))
SALT = b"s" * 32
SECRET = b"service-secret-0123456789abcdef"
BLOCK = 16
REPO_ROOT = Path(__file__).resolve().parents[2]

tokens_st = st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=1, max_size=64)


def make_chain(tokens: list[int], salt: bytes = SALT, fp: bytes = FP, block_size: int = BLOCK) -> list[BlockKey]:
    return make_block_hasher(block_size, fp, salt)(tokens)


# ----- determinism ---------------------------------------------------------------------------

_SUBPROCESS_SNIPPET = """
from statestore.keys import make_block_hasher
h = make_block_hasher(16, bytes(range(16)), b"s" * 32)
print(",".join(k.hex() for k in h(list(range(100)))))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_keys_are_stable_across_processes(hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", _SUBPROCESS_SNIPPET], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out.split(",") == [k.hex() for k in make_chain(list(range(100)))]


def test_known_vector_pins_the_format() -> None:
    # Changing this vector orphans every stored record: bump the person string instead.
    key = hash_block(None, [1, 2, 3], FP, SALT)
    assert len(key) == 32
    assert key == hash_block(None, (1, 2, 3), FP, SALT)  # any sequence type
    assert key != hash_block(None, [1, 2, 3, 0], FP, SALT)  # the count is hashed


# ----- full blocks only ----------------------------------------------------------------------

def test_hasher_keys_full_blocks_only() -> None:
    hasher = make_block_hasher(BLOCK, FP, SALT)
    assert hasher(list(range(BLOCK - 1))) == []  # a partial block is never keyed
    keys = hasher(list(range(3 * BLOCK + 5)))
    assert len(keys) == 3
    assert keys[0] == hash_block(None, list(range(BLOCK)), FP, SALT)
    assert keys[1] == hash_block(keys[0], list(range(BLOCK, 2 * BLOCK)), FP, SALT)


def test_hasher_resumes_from_known_keys() -> None:
    hasher = make_block_hasher(BLOCK, FP, SALT)
    tokens = list(range(5 * BLOCK))
    first = hasher(tokens[: 2 * BLOCK + 3])
    rest = hasher(tokens, first)
    assert first + rest == hasher(tokens)
    assert len(rest) == 3
    assert hasher(tokens, first + rest) == []


def test_hasher_rejects_more_known_keys_than_blocks() -> None:
    hasher = make_block_hasher(BLOCK, FP, SALT)
    with pytest.raises(ValueError, match="2 keys already known but 20 tokens hold only 1 full blocks of 16"):
        hasher(list(range(20)), [BlockKey(b"k" * 32)] * 2)


# ----- every input matters -------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, pos=st.integers(min_value=0), delta=st.integers(1, 1000))
def test_changing_a_token_changes_the_key(tokens: list[int], pos: int, delta: int) -> None:
    pos %= len(tokens)
    other = list(tokens)
    other[pos] = (other[pos] + delta + (1 << 31)) % (1 << 32) - (1 << 31)
    assert hash_block(None, tokens, FP, SALT) != hash_block(None, other, FP, SALT)


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, parent=st.binary(min_size=32, max_size=32), other=st.binary(min_size=32, max_size=32))
def test_parent_fingerprint_and_salt_change_the_key(tokens: list[int], parent: bytes, other: bytes) -> None:
    base = hash_block(BlockKey(parent), tokens, FP, SALT)
    if other != parent:
        assert hash_block(BlockKey(other), tokens, FP, SALT) != base
    assert hash_block(None, tokens, FP, SALT) != base
    assert hash_block(BlockKey(parent), tokens, bytes(16), SALT) != base
    assert hash_block(BlockKey(parent), tokens, FP, b"t" * 32) != base


def test_root_differs_from_an_all_zero_parent() -> None:
    assert hash_block(None, [7], FP, SALT) != hash_block(BlockKey(bytes(32)), [7], FP, SALT)


def test_tokens_are_validated_as_int32() -> None:
    with pytest.raises(ValueError, match=r"token id 2147483648 at position 1 is not an int32"):
        hash_block(None, [1, 1 << 31], FP, SALT)
    with pytest.raises(ValueError, match="token id 'a' at position 0"):
        hash_block(None, ["a"], FP, SALT)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one token"):
        hash_block(None, [], FP, SALT)


def test_bad_fingerprint_and_salt_are_rejected() -> None:
    with pytest.raises(ValueError, match="model fingerprint must be 16 bytes, got 3"):
        hash_block(None, [1], b"abc", SALT)
    with pytest.raises(ValueError, match="tenant salt must be 16..64 bytes, got 4"):
        hash_block(None, [1], FP, b"salt")


# ----- namespaces ----------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(tokens=st.lists(st.integers(0, 200_000), min_size=BLOCK, max_size=4 * BLOCK))
def test_two_tenants_identical_prompts_never_share_keys(tokens: list[int]) -> None:
    alice = make_chain(tokens, derive_tenant_salt(SECRET, "alice"))
    bob = make_chain(tokens, derive_tenant_salt(SECRET, "bob"))
    assert alice and not set(alice) & set(bob)


def test_same_tenant_shares_prefix_blocks() -> None:
    salt = derive_tenant_salt(SECRET, "alice")
    system = list(range(2 * BLOCK))
    a = make_chain(system + [1] * BLOCK, salt)
    b = make_chain(system + [2] * BLOCK, salt)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_tenant_salt_and_id() -> None:
    assert derive_tenant_salt(SECRET, "alice") == derive_tenant_salt(SECRET, "alice")
    assert derive_tenant_salt(SECRET, "alice") != derive_tenant_salt(b"another-secret-0123", "alice")
    assert len(derive_tenant_salt(SECRET, "alice")) == 32
    assert len(tenant_id("alice")) == 16
    assert tenant_id("alice") != tenant_id("bob")
    # the public tenant id reveals nothing usable as the salt
    assert tenant_id("alice") not in derive_tenant_salt(SECRET, "alice")
    with pytest.raises(ValueError, match="secret must be 16..64 bytes, got 5"):
        derive_tenant_salt(b"short", "alice")
    with pytest.raises(ValueError, match="tenant must be a non-empty str"):
        tenant_id("")


def test_record_keys_prefix_the_kind() -> None:
    keys = make_chain(list(range(2 * BLOCK)))
    rkeys = make_record_keys(1, keys)
    assert [r[:2] for r in rkeys] == [b"\x00\x01"] * 2 and [r[2:] for r in rkeys] == keys
    assert set(make_record_keys(2, keys)).isdisjoint(rkeys)


# ----- fingerprints --------------------------------------------------------------------------

CONFIG = {"n_layers": 4, "compress_ratios": [0, 2, 1, 1], "window": 128, "d_model": 512}


def test_fingerprint_is_canonical_and_covers_every_input() -> None:
    fp = make_model_fingerprint(CONFIG, {1: 1, 2: 2}, 1, "weights-abc")
    assert len(fp) == 16
    reordered = dict(reversed(list(CONFIG.items())))
    assert make_model_fingerprint(reordered, {2: 2, 1: 1}, 1, "weights-abc") == fp
    assert make_model_fingerprint({**CONFIG, "window": 64}, {1: 1, 2: 2}, 1, "weights-abc") != fp
    assert make_model_fingerprint(CONFIG, {1: 1, 2: 3}, 1, "weights-abc") != fp
    assert make_model_fingerprint(CONFIG, {1: 1, 2: 2}, 2, "weights-abc") != fp
    assert make_model_fingerprint(CONFIG, {1: 1, 2: 2}, 1, "weights-abd") != fp


def test_fingerprint_refuses_values_without_a_canonical_form() -> None:
    with pytest.raises(TypeError, match="has no canonical JSON form"):
        make_model_fingerprint({"x": object()}, [], 1, "w")
    with pytest.raises(ValueError):
        make_model_fingerprint({"x": float("nan")}, [], 1, "w")


# ----- block size ----------------------------------------------------------------------------

ratios_st = st.lists(st.integers(0, 8), max_size=6)


@given(ratios=ratios_st, mult=st.integers(1, 64))
def test_block_size_multiple_of_every_ratio_is_accepted(ratios: list[int], mult: int) -> None:
    lcm = math.lcm(*(r for r in ratios if r)) if any(ratios) else 1
    check_block_size(lcm * mult, ratios)


@given(ratios=ratios_st.filter(lambda rs: any(rs)), block_size=st.integers(1, 4096))
def test_block_size_not_multiple_is_rejected_naming_both(ratios: list[int], block_size: int) -> None:
    bad = [r for r in ratios if r and block_size % r]
    if not bad:
        check_block_size(block_size, ratios)
        return
    with pytest.raises(ValueError, match=f"block size {block_size} is not a multiple of compression ratio {bad[0]}"):
        check_block_size(block_size, ratios)


@pytest.mark.parametrize("block_size", [0, -256, 2.5, True])
def test_block_size_must_be_positive_int(block_size: object) -> None:
    with pytest.raises(ValueError, match="block size must be a positive int"):
        check_block_size(block_size, [2])  # type: ignore[arg-type]


def test_v41_ratios() -> None:
    ratios = [0, 0] + [2] * 18 + [1] * 20
    check_block_size(256, ratios)
    with pytest.raises(ValueError, match=r"block size 255 is not a multiple of compression ratio 2 \(ratios \[0, 1, 2\]\)"):
        check_block_size(255, ratios)
