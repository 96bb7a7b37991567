"""Tier names -> implementations, imported lazily; every tier is built from one `TierConfig`.

The registry maps a name to (module path, class name) and imports the module only when a
tier of that name is built, so a deployment without Redis never imports redis-py, and a
tier module that another team has not written yet does not break the others. Unknown names
fail with the list of registered ones; there is no if/elif chain on names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiers.base import Tier


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Everything needed to build one tier. Fields a tier does not use are ignored by it.

    `options` carries tier-specific keyword arguments (e.g. `direct_io_min_bytes` for ssd,
    `cluster` or `socket_timeout_s` for redis) so that this dataclass does not grow a field
    per knob of every medium.
    """

    name: str
    budget_bytes: int = 0
    path: Path | None = None  # ssd: the tier's directory
    url: str | None = None  # redis: redis://host:port/db or redis+cluster://host:port
    ttl_s: int | None = None  # redis: expiry of every record written
    prefix: str = "ss"  # redis: key namespace
    zstd_kinds: dict[int, int] = field(default_factory=dict)  # kind code -> zstd level
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"tier {self.name!r}: budget_bytes must be >= 0, got {self.budget_bytes}")


@dataclass(frozen=True, slots=True)
class _Entry:
    module_path: str
    class_name: str


_REGISTRY: dict[str, _Entry] = {}


def register_tier(name: str, module_path: str, class_name: str) -> None:
    """Make `name` buildable. Re-registering a name to another class is a bug, so it raises."""
    entry = _Entry(module_path, class_name)
    if _REGISTRY.get(name, entry) != entry:
        raise ValueError(f"tier {name!r} is already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = entry


def registered_tiers() -> list[str]:
    return sorted(_REGISTRY)


def tier_class(name: str) -> type[Tier]:
    """Import and return the class registered under `name` (ImportError if its module is missing)."""
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; registered tiers: {', '.join(registered_tiers())}") from None
    cls = getattr(importlib.import_module(entry.module_path), entry.class_name)
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise TypeError(f"{entry.module_path}:{entry.class_name} (tier {name!r}) is not a subclass of tiers.base.Tier")
    return cls


def build_tier(config: TierConfig) -> Tier:
    """Construct (no I/O) the tier `config.name` names.

    A class with a `from_config(config)` classmethod builds itself; any other gets
    `budget_bytes` and `options` as keyword arguments.
    """
    cls = tier_class(config.name)
    from_config = getattr(cls, "from_config", None)
    if from_config is not None:
        return from_config(config)
    return cls(budget_bytes=config.budget_bytes, **config.options)


async def open_tier(config: TierConfig) -> Tier:
    """Build the tier, then run its async `open()` if it has one (the ssd tier scans there)."""
    tier = build_tier(config)
    opener = getattr(tier, "open", None)
    if opener is not None:
        await opener()
    return tier


register_tier("host", "tiers.host", "HostTier")
register_tier("ssd", "tiers.ssd", "SSDTier")
register_tier("redis", "tiers.redis", "RedisTier")
