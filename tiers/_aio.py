"""Reads of the SSD tier on the event loop itself: Linux native AIO, no thread hop.

A native AIO read is submitted from the loop and completes by bumping an eventfd that the loop
watches, so the loop keeps any number of reads in flight without threads and without a hop per
read (`tiers._hop`). What that buys, measured on the development VM (bench/tiers.py,
`vs_threads`: the same tier with every read on threads, in the same rounds): `get_many` of
256 KiB records at depth 4 1.08-1.35x, because a batch's reads are all in flight from one
thread. A single get at depth 1 gained nothing through the eventfd (0.86-1.03x): this VM's
idle vCPUs halt (`guest_halt_poll_ns` 0), and waking the loop from a completion is the same
VM exit as waking it from a thread. So while a read is the only one in flight the loop polls
the completion ring (`poll_s`, `_poll`) between its other work instead of sleeping: 256 KiB
depth-1 gets 0.80-0.98 of the O_DIRECT reference polled against 0.73-0.94 through the
eventfd. With several in flight the eventfd wakes it (polling there was slower), and so it
does while the owner's threads have work (`busy`: they need the GIL back). Records from
2 MiB stay on the threads (`tiers.ssd_reads.LOOP_READ_MAX_FILE_BYTES`).

Nothing here may block the loop on the disk, so each step that could falls back instead:
- the file is opened with `openat2(RESOLVE_CACHED)`, which fails with EAGAIN unless every path
  component is in the kernel's lookup cache (io_uring's own non-blocking open);
- the read is submitted with `RWF_NOWAIT`, which ends it with EAGAIN where it would have to
  wait (block-mapping metadata to read, a congested queue);
- a full AIO context refuses the submission with EAGAIN.
Each EAGAIN surfaces as `WouldBlock`, and the caller does the operation on a worker thread; so
do EOPNOTSUPP and EINVAL (a file system that cannot do `RWF_NOWAIT` reads, tmpfs among them).

Only O_DIRECT reads come here (buffered AIO reads are synchronous on Linux). Where any of it is
missing (another OS or architecture, a kernel before 5.12, a seccomp filter refusing
`io_setup`), `AioReads.create` returns None and the tier keeps its threads.

A read in flight owns its buffer until the kernel is done with it, even if the task that
awaited it was cancelled: `after(future, clean_up)` hands the clean-up (close the fd, give the
buffer back) to the completion. `close()` waits for the reads in flight before it destroys the
context, so a buffer is never returned while the device may still write into it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field

from tiers._iobuffers import address_of

logger = logging.getLogger(__name__)

# Syscall numbers (the C library wraps neither the AIO calls nor openat2).
_SYSCALLS = {
    "x86_64": {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209, "openat2": 437},
    "aarch64": {"io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_getevents": 4, "openat2": 437},
}
_IOCB_CMD_PREAD = 0
_IOCB_FLAG_RESFD = 1
_RWF_NOWAIT = 0x8
_RESOLVE_CACHED = 0x20
_AT_FDCWD = -100
_NOT_HERE = (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL)  # results that send a read to a thread
_AIO_RING_MAGIC = 0xA10A10A1
DEFAULT_DEPTH = 64  # reads in flight per context (a tier keeps max_concurrency per get_many); more go to threads
# How long the loop looks for completions between its other work before it waits on the eventfd
# instead (`AioReads` poll_s): a 4 MiB read takes ~2 ms on the development VM's disk.
DEFAULT_POLL_S = 0.002


class WouldBlock(Exception):
    """The operation would have waited on the loop (not cached, would block, context full):
    do it on a worker thread instead."""


class Unsupported(WouldBlock):
    """The file's file system cannot take these reads at all (tmpfs: no `RWF_NOWAIT`): every
    read of it belongs on a thread."""


class _Iocb(ctypes.Structure):
    """`struct iocb` (linux/aio_abi.h), little-endian field order."""

    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("lio_opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _IoEvent(ctypes.Structure):
    """`struct io_event`."""

    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class _AioRing(ctypes.Structure):
    """The head of `struct aio_ring` (fs/aio.c), which the kernel maps into the process at the
    context's address: completions are waiting while `head != tail` (libaio's user-space check)."""

    _fields_ = [("id", ctypes.c_uint), ("nr", ctypes.c_uint), ("head", ctypes.c_uint), ("tail", ctypes.c_uint),
                ("magic", ctypes.c_uint), ("compat_features", ctypes.c_uint),
                ("incompat_features", ctypes.c_uint), ("header_length", ctypes.c_uint)]


class _OpenHow(ctypes.Structure):
    """`struct open_how` (linux/openat2.h)."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@dataclass(slots=True)
class _Op:
    """A read in flight: what must stay alive until its completion event."""

    fut: asyncio.Future[int]
    iocb: _Iocb
    view: memoryview  # kept alive until the kernel is done with it
    landed: list[Callable[[], None]] = field(default_factory=list)  # `after`'s clean-ups


