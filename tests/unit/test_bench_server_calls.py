"""`bench.server_calls`: the main thread's CPU seconds come from its own /proc entry and never
exceed the process's, per-record figures divide what was summed, and `--size` is checked."""

from __future__ import annotations

import argparse
import os
import threading
import time

import pytest

from bench.server_calls import SideCpu, cpu_seconds, record_sizes


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_main_thread_cpu_is_part_of_the_process() -> None:
    pid = os.getpid()
    main0, proc0 = cpu_seconds(pid, main_thread=True), cpu_seconds(pid)
    worker = threading.Thread(target=_spin, args=(0.3,))
    worker.start()
    worker.join()
    main1, proc1 = cpu_seconds(pid, main_thread=True), cpu_seconds(pid)
    assert main1 <= proc1
    # the worker's spin counts for the process, not for the main thread (clock ticks: 10 ms)
    assert (proc1 - proc0) - (main1 - main0) >= 0.2


def test_per_record_figures() -> None:
    side = SideCpu(client_main=0.5, server=2.0, server_main=1.0)
    assert side.per_record_us(1000) == {"client_main_us_per_record": 500.0, "server_us_per_record": 2000.0,
                                        "server_main_us_per_record": 1000.0}


def test_record_sizes_are_parsed_and_bounded() -> None:
    assert record_sizes("256K, 4M") == [256 << 10, 4 << 20]
    with pytest.raises(argparse.ArgumentTypeError, match="above 32M"):
        record_sizes("256K,64M")
    with pytest.raises(argparse.ArgumentTypeError):
        record_sizes("lots")
