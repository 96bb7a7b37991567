"""statestore.spawn: a child server is handed back once its first line names its port, and one
whose first line does not is killed, its output in the error."""

from __future__ import annotations

import re
import sys

import pytest

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
    with pytest.raises(RuntimeError, match=r"the test server did not start: no port here\nand more"):
        spawn_until_ready([sys.executable, "-c", "print('no port here'); print('and more')"], READY, "the test server")