class AioReads:
    """O_DIRECT reads submitted from one event loop and completed through an eventfd, or,
    while a read is the only one in flight, by polling the completion ring between the loop's
    other work (`poll_s`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, libc: ctypes.CDLL, numbers: dict[str, int],
                 ctx: int, efd: int, depth: int, poll_s: float = DEFAULT_POLL_S,
                 busy: Callable[[], bool] | None = None) -> None:
        self._loop = loop
        self._ctx = ctypes.c_ulong(ctx)
        # The syscalls with their fixed arguments made once: ctypes conversions were half of an
        # open's ~10 us. (`byref` keeps its `open_how` alive.)
        def call(name: str, *fixed: object) -> Callable[..., int]:
            return functools.partial(libc.syscall, ctypes.c_long(numbers[name]), *fixed)

        self._openat2 = call("openat2", ctypes.c_long(_AT_FDCWD))
        self._how_args: dict[bool, tuple[object, ctypes.c_size_t]] = {}
        for direct in (True, False):
            how = _OpenHow(os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0), 0, _RESOLVE_CACHED)
            self._how_args[direct] = (ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        self._io_submit_one = call("io_submit", self._ctx, ctypes.c_long(1))
        self._efd = efd
        self._depth = depth
        self._events = (_IoEvent * depth)()
        self._io_getevents_ready = call("io_getevents", self._ctx, ctypes.c_long(0), ctypes.c_long(depth),
                                        self._events, None)  # whatever has completed, without waiting
        self._io_destroy = call("io_destroy", self._ctx)
        self._ops: dict[int, _Op] = {}
        self._next_tag = 1
        self._closing = False
        self._poll_s = poll_s
        self._busy = busy
        self._polling: asyncio.Handle | None = None
        self._quiet_until = 0.0
        ring = _AioRing.from_address(ctx)
        self._ring = ring if ring.magic == _AIO_RING_MAGIC and ring.incompat_features == 0 else None
        loop.add_reader(efd, self._reap)

    @classmethod
    def create(cls, depth: int = DEFAULT_DEPTH, poll_s: float = DEFAULT_POLL_S,
               busy: Callable[[], bool] | None = None) -> AioReads | None:
        """A context bound to the running loop, or None where native AIO is unavailable.
        `busy`: while it says so (the owner's threads have work in flight), no polling: a loop
        that spins holds the GIL those threads need back after each system call."""
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or not hasattr(os, "eventfd") or not hasattr(os, "O_DIRECT"):
            return None
        loop = asyncio.get_running_loop()
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        ctx = ctypes.c_ulong(0)
        if libc.syscall(ctypes.c_long(numbers["io_setup"]), ctypes.c_long(depth), ctypes.byref(ctx)) != 0:
            logger.debug("native AIO unavailable (io_setup: %s): reads stay on threads",
                         os.strerror(ctypes.get_errno()))
            return None
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            reads = cls(loop, libc, numbers, ctx.value, efd, depth, poll_s, busy)
        except (NotImplementedError, RuntimeError) as exc:  # a loop without add_reader
            os.close(efd)
            libc.syscall(ctypes.c_long(numbers["io_destroy"]), ctx)
            logger.debug("native AIO unusable on this event loop (%s): reads stay on threads", exc)
            return None
        if not reads._probe_openat2():
            reads.close()
            return None
        return reads

    def usable(self) -> bool:
        """On the loop this context belongs to, and open."""
        if self._closing:
            return False
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    @property
    def in_flight(self) -> int:
        return len(self._ops)

    def _probe_openat2(self) -> bool:
        try:
            os.close(self.open_cached("/", direct=False))
            return True
        except (WouldBlock, OSError) as exc:
            logger.debug("openat2(RESOLVE_CACHED) unavailable (%s): reads stay on threads", exc)
            return False

    # ----- open and read ----------------------------------------------------------------

    def open_cached(self, path: str, *, direct: bool = True) -> int:
        """`open(path, O_RDONLY [| O_DIRECT])` if every component of `path` is in the lookup
        cache; WouldBlock if it is not (or the file system refuses O_DIRECT); OSError else
        (FileNotFoundError for a file that is gone)."""
        fd = self._openat2(ctypes.c_char_p(os.fsencode(path)), *self._how_args[direct])
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.EINVAL):  # not cached; O_DIRECT refused: the thread path decides
            raise WouldBlock(f"openat2: {os.strerror(err)}")
        raise OSError(err, os.strerror(err), path)

    def submit(self, fd: int, view: memoryview, offset: int) -> asyncio.Future[int]:
        """Submit a read of `fd` at `offset` into `view` (aligned for O_DIRECT); the future
        resolves to the bytes read (fewer only at end of file), or fails with WouldBlock (it
        would have waited: nothing was read) or OSError. WouldBlock (Unsupported) here: the
        context or the file system refused it, nothing is in flight.

        `view` belongs to the read until it has landed, whatever happens to the future: a
        submitter whose wait was cancelled (which cancels the future, not the read) hands the
        clean-up to `after`."""
        if self._closing:
            raise WouldBlock("closing")
        if len(self._ops) >= self._depth:
            raise WouldBlock("context full")
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        iocb = _Iocb(data=tag, rw_flags=_RWF_NOWAIT, lio_opcode=_IOCB_CMD_PREAD, fildes=fd, buf=address_of(view),
                     nbytes=len(view), offset=offset, flags=_IOCB_FLAG_RESFD, resfd=self._efd)
        iocbs = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(iocb))
        if self._io_submit_one(iocbs) != 1:
            err = ctypes.get_errno()
            if err in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without RWF_NOWAIT reads (tmpfs)
                raise Unsupported(f"io_submit: {os.strerror(err)}")
            raise WouldBlock(f"io_submit: {os.strerror(err)}")
        op = self._ops[tag] = _Op(self._loop.create_future(), iocb, view)
        self._watch()
        return op.fut

    def after(self, fut: asyncio.Future[int], fn: Callable[[], None]) -> None:
        """Run `fn` once the read behind `fut` has landed (now, if it has): the clean-up of a
        read whose submitter stopped waiting for it, cancelled or not. Its outcome is dropped."""
        if not fut.cancelled() and fut.done():
            fut.exception()  # retrieved: no "never retrieved" warning for a dropped failure
        for op in self._ops.values():
            if op.fut is fut:
                op.landed.append(fn)
                return
        fn()

    def _pollable(self) -> bool:
        """Polling is for a read alone in flight, while the owner's threads have nothing in flight."""
        return self._poll_s > 0 and len(self._ops) == 1 and not (self._busy is not None and self._busy())

    def _watch(self) -> None:
        """Start polling (`_poll`) if it is for now."""
        if self._polling is None and self._pollable():
            self._quiet_until = self._loop.time() + self._poll_s
            self._polling = self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        """One look at the completion ring, then again on the loop's next pass, for up to
        `poll_s`, while a single read is in flight. A callback that is always ready keeps the
        loop from sleeping in epoll: the loop's other work runs between looks, and its vCPU
        never halts, where waking a halted one (this VM: `guest_halt_poll_ns` 0) cost as much
        as a 256 KiB read. The price: a core busy while a lone read is in flight, the price
        the kernel's own polled I/O pays. With several in flight the eventfd wakes the loop:
        completions keep coming to a busy loop, and polling there measured slower (256 KiB
        get_many at depth 4: 0.92-0.95 of the reference polled, 1.05-1.06 not)."""
        self._polling = None
        if not self._pollable():
            return  # (the eventfd wakes the loop)
        ring = self._ring
        if ring is None or ring.head != ring.tail:
            self._reap()  # (which polls anew if it settled one and another is now alone)
            if self._polling is not None or not self._pollable():
                return
        if self._loop.time() < self._quiet_until:
            self._polling = self._loop.call_soon(self._poll)

    def _reap(self) -> None:
        """The eventfd is readable: settle every completed read."""
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        settled = False
        while True:
            n = self._io_getevents_ready()
            if n < 0 and ctypes.get_errno() == errno.EINTR:
                continue  # the eventfd is drained: these events would not wake the loop again
            if n <= 0:
                if n < 0:
                    logger.error("io_getevents: %s", os.strerror(ctypes.get_errno()))
                break
            for i in range(n):
                event = self._events[i]
                op = self._ops.pop(event.data, None)
                if op is not None:
                    self._settle(op, event.res)
                    for fn in op.landed:
                        fn()
                    settled = True
            if n < self._depth:
                break
        if self._closing and not self._ops:
            self._destroy()
        elif settled:
            self._watch()

    @staticmethod
    def _settle(op: _Op, res: int) -> None:
        if op.fut.done():
            return
        if res >= 0:
            op.fut.set_result(res)
        elif -res in _NOT_HERE:
            op.fut.set_exception(WouldBlock(f"read: {os.strerror(-res)}"))
        else:
            op.fut.set_exception(OSError(-res, os.strerror(-res)))

    # ----- life cycle -------------------------------------------------------------------

    def close(self) -> None:
        """No new reads; the context goes once the reads in flight have completed."""
        if self._closing:
            return
        self._closing = True
        if not self._ops:
            self._destroy()

    def _destroy(self) -> None:
        if self._efd < 0:
            return
        if self._polling is not None:
            self._polling.cancel()
            self._polling = None
        self._ring = None  # unmapped by io_destroy
        try:
            self._loop.remove_reader(self._efd)
        except RuntimeError:  # the loop is closed already
            pass
        self._io_destroy()
        os.close(self._efd)
        self._efd = -1
