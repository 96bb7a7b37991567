"""Bulk copies that release the GIL while they copy.

A slice assignment between buffers (`dest[a:b] = src[a:b]`) is a memcpy that holds the GIL
throughout. The SSD tier copies large payloads on one thread while its other threads wait on
the disk: a thread whose read or write returned needs the GIL to issue the next one, and it
waited for the copy. `ctypes.memmove` drops the GIL for the copy, as a read or write does for
its system call. Development VM: a 32 MiB O_DIRECT read took 8.4 ms alone and 15 ms beside a
thread that copied with slice assignments (the same beside another process: 8.6 ms);
a Python loop beside `ctypes.memmove` kept its pace (55 against 53 ms alone, 83 beside slice
copies).

A destination must be writable, contiguous bytes (ctypes takes the address of nothing else);
a source may also be read-only (a `bytes` payload, a message's view: `source_address` takes its
address through numpy, which reads any contiguous buffer). Anything else is a slice assignment.
"""

from __future__ import annotations

import ctypes

import numpy as np


def address(view: memoryview) -> int | None:
    """Where `view`'s bytes start, if it is writable, C-contiguous, one byte per item and not
    empty; else None. Valid while `view` (which pins its buffer) is alive."""
    if view.readonly or not view.c_contiguous or view.itemsize != 1 or not view.nbytes:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


READONLY_MIN_BYTES = 64 << 10  # below this a read-only source is copied by slices (numpy's ~3 us is more)


def source_address(view: memoryview) -> int | None:
    """Where `view`'s bytes start, if it is C-contiguous, one byte per item and not empty, and
    writable or at least READONLY_MIN_BYTES long; else None. Valid while `view` (which pins its
    buffer) is alive."""
    if not view.readonly:
        return address(view)
    if not view.c_contiguous or view.itemsize != 1 or view.nbytes < READONLY_MIN_BYTES:
        return None
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)  # the array's memory is the view's


def copy_bytes(dest: memoryview, dest_at: int | None, src: memoryview, src_at: int | None,
               start: int, end: int) -> None:
    """dest[start:end] = src[start:end], without the GIL when both addresses are known
    (`address`); the caller has checked that both are at least `end` bytes long."""
    if dest_at is not None and src_at is not None:
        ctypes.memmove(dest_at + start, src_at + start, end - start)
    else:
        dest[start:end] = src[start:end]
