"""`statestore serve` in a child process, for the tools and tests that need a real sidecar.

The child prints one ready line ("statestore serving on 127.0.0.1:<port> ...") once it
listens; `spawn_serve` waits for it and returns the port it bound (0 asks for any). Its
output stays on a pipe the caller may read; a server that would log a lot while nobody reads
should log to a file instead (tests/fault/nodes.py does). `spawn_until_ready` does the same for
any server that names its port on its first line (the service benchmark's echo).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

READY = re.compile(r"statestore serving on 127\.0\.0\.1:(\d+)")
FAILED_START_GRACE_S = 5.0  # a child that printed something else first: how long it may go on to say why


def spawn_serve(data_dir: Path, *, port: int = 0, preset: str = "mini", env: Mapping[str, str] | None = None,
                cwd: Path | None = None) -> tuple[subprocess.Popen[str], int]:
    """Start `python -m statestore.cli serve` on 127.0.0.1:`port` and return it with its port,
    once it printed its ready line. A child that exits or prints anything else first is killed,
    and RuntimeError carries what it printed."""
    return spawn_until_ready(
        [sys.executable, "-m", "statestore.cli", "serve", "--listen", f"127.0.0.1:{port}", "--data-dir",
         str(data_dir), "--preset", preset], READY, "statestore serve", env=env, cwd=cwd)


def spawn_until_ready(argv: list[str], ready: re.Pattern[str], name: str, *, env: Mapping[str, str] | None = None,
                      cwd: Path | None = None) -> tuple[subprocess.Popen[str], int]:
    """Start `argv` (a server called `name` in errors) and return it with the port its first
    line names (`ready`'s group 1). A child whose first line does not match is given
    `FAILED_START_GRACE_S` to finish (a server that cannot start usually exits, its reason still
    to come), then killed; RuntimeError carries everything it printed."""
    proc = subprocess.Popen(argv, cwd=cwd, env=None if env is None else dict(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = ready.search(line)
    if match is None:
        try:  # killed at once, it lost what it had not printed yet (under load, most of it)
            proc.wait(timeout=FAILED_START_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise RuntimeError(f"{name} did not start: {line}{proc.stdout.read()}")  # (through the line's buffer)
    return proc, int(match.group(1))
