"""Model fingerprints: 16 bytes that say what a piece of state means.

Lives with the engine adapters because each adapter computes its own; the store only
compares fingerprints. Any change to weights identity, config, codecs or layout version
changes the fingerprint, so state of another model or layout is never served.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

FINGERPRINT_BYTES = 16
FINGERPRINT_SCHEME = 1  # bump when the canonical form below changes
_PERSON_MODEL = b"ss.model-fp.v1"


def _canonical(value: Any) -> Any:
    """JSON-ready form with a single spelling per value (mapping keys sorted as strings)."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"hex": bytes(value).hex()}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)  # IntEnum and numpy ints spell as plain ints
    if isinstance(value, float):
        return float(value)
    raise TypeError(f"model config value {value!r} ({type(value).__name__}) has no canonical JSON form")


def make_model_fingerprint(
    config: Mapping[str, Any],
    codec_ids: Mapping[int, int] | Sequence[int],
    layout_version: int,
    weights_id: str | bytes,
) -> bytes:
    """16 bytes identifying what state means: weights, config, codecs and layout version.

    Computed over canonical JSON (sorted keys, no whitespace, NaN refused), so two processes
    or two machines agree; any change to any input changes the fingerprint.

    Args:
        config: the model's architecture config (plain JSON-able values).
        codec_ids: kind code -> codec code, or the codec codes in kind order.
        layout_version: the engine's page/record layout version.
        weights_id: identity of the weights (a checksum or a release name).
    """
    codecs = ([[int(k), int(v)] for k, v in sorted(codec_ids.items())] if isinstance(codec_ids, Mapping)
              else [int(c) for c in codec_ids])
    doc = {
        "scheme": FINGERPRINT_SCHEME,
        "config": _canonical(config),
        "codecs": codecs,
        "layout_version": int(layout_version),
        "weights_id": _canonical(weights_id),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.blake2b(text.encode("ascii"), digest_size=FINGERPRINT_BYTES, person=_PERSON_MODEL).digest()
