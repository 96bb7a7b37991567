"""Where the SSD tier's files live (`tiers.ssd`): a record key's path under the root, two
levels of fan-out from the block-key bytes, the names of the tier's own files and directories,
and the key a record file's name stands for (the scan)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiers.record import RECORD_KEY_BYTES, RecordKey

RECORD_SUFFIX = ".rec"
TEMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"
SPARES_DIR = "spares"
SPARE_SUFFIX = ".spare"
LOCK_FILE = ".lock"


@dataclass(frozen=True, slots=True)
class SSDLayout:
    """Where a record key lives on disk, and the inverse for the scan."""

    root: Path

    @staticmethod
    def fanout(key: bytes) -> tuple[str, str]:
        return f"{key[2]:02x}", f"{key[3]:02x}"

    def path(self, key: bytes) -> Path:
        top, sub = self.fanout(key)
        return self.root / top / sub / (key.hex() + RECORD_SUFFIX)

    def path_str(self, key: bytes) -> str:
        """`path(key)` as a str, built without Path objects (on every get and put)."""
        return f"{self.root}/{key[2]:02x}/{key[3]:02x}/{key.hex()}{RECORD_SUFFIX}"

    @property
    def quarantine_dir(self) -> Path:
        return self.root / QUARANTINE_DIR

    @property
    def spares_dir(self) -> Path:
        return self.root / SPARES_DIR

    @staticmethod
    def key_from_name(name: str) -> RecordKey | None:
        stem = name.removesuffix(RECORD_SUFFIX)
        if stem == name or len(stem) != 2 * RECORD_KEY_BYTES:
            return None
        try:
            return RecordKey(bytes.fromhex(stem))
        except ValueError:
            return None
