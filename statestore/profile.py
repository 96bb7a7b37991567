"""The cost profile: measured constants the cost-aware policy prices decisions with.

`statestore calibrate` measures them on a machine (engine seconds per token by context
length, per-tier latency and bandwidth over record size classes) and saves a JSON file; the
policy and the trace simulator load it. Nothing in the policy is guessed where a profile can
say it (DESIGN.md §5). `CostProfile.v41_h200` derives GPU-scale engine costs from a FLOP
count instead, for planning on machines without the GPU (the trace benchmark).

File layout (version 1)::

    {"version": 1, "created": ISO time, "machine": {...},
     "engine": {"model", "device", "measured", "block_tokens", "lead_in_tokens", "replay_tokens",
                "prefill": [[context_tokens, s_per_token], ...], "decode": [...],
                "replay": [...], "encoder": [...]},
     "tiers": {"host": {"latency_s", "bandwidth_bytes_per_s", "where",
                        "samples": [[size_bytes, put_s, get_s], ...]}, "ssd": ..., "redis": ...}}

Curves are per token at a context length, interpolated linearly between points and held
flat past the ends: prefill/decode/replay cost grows with context (attention), so one
number per engine would misprice long sessions.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statestore.types import DEFAULT_TIER_PROFILES, TierName, TierProfile

PROFILE_VERSION = 1
PROFILE_FILE = "profile.json"

Curve = tuple[tuple[int, float], ...]
"""(context tokens, seconds per token) points, context ascending."""


class ProfileError(ValueError):
    """A profile file is missing, unreadable or invalid; the message names the file and field."""


def default_profile_path() -> Path:
    """`$XDG_CACHE_HOME/statestore/profile.json`, else `~/.cache/statestore/profile.json`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "statestore" / PROFILE_FILE


