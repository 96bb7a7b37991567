"""Child process for the session crash test: appends messages and checkpoints after each one.

    python session_checkpoint_child.py <ssd_dir> <session_id> <max_messages>

It resumes the session (`exact`) if the directory holds a checkpoint of it, else creates it.
Then, for each next message k (`message_tokens(k)`, deterministic, so the parent can rebuild the
uninterrupted run), it prints and flushes

    begin <k> <T>            the message is appended; the checkpoint starts
    ack <k> <T> <version>    the checkpoint returned: acknowledged at LOCAL durability

so every "ack" line is a checkpoint the service acknowledged, and a SIGKILL between a "begin"
and its "ack" lands in the middle of a checkpoint. "ready <T> <version>" comes first.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

SECRET = b"crash-test-secret-0123456789abcd"
TENANT = "crash"
BLOCK = 16
SEED = 1


def message_tokens(k: int) -> list[int]:
    """Message k: 5..11 tokens (odd and even lengths, so T crosses ratio-2 pairs and blocks)."""
    import torch

    n = 5 + (3 * k) % 7
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(7000 + k)).tolist()


async def run(ssd_dir: Path, session_id: str, max_messages: int) -> None:
    import torch

    from engine_adapter.ced import CEDEngine, mini
    from engine_adapter.ced.adapter import CEDAdapter
    from statestore.sessions import SessionConfig, SessionManager, SessionNotFound
    from statestore.store import TieredStore
    from tiers.host import HostTier
    from tiers.ssd import SSDTier

    torch.set_num_threads(1)
    store = TieredStore(host=HostTier(64 << 20), ssd=await SSDTier.create(ssd_dir))
    await store.open()
    sessions = SessionManager(store, CEDAdapter(CEDEngine(mini(), seed=SEED, dtype=torch.float64)),
                              SessionConfig(secret=SECRET, block_size=BLOCK))
    try:
        try:
            await sessions.resume(TENANT, session_id, "exact")
        except SessionNotFound:
            await sessions.create(TENANT, session_id)
        info = await sessions.get(TENANT, session_id)
        print(f"ready {info.num_tokens} {info.checkpoint_version or 0}", flush=True)
        for k in range(len(info.message_boundaries), max_messages):
            info = await sessions.append(TENANT, session_id, message_tokens(k))
            print(f"begin {k} {info.num_tokens}", flush=True)
            report = await sessions.checkpoint(TENANT, session_id)
            print(f"ack {k} {report.num_tokens} {report.version}", flush=True)
    finally:
        await sessions.aclose()
        await store.aclose()


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
    asyncio.run(run(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])))


if __name__ == "__main__":
    main()
