"""statestore.spawn: a child server is handed back once its first line names its port, and one
whose first line does not is refused with its output in the error (killed if it goes on)."""

from __future__ import annotations

import re
import sys
import time

import pytest

from statestore import spawn
from statestore.spawn import spawn_until_ready

READY = re.compile(r"serving on port (\d+)")


def test_a_child_that_names_its_port_is_handed_back_running() -> None:
    proc, port = spawn_until_ready([sys.executable, "-c", "import time; print('serving on port 4321', flush=True); "
                                    "time.sleep(60)"], READY, "the test server")
    try:
        assert port == 4321 and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_child_whose_first_line_is_anything_else_is_refused_with_its_output() -> None:
    """Everything it prints until it exits is in the error, also what comes after a pause (it was
    killed at once, and under load the rest was lost)."""
    with pytest.raises(RuntimeError, match=r"the test server did not start: no port here\nand more\n"):
        spawn_until_ready([sys.executable, "-c", "import time; print('no port here', flush=True); time.sleep(0.3); "
                           "print('and more')"], READY, "the test server")


def test_a_child_that_goes_on_after_another_first_line_is_killed_after_the_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spawn, "FAILED_START_GRACE_S", 0.5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not start: a banner\nstill starting\n$"):
        spawn_until_ready([sys.executable, "-c", "import time; print('a banner'); print('still starting', flush=True); "
                           "time.sleep(60)"], READY, "the test server")
    assert time.monotonic() - started < 30