def interpolate(curve: Curve, context_tokens: float) -> float:
    """Seconds per token at `context_tokens`: linear between points, flat past the ends."""
    xs = [x for x, _ in curve]
    i = bisect.bisect_left(xs, context_tokens)
    if i == 0:
        return curve[0][1]
    if i == len(curve):
        return curve[-1][1]
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (context_tokens - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What running the engine costs, per token, by context length.

    `encoder` is the encoder-only recompute of global state (one block given its
    predecessors: rows B + lead-in through the layers that publish); `replay` is one token
    through the whole stack during a bounded replay (what rebuilding SWA rings costs).
    """

    model: str
    device: str
    measured: bool
    block_tokens: int  # B: tokens per global block record
    lead_in_tokens: int  # W - 1: rows before a block its encoder recompute must read
    replay_tokens: int  # R of a bounded replay: rows replayed to rebuild rings
    prefill: Curve
    decode: Curve
    replay: Curve
    encoder: Curve

    def prefill_s(self, context_tokens: float) -> float:
        return interpolate(self.prefill, context_tokens)

    def decode_s(self, context_tokens: float) -> float:
        return interpolate(self.decode, context_tokens)

    def replay_s(self, context_tokens: float) -> float:
        return interpolate(self.replay, context_tokens)

    def encoder_s(self, context_tokens: float) -> float:
        return interpolate(self.encoder, context_tokens)

    def block_rebuild_s(self, token_start: int, token_end: int) -> float:
        """Encoder pass over [token_start, token_end) plus its lead-in (none at position 0)."""
        lead = min(self.lead_in_tokens, token_start)
        return (token_end - token_start + lead) * self.encoder_s(token_end)

    def ring_rebuild_s(self, context_tokens: int) -> float:
        """A bounded replay of R rows at `context_tokens`: what dropping the rings costs."""
        return min(self.replay_tokens, max(1, context_tokens)) * self.replay_s(context_tokens)


@dataclass(frozen=True, slots=True)
class TierMeasurement:
    """One tier as measured: a fitted latency + bandwidth, and the raw samples behind it."""

    latency_s: float
    bandwidth_bytes_per_s: float
    where: str = ""  # what was measured (directory, URL), for humans
    samples: tuple[tuple[int, float, float], ...] = ()  # (size_bytes, put_s, get_s)

    def to_tier_profile(self) -> TierProfile:
        return TierProfile(self.latency_s, self.bandwidth_bytes_per_s)


def fit_tier(samples: Sequence[tuple[int, float, float]], where: str = "") -> TierMeasurement:
    """Latency = the smallest size's get time; bandwidth from the largest size's get time.

    Reads are what a hit pays, so the fit uses gets; puts stay in the samples.
    """
    if not samples:
        raise ValueError("fit_tier: no samples")
    ordered = sorted(samples)
    small, large = ordered[0], ordered[-1]
    latency = max(small[2], 1e-9)
    transfer = max(large[2] - latency, large[2] * 0.05, 1e-9)
    bandwidth = large[0] / transfer if large[0] > small[0] else large[0] / max(large[2], 1e-9)
    return TierMeasurement(latency, bandwidth, where, tuple(ordered))


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Engine curves and tier measurements of one machine (see the module docstring)."""

    engine: EngineProfile
    tiers: Mapping[TierName, TierMeasurement] = field(default_factory=dict)
    machine: Mapping[str, Any] = field(default_factory=dict)
    created: str = ""
    version: int = PROFILE_VERSION

    def tier_profiles(self) -> dict[TierName, TierProfile]:
        """Measured tiers, the defaults for tiers not measured (what `StoreConfig` takes)."""
        out = dict(DEFAULT_TIER_PROFILES)
        out.update({t: m.to_tier_profile() for t, m in self.tiers.items()})
        return out

    # ----- GPU-scale estimate ------------------------------------------------------------

    @classmethod
    def v41_h200(cls, *, mfu: float = 0.4, peak_flops: float = 989e12,
                 tiers: Mapping[TierName, TierMeasurement] | None = None) -> CostProfile:
        """DeepSeek-V4.1 engine costs on one H200 from the FLOP count at `mfu` (not measured).

        Prefill runs the encoder on every row: 8B active parameters (ENGINE.md §1) = 16 GFLOP
        per token, plus attention over the window and the top-512 selected entries (64 heads
        x 512 latent, QK and AV) in the 21 encoder layers and the indexer's scoring of every
        compressed entry at the 4 full index sources. A replayed or decoded row runs the
        whole stack: 16B active = 32 GFLOP plus attention in all 40 layers. BF16 dense peak
        989 TFLOP/s; MFU 0.4 by default.
        """
        rate = peak_flops * mfu

        def attention(ctx: int, layers: int) -> float:
            selected = min(512, ctx // 2)
            window_and_selected = 4 * 64 * 512 * (128 + selected) * layers
            indexer = 2 * 32 * 128 * (3 * ctx / 2 + ctx)  # sources 2, 8, 14 at ratio 2; 20 at ratio 1
            return window_and_selected + indexer

        contexts = (512, 4096, 16384, 65536, 131072)
        encoder = tuple((c, (16e9 + attention(c, 21)) / rate) for c in contexts)
        stack = tuple((c, (32e9 + attention(c, 40)) / rate) for c in contexts)
        engine = EngineProfile(model="v41", device=f"h200-estimate-mfu{mfu:g}", measured=False, block_tokens=512,
                               lead_in_tokens=127, replay_tokens=128, prefill=encoder, decode=stack,
                               replay=stack, encoder=encoder)
        return cls(engine, dict(tiers or {}), {"source": "FLOP count", "peak_flops": peak_flops, "mfu": mfu},
                   _now())

    # ----- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        e = self.engine
        return {
            "version": self.version, "created": self.created, "machine": dict(self.machine),
            "engine": {"model": e.model, "device": e.device, "measured": e.measured,
                       "block_tokens": e.block_tokens, "lead_in_tokens": e.lead_in_tokens,
                       "replay_tokens": e.replay_tokens,
                       **{k: [list(p) for p in getattr(e, k)] for k in _CURVES}},
            "tiers": {t.value: {"latency_s": m.latency_s, "bandwidth_bytes_per_s": m.bandwidth_bytes_per_s,
                                "where": m.where, "samples": [list(s) for s in m.samples]}
                      for t, m in self.tiers.items()},
        }

    @classmethod
    def from_dict(cls, doc: Any, *, source: str = "profile") -> CostProfile:
        """Validate and build; every error says which field of `source` is wrong and why."""
        v = _Validator(source)
        v.require(isinstance(doc, dict), "", "must be a JSON object")
        version = doc.get("version")
        v.require(version == PROFILE_VERSION, "version",
                  f"is {version!r}; this statestore reads version {PROFILE_VERSION} (re-run `statestore calibrate`)")
        engine = v.engine(doc.get("engine"))
        tiers_doc = doc.get("tiers", {})
        v.require(isinstance(tiers_doc, dict), "tiers", "must be an object of tier name -> measurement")
        tiers = {v.tier_name(name): v.tier(name, m) for name, m in tiers_doc.items()}
        machine = doc.get("machine", {})
        v.require(isinstance(machine, dict), "machine", "must be an object")
        return cls(engine, tiers, machine, str(doc.get("created", "")), version)

    def save(self, path: Path | str) -> Path:
        """Write atomically (temp file + rename) and return the path; creates the folder."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path | str | None = None) -> CostProfile:
        """Read and validate a profile (default: `default_profile_path()`)."""
        path = Path(path).expanduser() if path is not None else default_profile_path()
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ProfileError(f"no cost profile at {path}: run `statestore calibrate` (or pass --out/--profile)") from None
        except OSError as exc:
            raise ProfileError(f"cannot read cost profile {path}: {exc.strerror}") from None
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"cost profile {path} is not JSON: {exc.msg} at line {exc.lineno}") from None
        return cls.from_dict(doc, source=str(path))


_CURVES = ("prefill", "decode", "replay", "encoder")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class _Validator:
    """Field checks with messages of the form "<file>: <field> <problem>"."""

    def __init__(self, source: str) -> None:
        self.source = source

    def require(self, ok: bool, where: str, problem: str) -> None:
        if not ok:
            raise ProfileError(f"{self.source}: {where + ' ' if where else ''}{problem}")

    def positive(self, value: Any, where: str, *, integer: bool = False, allow_zero: bool = False) -> Any:
        kinds = (int,) if integer else (int, float)
        ok = isinstance(value, kinds) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
        self.require(ok and value == value and value != float("inf"), where,
                     f"must be a {'non-negative' if allow_zero else 'positive'} "
                     f"{'integer' if integer else 'number'}, got {value!r}")
        return value

    def curve(self, doc: Any, where: str) -> Curve:
        self.require(isinstance(doc, list) and len(doc) > 0, where, "must be a non-empty list of [context_tokens, s_per_token]")
        points = []
        for i, p in enumerate(doc):
            self.require(isinstance(p, list) and len(p) == 2, f"{where}[{i}]", "must be [context_tokens, s_per_token]")
            points.append((self.positive(p[0], f"{where}[{i}] context_tokens", integer=True),
                           float(self.positive(p[1], f"{where}[{i}] s_per_token"))))
        xs = [x for x, _ in points]
        self.require(xs == sorted(set(xs)), where, f"context lengths must be strictly ascending, got {xs}")
        return tuple(points)

    def engine(self, doc: Any) -> EngineProfile:
        self.require(isinstance(doc, dict), "engine", "is missing or not an object")
        for name in ("model", "device"):
            self.require(isinstance(doc.get(name), str), f"engine.{name}", "must be a string")
        return EngineProfile(
            model=doc["model"], device=doc["device"], measured=bool(doc.get("measured", False)),
            block_tokens=self.positive(doc.get("block_tokens"), "engine.block_tokens", integer=True),
            lead_in_tokens=self.positive(doc.get("lead_in_tokens"), "engine.lead_in_tokens", integer=True,
                                         allow_zero=True),
            replay_tokens=self.positive(doc.get("replay_tokens"), "engine.replay_tokens", integer=True),
            **{k: self.curve(doc.get(k), f"engine.{k}") for k in _CURVES})

    def tier_name(self, name: str) -> TierName:
        names = [t.value for t in TierName]
        self.require(name in names, f"tiers.{name}", f"is not a tier (one of {', '.join(names)})")
        return TierName(name)

    def tier(self, name: str, doc: Any) -> TierMeasurement:
        where = f"tiers.{name}"
        self.require(isinstance(doc, dict), where, "must be an object")
        samples = doc.get("samples", [])
        self.require(isinstance(samples, list), f"{where}.samples", "must be a list of [size_bytes, put_s, get_s]")
        checked = []
        for i, s in enumerate(samples):
            self.require(isinstance(s, list) and len(s) == 3, f"{where}.samples[{i}]", "must be [size_bytes, put_s, get_s]")
            checked.append((self.positive(s[0], f"{where}.samples[{i}] size_bytes", integer=True),
                            float(self.positive(s[1], f"{where}.samples[{i}] put_s", allow_zero=True)),
                            float(self.positive(s[2], f"{where}.samples[{i}] get_s", allow_zero=True))))
        return TierMeasurement(float(self.positive(doc.get("latency_s"), f"{where}.latency_s")),
                               float(self.positive(doc.get("bandwidth_bytes_per_s"), f"{where}.bandwidth_bytes_per_s")),
                               str(doc.get("where", "")), tuple(checked))
