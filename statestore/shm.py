"""Same-host shared-memory data path: gRPC carries control, a memfd carries the record bytes.

Why: on loopback, gRPC moves large records at a fraction of memory bandwidth (every 1 MiB
frame is copied into and out of the transport, framed, flow-controlled and handed across
threads; ~0.3-0.6 GB/s on the 2-core dev machine). A sidecar next to its client can move the
bytes through memory both processes map, so a 32 MiB chunk costs one copy in, one copy out.

Region. The client creates a memfd named `statestore-shm`, maps it, and writes `MAGIC` and a
32-byte random secret at offset 0; record bytes go at `DATA_OFFSET` and after. The region's name
is `/proc/<client pid>/fd/<fd>`: the server opens that path (only a process on the same host,
in the same pid namespace, with access to the client's fds can) and maps the same memory. The
memfd is freed once both sides have dropped it: nothing is left behind when a client dies.

Calls. One metadata entry, `x-statestore-shm: "<name> <secret hex> <offset> <length>"`, names the
window of the region a call may use. Records lie in it as on the wire (the 168-byte header, then
the payload), in slots: the first at the window's start, each next at the previous end rounded
up to 4 KiB (`ShmSlots`).
- PutRecords: the stream carries only each record's `RecordStart`; its bytes are in its slot.
- GetRecords: the server sends initial metadata `x-statestore-shm: attached`, writes each found
  record into the next slot and sends only its `RecordStart`. A record that does not fit the rest
  of the window ends the stream early if the window already holds a record (the client asks
  again for the remaining keys), or travels as data frames if it alone exceeds the window.

Fallback. A server that cannot attach (another host, another pid namespace, a closed fd, a wrong
secret) refuses a shm put with FAILED_PRECONDITION ("shm: ...") and serves a shm get as data
frames without the `attached` header. A client probes with one GetRecords before it uses the
path and stays on plain gRPC when the probe is not attached.

Checks (server): the peer is on loopback; the name is `/proc/<pid>/fd/<n>` and links to a memfd
named `statestore-shm`; the region starts with `MAGIC` and the secret the call gives; the window
lies inside the region. So a client can point the server only at a region whose secret it holds,
never at a file, and never at another client's region.

Lent memory. A client whose own buffers already live in POSIX shared memory (LMCache's CPU
buffer with its `shm_name` setting: a file under /dev/shm) may lend that file too, so that
the bulk of a record goes between the server and the client's buffer with no copy through the
window: metadata `x-statestore-lent: "<name> <size>"` beside the window, the name again
`/proc/<pid>/fd/<n>` of the same process. A put's `RecordStart` then says that its last
`lent_bytes` lie at `lent_offset` of the lent file (the rest, header first, in its slot); a get
names, per key, where it wants a record's last bytes (`LentDestination`) and the server, which
delivers them there, says so in the same fields. The server copies out of lent memory exactly as
out of a window (what it hashes is what it copied). Neither side makes a second pass over lent
bytes: a put may leave the payload checksum to the server (`checksum_by_server`), which takes it
as it copies them out, and a get that the server hashed as it delivered it is marked `verified`.
The server maps a lent file only if it is a regular file on the /dev/shm file system owned by the
user that owns the client process, of the size the call declares: nothing a client could not
already read and write itself.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import re
import secrets
import stat
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiers.offload import to_thread_to_completion
from tiers.record import HEADER_SIZE, Record, encode_header

METADATA_KEY = "x-statestore-shm"
LENT_METADATA_KEY = "x-statestore-lent"
LENT_DIR = "/dev/shm/"
ATTACHED = "attached"
MAGIC = b"SSSHM\x00\x00\x01"
SECRET_BYTES = 32
DATA_OFFSET = 4096
SLOT_ALIGN = 4096
MEMFD_NAME = "statestore-shm"
COPY_OFF_LOOP_BYTES = 1 << 20  # copies at least this large run on a worker thread
_NAME = re.compile(r"/proc/([0-9]{1,10})/fd/[0-9]{1,10}")
_LOOPBACK_PEERS = ("ipv4:127.", "ipv6:[::1]", "unix:")


class ShmUnavailable(Exception):
    """The shared-memory path cannot serve this call; the message says why."""


def shm_supported() -> bool:
    """memfd and /proc: Linux only."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def slot_bytes(total_bytes: int) -> int:
    """Bytes a record of `total_bytes` (encoded) takes in a window: rounded up to 4 KiB."""
    return -(-total_bytes // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True, slots=True)
class ShmWindow:
    """A range of a client's region that one call may use."""

    name: str
    secret: bytes
    offset: int
    length: int

    def to_metadata(self) -> tuple[str, str]:
        return METADATA_KEY, f"{self.name} {self.secret.hex()} {self.offset} {self.length}"

    @classmethod
    def parse(cls, value: str) -> ShmWindow:
        """The window a metadata value names; ShmUnavailable if it is malformed."""
        parts = value.split(" ")
        if len(parts) != 4 or not _NAME.fullmatch(parts[0]):
            raise ShmUnavailable(f"shm: metadata {METADATA_KEY} is not '/proc/<pid>/fd/<n> <secret> <offset> <length>'")
        try:
            secret, offset, length = bytes.fromhex(parts[1]), int(parts[2]), int(parts[3])
        except ValueError:
            raise ShmUnavailable("shm: secret, offset or length does not parse") from None
        if len(secret) != SECRET_BYTES or offset < DATA_OFFSET or length < SLOT_ALIGN or offset % SLOT_ALIGN:
            raise ShmUnavailable(f"shm: window [{offset}, +{length}) or secret length {len(secret)} is invalid "
                                 f"(offset >= {DATA_OFFSET}, 4 KiB aligned; secret {SECRET_BYTES} bytes)")
        return cls(parts[0], secret, offset, length)


class ShmSlots:
    """Where consecutive records go in a window (both sides compute the same offsets)."""

    def __init__(self, window: ShmWindow) -> None:
        self.window = window
        self._next = window.offset
        self.num_used = 0

    def peek(self, total_bytes: int) -> int | None:
        """Where the next record of `total_bytes` would go (None: it does not fit the rest), without taking it."""
        return self._next if self._next + total_bytes <= self.window.offset + self.window.length else None

    def take(self, total_bytes: int) -> int | None:
        """The offset of the next record of `total_bytes`, or None if it does not fit the rest."""
        end = self.window.offset + self.window.length
        if self._next + total_bytes > end:
            return None
        at, self._next = self._next, min(end, self._next + slot_bytes(total_bytes))
        self.num_used += 1
        return at


# ----- the server side ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Mapped:
    ident: tuple[int, int]  # (st_dev, st_ino) of the memfd
    secret: bytes
    size: int
    buf: mmap.mmap
    lent: bool = False  # a client's lent file (no secret), not a statestore memfd


@dataclass(frozen=True, slots=True)
class LentSpan:
    """Bytes of a record that lie in the client's lent file at `offset` (`view`: the same bytes
    as the client sees them, for hashing, and for gRPC frames when there is no shared memory)."""

    offset: int
    view: memoryview

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise ValueError(f"lent offset {self.offset} < 0")


class ShmAttachments:
    """The regions a server has mapped, by name: at most `max_regions`, least recently used
    dropped first, and a region whose name no longer resolves to the same memory (its client
    closed it or exited) dropped when the next region is attached or `drop_stale` runs."""

    def __init__(self, max_regions: int = 64) -> None:
        if max_regions < 1:
            raise ValueError(f"max_regions {max_regions} < 1")
        self.max_regions = max_regions
        self._regions: OrderedDict[str, _Mapped] = OrderedDict()

    def __len__(self) -> int:
        return len(self._regions)

    def window_from(self, metadata: Sequence[tuple[str, str | bytes]] | None, peer: str) -> ShmWindow | None:
        """The window a call's metadata names (None: the call does not use shm), once it is
        known to be usable; ShmUnavailable otherwise."""
        value = _metadata_value(metadata, METADATA_KEY)
        if value is None:
            return None
        if not peer.startswith(_LOOPBACK_PEERS):
            raise ShmUnavailable(f"shm: peer {peer} is not on loopback")
        window = ShmWindow.parse(value)
        region = self._attach(window)
        if window.offset + window.length > region.size:
            raise ShmUnavailable(f"shm: window [{window.offset}, +{window.length}) exceeds the "
                                 f"{region.size}-byte region")
        return window

    def lent_from(self, metadata: Sequence[tuple[str, str | bytes]] | None, window: ShmWindow | None) -> mmap.mmap | None:
        """The mapping of the lent file a call's metadata names beside its window (None: it names
        none); ShmUnavailable ("shm: lent ...") if it is unusable."""
        value = _metadata_value(metadata, LENT_METADATA_KEY)
        if value is None:
            return None
        if window is None:
            raise ShmUnavailable(f"shm: lent memory without a window ({METADATA_KEY})")
        parts = value.split(" ")
        match = _NAME.fullmatch(parts[0]) if len(parts) == 2 and parts[1].isdigit() else None
        if match is None:
            raise ShmUnavailable(f"shm: lent metadata {LENT_METADATA_KEY} is not '/proc/<pid>/fd/<n> <size>'")
        if match.group(1) != _NAME.fullmatch(window.name).group(1):  # type: ignore[union-attr]
            raise ShmUnavailable("shm: lent memory of another process than the window's")
        name, size = parts[0], int(parts[1])
        try:
            st = os.stat(name)
        except OSError as exc:
            raise ShmUnavailable(f"shm: lent: cannot open {name} ({exc.strerror})") from None
        cached = self._regions.get(name)
        if cached is None or not cached.lent or cached.ident != (st.st_dev, st.st_ino) or cached.size != size:
            cached = self._remember(name, lambda: self._open_lent(name, size, int(match.group(1))))
        self._regions.move_to_end(name)
        return cached.buf

    @staticmethod
    def _open_lent(name: str, size: int, pid: int) -> _Mapped:
        try:
            link = os.readlink(name)
            if not link.startswith(LENT_DIR):
                raise ShmUnavailable(f"shm: lent: {name} is not a file under {LENT_DIR}")
            owner = os.stat(f"/proc/{pid}").st_uid
            fd = os.open(name, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmUnavailable(f"shm: lent: cannot open {name} ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_dev != os.stat(LENT_DIR).st_dev:
                raise ShmUnavailable(f"shm: lent: {link} is not a regular file of the client's user on {LENT_DIR}")
            if st.st_size != size or size < SLOT_ALIGN:
                raise ShmUnavailable(f"shm: lent: {link} holds {st.st_size} bytes, the call says {size}")
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return _Mapped((st.st_dev, st.st_ino), b"", size, buf, lent=True)

    def buffer(self, window: ShmWindow) -> mmap.mmap:
        """The mapping of an attached window's region (after `window_from`)."""
        region = self._regions.get(window.name)
        if region is None or region.lent or region.secret != window.secret:
            raise ShmUnavailable(f"shm: region {window.name} is no longer attached")
        return region.buf

    def _attach(self, window: ShmWindow) -> _Mapped:
        try:
            st = os.stat(window.name)
        except OSError as exc:
            raise ShmUnavailable(f"shm: cannot open {window.name} ({exc.strerror}): not on this host?") from None
        cached = self._regions.get(window.name)
        if cached is not None and not cached.lent and cached.ident == (st.st_dev, st.st_ino):
            if cached.secret != window.secret:
                raise ShmUnavailable("shm: wrong secret for this region")
            self._regions.move_to_end(window.name)
            return cached
        return self._remember(window.name, lambda: self._open(window))

    def _remember(self, name: str, open_region: Callable[[], _Mapped]) -> _Mapped:
        """Map a region anew under `name` (what was there is dropped first, even if this fails)
        and keep it, dropping stale ones and, beyond `max_regions`, the least recently used."""
        self._regions.pop(name, None)
        mapped = open_region()
        self.drop_stale()
        while len(self._regions) >= self.max_regions:
            self._regions.popitem(last=False)
        self._regions[name] = mapped
        return mapped

    @staticmethod
    def _open(window: ShmWindow) -> _Mapped:
        try:
            link = os.readlink(window.name)
            if not link.startswith(f"/memfd:{MEMFD_NAME}"):
                raise ShmUnavailable(f"shm: {window.name} is not a statestore memfd")
            fd = os.open(window.name, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmUnavailable(f"shm: cannot open {window.name} ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if st.st_size < DATA_OFFSET + SLOT_ALIGN:
                raise ShmUnavailable(f"shm: region of {st.st_size} bytes is too small")
            buf = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if buf[:len(MAGIC)] != MAGIC or not secrets.compare_digest(buf[len(MAGIC):len(MAGIC) + SECRET_BYTES],
                                                                   window.secret):
            buf.close()
            raise ShmUnavailable("shm: region magic or secret does not match")
        return _Mapped((st.st_dev, st.st_ino), window.secret, st.st_size, buf)

    def drop_stale(self) -> int:
        """Drop the regions whose name no longer leads to the memory mapped (the client closed it
        or exited); returns how many. A client's lent memory is its own buffer (LMCache's, GBs):
        held here, its pages would outlive the client. The server calls this once a second, and
        every attach does."""
        dropped = 0
        for name in list(self._regions):
            try:
                st = os.stat(name)
                alive = (st.st_dev, st.st_ino) == self._regions[name].ident
            except OSError:
                alive = False
            if not alive:
                del self._regions[name]  # unmapped once no call still holds a view of it
                dropped += 1
        return dropped

    def close(self) -> None:
        self._regions.clear()


def _metadata_value(metadata: Sequence[tuple[str, str | bytes]] | None, key: str) -> str | None:
    value = next((v for k, v in metadata or () if k == key), None)
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def slot_views(buf: mmap.mmap, window: ShmWindow, totals: Sequence[int]) -> list[memoryview]:
    """Views of consecutive records' encoded bytes in a window (release them when done);
    ShmUnavailable when they do not fit it."""
    slots, views = ShmSlots(window), []
    for total in totals:
        at = slots.take(total)
        if at is None:
            for view in views:
                view.release()
            raise ShmUnavailable(f"shm: {len(totals)} records of {sum(totals)} bytes overflow the "
                                 f"{window.length}-byte window")
        views.append(memoryview(buf)[at:at + total])
    return views


def _write_slot(buf: mmap.mmap, offset: int, record: Record, *, header_only: bool = False,
                lent: memoryview | None = None) -> None:
    payload = record.payload
    header = encode_header(record.header, stored_length=len(payload), flags=0, checksum=record.payload_sum())
    view = memoryview(buf)
    try:
        view[offset:offset + HEADER_SIZE] = header
        if not header_only:
            in_slot = len(payload) - (len(lent) if lent is not None else 0)
            view[offset + HEADER_SIZE:offset + HEADER_SIZE + in_slot] = memoryview(payload)[:in_slot]
            if lent is not None:
                lent[:] = memoryview(payload)[in_slot:]
    finally:
        view.release()


def write_slot_header(buf: mmap.mmap, offset: int, record: Record) -> None:
    """Encode only the header of a record whose payload already lies in its slot (a tier
    delivered it there while reading it, `SSDTier.reading_into`)."""
    _write_slot(buf, offset, record, header_only=True)


async def write_slot(buf: mmap.mmap, offset: int, record: Record, lent: memoryview | None = None) -> None:
    """Encode one record into its slot, as on the wire (on a worker thread when large); `lent`:
    where its last `len(lent)` payload bytes go instead (the caller's lent memory)."""
    if len(record.payload) >= COPY_OFF_LOOP_BYTES:
        await to_thread_to_completion(_write_slot, buf, offset, record, lent=lent)
    else:
        _write_slot(buf, offset, record, lent=lent)


# ----- the client side ---------------------------------------------------------------------------


class ShmRegion:
    """A client's region: a memfd it maps and lends out in windows, one per call in flight.

    Windows are leased first fit and 4 KiB aligned; a lease that cannot be served now waits
    until one is released (`lease` returns None only for a request larger than the region).
    Use from one event loop.
    """

    def __init__(self, size_bytes: int) -> None:
        if size_bytes < DATA_OFFSET + SLOT_ALIGN:
            raise ValueError(f"shm region of {size_bytes} bytes is too small")
        if not shm_supported():
            raise ShmUnavailable("shm: memfd_create is not available here")
        self.size_bytes = slot_bytes(size_bytes)
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, self.size_bytes)
            self.buf = mmap.mmap(self._fd, self.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        self.buf[:len(MAGIC) + SECRET_BYTES] = MAGIC + self.secret
        self.name = f"/proc/{os.getpid()}/fd/{self._fd}"
        self._free: list[tuple[int, int]] = [(DATA_OFFSET, self.size_bytes)]  # sorted [start, end)
        self._released = asyncio.Condition()

    @property
    def capacity(self) -> int:
        return self.size_bytes - DATA_OFFSET

    def window(self, offset: int, length: int) -> ShmWindow:
        return ShmWindow(self.name, self.secret, offset, length)

    async def lease(self, nbytes: int) -> ShmWindow | None:
        """A window of at least `nbytes` (rounded up to 4 KiB); None if larger than the region."""
        want = slot_bytes(max(nbytes, 1))
        if want > self.capacity:
            return None
        async with self._released:
            while True:
                for i, (start, end) in enumerate(self._free):
                    if end - start >= want:
                        if end - start == want:
                            del self._free[i]
                        else:
                            self._free[i] = (start + want, end)
                        return self.window(start, want)
                await self._released.wait()

    async def release(self, window: ShmWindow) -> None:
        start, end = window.offset, window.offset + window.length
        async with self._released:
            free = sorted([*self._free, (start, end)])
            merged: list[tuple[int, int]] = []
            for s, e in free:
                if merged and merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], e)
                else:
                    merged.append((s, e))
            self._free = merged
            self._released.notify_all()

    def close(self) -> None:
        """Unmap and close; the memory goes once the server drops its mapping too."""
        if self._fd >= 0:
            try:
                self.buf.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
            os.close(self._fd)
            self._fd = -1


class LentRegion:
    """A client's file under /dev/shm that holds its own buffers (LMCache's CPU buffer with
    `shm_name`), lent to the server beside its window (see the module docstring). Opens its own
    descriptor of the file, so the name stays valid while this object is open."""

    def __init__(self, path: str) -> None:
        if not path.startswith(LENT_DIR):
            raise ShmUnavailable(f"shm: lent memory must be a file under {LENT_DIR}, not {path!r}")
        self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.path = path
        self.size_bytes = os.fstat(self._fd).st_size
        self.name = f"/proc/{os.getpid()}/fd/{self._fd}"

    def to_metadata(self) -> tuple[str, str]:
        return LENT_METADATA_KEY, f"{self.name} {self.size_bytes}"

    def holds(self, span: LentSpan) -> bool:
        return span.offset + len(span.view) <= self.size_bytes

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
