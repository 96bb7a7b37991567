"""tiers._fs.map_io_buffer: the SSD tier's O_DIRECT buffers (huge-page backed where possible)."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest

from tiers import _fs


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@pytest.mark.parametrize("nbytes", [1, 4096, (2 << 20) + 1, 5 << 20])
def test_buffer_is_huge_page_aligned_and_large_enough(nbytes: int) -> None:
    buf = _fs.map_io_buffer(nbytes)
    assert len(buf) >= nbytes and len(buf) % _fs.HUGE_PAGE == 0
    assert _address(buf) % _fs.HUGE_PAGE == 0
    buf[-1:] = b"\x7f"  # writable to its last byte
    assert buf[-1] == 0x7F


def test_buffers_are_private(tmp_path: Path) -> None:
    """Two buffers never share memory (a private map, not one shmem object)."""
    a, b = _fs.map_io_buffer(4096), _fs.map_io_buffer(4096)
    a[:4] = b"aaaa"
    b[:4] = b"bbbb"
    assert bytes(a[:4]) == b"aaaa" and bytes(b[:4]) == b"bbbb"


def test_thread_buffer_grows_and_is_reused() -> None:
    small = _fs._aligned.get(4096)
    assert _fs._aligned.get(100) is small
    big = _fs._aligned.get(len(small) + 1)
    assert big is not small and len(big) > len(small)


def test_direct_round_trip_through_the_buffer(tmp_path: Path) -> None:
    """What the tier does with it: an O_DIRECT write and read of an unaligned length."""
    data = os.urandom(3 * 4096 + 100)
    path = tmp_path / "f"
    fd, _ = _fs._create(str(path), True)
    try:
        _fs._write(fd, [data[:10], memoryview(data)[10:]], len(data), True)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    try:
        fd = _fs.open_for_read(str(path), direct=True)
    except OSError as exc:  # pragma: no cover - a file system that refuses even the fallback
        pytest.skip(f"cannot open: {errno.errorcode.get(exc.errno)}")
    try:
        assert bytes(_fs.read_upto(fd, len(data) + 1)) == data
    finally:
        os.close(fd)
