"""`statestore calibrate --quick` writes a profile that the cost-aware policy loads and uses."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from statestore import calibrate
from statestore.cost_policy import CostAwarePolicy
from statestore.profile import CostProfile
from statestore.store import StoreConfig, TieredStore
from statestore.types import Durability, TierName
from tiers.host import HostTier
from tiers.record import make_record

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_calibrate_quick_writes_a_profile_the_policy_loads(tmp_path: Path) -> None:
    out = tmp_path / "cache" / "statestore" / "profile.json"
    data_dir = tmp_path / "data"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "statestore.calibrate", "--quick", "--out", str(out),
                           "--data-dir", str(data_dir)], cwd=REPO, capture_output=True, text=True, timeout=90,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout and "tier ssd: latency" in proc.stdout
    assert elapsed < 90
    assert list(data_dir.iterdir()) == []  # the SSD measurement's temp folder is gone

    profile = CostProfile.load(out)
    e = profile.engine
    assert (e.model, e.device, e.measured, e.block_tokens, e.lead_in_tokens, e.replay_tokens) == ("tiny", "cpu", True, 256, 127, 128)
    assert [c for c, _ in e.prefill] == [512, 1024]
    assert all(s > 0 for curve in (e.prefill, e.decode, e.replay, e.encoder) for _, s in curve)
    assert set(profile.tiers) == {TierName.HOST, TierName.SSD}
    assert [s[0] for s in profile.tiers[TierName.SSD].samples] == list(calibrate.SIZES_QUICK)
    assert profile.tier_profiles()[TierName.SSD].latency_s == profile.tiers[TierName.SSD].latency_s

    # The policy prices with it: a block's rebuild is the measured encoder pass + lead-in.
    policy = CostAwarePolicy(profile)
    record = make_record(1, 0, b"x" * 4096, model_fingerprint=b"f" * 16, tenant_id=b"t" * 16, block_key=b"k" * 32,
                         token_start=256, token_end=512)
    store = TieredStore(host=HostTier(1 << 20), policy=policy, config=StoreConfig(tier_profiles=profile.tier_profiles()))

    async def put_and_explain() -> dict:  # type: ignore[type-arg]
        async with store:
            await store.put(record, Durability.MEMORY)
            explained = store.explain(record.key)
            assert explained is not None
            return explained  # type: ignore[return-value]

    import asyncio

    explained = asyncio.run(put_and_explain())
    assert explained["policy"]["rebuild_s"] == pytest.approx(e.block_rebuild_s(256, 512))
    assert explained["policy"]["tiers"]["host"]["load_s"] == pytest.approx(
        profile.tiers[TierName.HOST].latency_s + record.nbytes / profile.tiers[TierName.HOST].bandwidth_bytes_per_s)


def test_calibrate_no_engine_without_a_profile_fails_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    args = parser.parse_args(["--quick", "--no-engine", "--out", str(tmp_path / "none.json"), "--data-dir", str(tmp_path)])
    assert calibrate.run(args) == 1
    assert "calibrate: no cost profile at" in capsys.readouterr().err
    assert not (tmp_path / "none.json").exists()
