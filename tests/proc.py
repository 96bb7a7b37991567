"""Process helpers the tests share: stopping a child process so that what it left on disk can
be inspected (a SIGKILL then leaves exactly what was seen), and counting this process's
descriptors on a file."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def threads_stopped(pid: int, *, allow_disk_wait: bool = True) -> bool:
    """Every thread of `pid` is stopped (T/t); with `allow_disk_wait`, a thread still in an
    uninterruptible system call (D), which ends in the stop, counts as stopped too."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    allowed = ("T", "t", "D") if allow_disk_wait else ("T", "t")
    return bool(states) and all(s in allowed for s in states)


def freeze(pid: int, *, timeout_s: float = 2.0, poll_s: float = 0.0005, allow_disk_wait: bool = True) -> bool:
    """SIGSTOP `pid` and wait (up to `timeout_s`) until all its threads are stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not (stopped := threads_stopped(pid, allow_disk_wait=allow_disk_wait)) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return stopped


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


def fds_on(path: Path) -> int:
    """How many of this process's file descriptors are open on `path`."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            pass
    return count
