"""CostProfile: save/load round trip, validation messages, curves, the V4.1 estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from statestore.profile import (
    CostProfile,
    EngineProfile,
    ProfileError,
    default_profile_path,
    fit_tier,
    interpolate,
)
from statestore.types import DEFAULT_TIER_PROFILES, TierName, TierProfile


def make_profile() -> CostProfile:
    engine = EngineProfile(model="tiny", device="cpu", measured=True, block_tokens=256, lead_in_tokens=127,
                           replay_tokens=128, prefill=((256, 1e-3), (1024, 2e-3)), decode=((256, 5e-3),),
                           replay=((256, 2e-3), (1024, 3e-3)), encoder=((256, 8e-4), (1024, 1.6e-3)))
    host = fit_tier([(4096, 2e-6, 1e-6), (4 << 20, 1e-3, 5e-4)], "ram")
    return CostProfile(engine, {TierName.HOST: host}, {"cpus": 2}, "2026-01-01T00:00:00+00:00")


def test_save_load_round_trip(tmp_path: Path) -> None:
    p = make_profile()
    path = p.save(tmp_path / "sub" / "profile.json")
    assert path.exists() and not list(path.parent.glob(".profile-*"))  # atomic: no temp left
    q = CostProfile.load(path)
    assert q == p
    assert q.tier_profiles()[TierName.HOST] == p.tiers[TierName.HOST].to_tier_profile()
    assert q.tier_profiles()[TierName.SSD] == DEFAULT_TIER_PROFILES[TierName.SSD]  # not measured: default


def test_curves_interpolate_and_hold_flat_past_the_ends() -> None:
    curve = ((100, 1.0), (300, 3.0))
    assert [interpolate(curve, x) for x in (0, 100, 200, 300, 10_000)] == [1.0, 1.0, 2.0, 3.0, 3.0]
    e = make_profile().engine
    assert e.block_rebuild_s(0, 256) == pytest.approx(256 * 8e-4)
    assert e.block_rebuild_s(256, 512) == pytest.approx((256 + 127) * interpolate(e.encoder, 512))
    assert e.ring_rebuild_s(1024) == pytest.approx(128 * 3e-3)


def test_fit_tier_latency_from_small_bandwidth_from_large() -> None:
    m = fit_tier([(4 << 20, 1e-3, 4.2e-4), (4096, 1e-5, 2e-5)])
    assert m.latency_s == pytest.approx(2e-5)
    assert m.bandwidth_bytes_per_s == pytest.approx((4 << 20) / 4e-4)
    assert m.to_tier_profile() == TierProfile(m.latency_s, m.bandwidth_bytes_per_s)


def test_default_path_follows_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_profile_path() == tmp_path / "statestore" / "profile.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_profile_path() == Path.home() / ".cache" / "statestore" / "profile.json"


def _broken(mutate) -> dict:  # type: ignore[no-untyped-def]
    doc = make_profile().to_dict()
    mutate(doc)
    return doc


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(version=99), "version is 99; this statestore reads version 1"),
    (lambda d: d.pop("engine"), "engine is missing or not an object"),
    (lambda d: d["engine"].update(block_tokens=0), "engine.block_tokens must be a positive integer, got 0"),
    (lambda d: d["engine"].update(prefill=[]), "engine.prefill must be a non-empty list"),
    (lambda d: d["engine"].update(replay=[[1024, 1e-3], [256, 1e-3]]), "engine.replay context lengths must be strictly ascending"),
    (lambda d: d["engine"].update(encoder=[[256, -1.0]]), r"engine.encoder\[0\] s_per_token must be a positive number"),
    (lambda d: d["engine"].update(decode=[[256]]), r"engine.decode\[0\] must be \[context_tokens, s_per_token\]"),
    (lambda d: d["tiers"].update(floppy={}), "tiers.floppy is not a tier"),
    (lambda d: d["tiers"]["host"].update(bandwidth_bytes_per_s="fast"), "tiers.host.bandwidth_bytes_per_s must be a positive number"),
    (lambda d: d["tiers"]["host"].update(samples=[[4096, 1e-6]]), r"tiers.host.samples\[0\] must be \[size_bytes, put_s, get_s\]"),
])
def test_validation_names_the_field_and_the_problem(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_broken(mutate)))
    with pytest.raises(ProfileError, match=message) as err:
        CostProfile.load(path)
    assert str(err.value).startswith(f"{path}: ")


def test_missing_and_unreadable_files_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"no cost profile at .*nope.json: run `statestore calibrate`"):
        CostProfile.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="is not JSON"):
        CostProfile.load(bad)
    with pytest.raises(ProfileError, match="must be a JSON object"):
        CostProfile.from_dict([1, 2])


def test_v41_estimate_is_gpu_scale_and_grows_with_context() -> None:
    p = CostProfile.v41_h200(mfu=0.4)
    e = p.engine
    assert (e.block_tokens, e.lead_in_tokens, e.replay_tokens, e.measured) == (512, 127, 128, False)
    # 8B active in prefill: 16 GFLOP/token at 0.4 x 989 TFLOP/s ~ 40 us/token before attention.
    assert 4.0e-5 < e.prefill_s(512) < 5.0e-5
    assert e.prefill_s(131072) > e.prefill_s(512)
    assert e.replay_s(4096) > 1.9 * e.encoder_s(4096)  # the whole stack (16B active) per replayed row
    assert CostProfile.from_dict(p.to_dict()) == p
