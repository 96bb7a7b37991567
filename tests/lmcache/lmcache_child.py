"""A second LMCache process (tests/lmcache/test_lmcache_backend.py): builds its own LMCache
StorageManager with the statestore plugin, hashes the same token ids (PYTHONHASHSEED fixed by
the parent), and prints one JSON line: the prefix hit count and each chunk's sha256."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import LMCacheHarness, make_lmcache_config, make_lmcache_metadata  # noqa: E402


def main() -> None:
    target, num_tokens, namespace = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    lm = LMCacheHarness(make_lmcache_config(target, namespace=namespace), make_lmcache_metadata())
    try:
        keys = lm.keys(list(range(num_tokens)))
        hits = lm.manager.storage_backends[lm.remote_name].batched_contains(keys)
        digests = []
        for key in keys:
            obj = lm.manager.get(key, location=lm.remote_name)
            digests.append(None if obj is None else hashlib.sha256(obj.byte_array).hexdigest())
            if obj is not None:
                obj.ref_count_down()
        print(json.dumps({"hits": hits, "keys": [k.to_string() for k in keys], "sha256": digests}), flush=True)
    finally:
        lm.close()


if __name__ == "__main__":
    main()
