"""GET and MGET replies read straight into buffers of their own (plain TCP or Unix sockets, no TLS).

redis-py's asyncio client reads a reply through an asyncio StreamReader (and, without hiredis,
a pure-Python parser): the bytes pass through the transport's read buffer, the reader's
buffer, which grows by reallocation and copies what it holds as it grows, and a final slice.
On the development VM a 32 MiB GET took ~80 ms that way against ~30 ms read into place, and a
1 MiB GET 0.9-1.7 ms against 0.4.

`BulkReader` keeps a few plain connections of its own (AUTH and SELECT as the tier's URL says)
and reads with an `asyncio.BufferedProtocol`: once a bulk string's length is known, the
transport's reads land in a buffer of exactly that size (plus its CRLF), so each value is
copied once, by the kernel. Small values that arrive together are parsed out of one scratch
buffer. Everything else the tier does (SETs, scans, deletes, reads on TLS URLs, a Cluster's slot
map and redirects) stays with redis-py; on a Cluster the tier keeps one reader per node.

Failures are redis-py's exception types, so the tier's outage boundary treats both clients
alike: a connection lost or refused is `ConnectionError`, no bytes for `socket_timeout_s` is
`TimeoutError`, an error reply is `ResponseError`, a reply that breaks the protocol is
`InvalidResponse`. A connection whose reply was not read to its end (any failure, a
cancelled caller) is closed, never reused.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rex
from redis.connection import parse_url

logger = logging.getLogger(__name__)

SCRATCH_BYTES = 64 << 10  # reply lines and small values; a value larger than what is left goes direct
MAX_LINE_BYTES = SCRATCH_BYTES  # a reply line (type, length, error text) longer than this is refused
# A bulk string announced longer than this is refused before anything is allocated for it: twice
# Redis's default `proto-max-bulk-len` (512 MB), so no value Redis would store is turned away,
# while a corrupt length cannot make the reader allocate without bound.
MAX_VALUE_BYTES = 1 << 30
CLIENT_NAME = "statestore-reader"  # what `CLIENT LIST` shows for the reader's connections
_CRLF = b"\r\n"


def supports(url: str) -> bool:
    """Whether `url` is one `BulkReader` can serve: `redis://` or `unix://` (not `rediss://`)."""
    return url.startswith(("redis://", "unix://"))


def encode_command(*parts: bytes | str) -> bytes:
    """A command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        out.append(b"$%d\r\n" % len(data))
        out.append(data)
        out.append(_CRLF)
    return b"".join(out)


class ReplyParser:
    """Parses one RESP reply at a time into `result`: a bulk string as a read-only view of a
    buffer of its own (None for nil), an array of those (one level: what GET and MGET answer),
    a simple string, an integer, or a `ResponseError` for an error reply.

    Fed by `BulkProtocol` through `buffer()` (where the next bytes should land) and `landed(n)`;
    kept apart from any socket so that it can be driven byte pattern by byte pattern.
    """

    def __init__(self) -> None:
        self._scratch = bytearray(SCRATCH_BYTES)
        self._start = 0  # unparsed bytes are scratch[_start:_end]
        self._end = 0
        self._body: bytearray | None = None  # the bulk string being filled (value + CRLF)
        self._filled = 0
        self._direct = False  # the last buffer() handed out was the body's
        self._items: list[Any] | None = None  # the array being filled
        self._want = 0  # elements the array still needs
        self.done = False
        self.result: Any = None

    def reset(self) -> None:
        """Ready for the next reply; bytes already received beyond the last reply are an error
        (one command is in flight per connection at a time)."""
        if self._start != self._end or self._body is not None:
            raise rex.InvalidResponse("redis sent bytes beyond the reply")
        self._start = self._end = 0
        self._items, self._want, self.done, self.result = None, 0, False, None

    def buffer(self) -> memoryview:
        """Where the next received bytes should go: the rest of a large bulk string being
        filled (no copy), else the scratch buffer's free room."""
        body = self._body
        if body is not None and self._start == self._end and len(body) - self._filled > SCRATCH_BYTES // 4:
            self._direct = True
            return memoryview(body)[self._filled:]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start and len(self._scratch) - self._end < SCRATCH_BYTES // 4:
            tail = self._end - self._start  # compact: the unparsed tail (a partial line) to the front
            self._scratch[:tail] = self._scratch[self._start:self._end]
            self._start, self._end = 0, tail
        if self._end == len(self._scratch):
            raise rex.InvalidResponse(f"redis reply line longer than {MAX_LINE_BYTES} bytes")
        return memoryview(self._scratch)[self._end:]

    def landed(self, nbytes: int) -> None:
        """`nbytes` arrived in the last `buffer()`."""
        if self._direct:
            self._filled += nbytes
            self._direct = False
            if self._body is not None and self._filled == len(self._body):
                self._finish_body()
        else:
            self._end += nbytes
            self._parse()

    def _parse(self) -> None:
        scratch = self._scratch
        while not self.done and self._start < self._end:
            body = self._body
            if body is not None:  # copy what the scratch holds of the body
                take = min(self._end - self._start, len(body) - self._filled)
                body[self._filled:self._filled + take] = memoryview(scratch)[self._start:self._start + take]
                self._filled += take
                self._start += take
                if self._filled == len(body):
                    self._finish_body()
                continue
            eol = scratch.find(_CRLF, self._start, self._end)
            if eol < 0:
                return
            line = bytes(scratch[self._start:eol])
            self._start = eol + 2
            self._line(line)

    def _line(self, line: bytes) -> None:
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = self._int(rest)
            if length < -1 or length > MAX_VALUE_BYTES:
                raise rex.InvalidResponse(f"redis bulk length {length} outside [-1, {MAX_VALUE_BYTES}]")
            if length == -1:
                self._value(None)
            else:
                self._body, self._filled = bytearray(length + 2), 0
        elif kind == b"*" and self._items is None:
            count = self._int(rest)
            if count <= 0:
                self._complete(None if count == -1 else [])
            else:
                self._items, self._want = [], count
        elif kind == b"-" and self._items is None:
            self._complete(rex.ResponseError(rest.decode("utf-8", "replace")))
        elif kind == b"+" and self._items is None:
            self._complete(rest.decode("utf-8", "replace"))
        elif kind == b":" and self._items is None:
            self._complete(self._int(rest))
        else:
            raise rex.InvalidResponse(f"unexpected redis reply line {line[:40]!r}")

    @staticmethod
    def _int(text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            raise rex.InvalidResponse(f"redis reply length {text[:40]!r} is not an integer") from None

    def _finish_body(self) -> None:
        body = self._body
        assert body is not None
        if body[-2:] != _CRLF:
            raise rex.InvalidResponse("redis bulk string not followed by CRLF")
        self._body = None
        self._value(memoryview(body)[:-2].toreadonly())  # (the transport may still hold a view: no resize)

    def _value(self, value: memoryview | None) -> None:
        if self._items is None:
            self._complete(value)
            return
        self._items.append(value)
        self._want -= 1
        if not self._want:
            self._complete(self._items)

    def _complete(self, result: Any) -> None:
        self.result, self.done = result, True


class BulkProtocol(asyncio.BufferedProtocol):
    """One connection: a command written, its reply parsed in place (`ReplyParser`)."""

    def __init__(self) -> None:
        self.parser = ReplyParser()
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Any] | None = None
        self.last_progress = 0.0
        self.lost: BaseException | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        try:
            return self.parser.buffer()
        except rex.RedisError as exc:
            self._fail(exc)
            return memoryview(bytearray(SCRATCH_BYTES))  # the transport is closing: a sink

    def buffer_updated(self, nbytes: int) -> None:
        self.last_progress = time.monotonic()
        if self.waiter is None or self.waiter.done():
            self._fail(rex.InvalidResponse("redis sent bytes while no command was waiting"))
            return
        try:
            self.parser.landed(nbytes)
        except rex.RedisError as exc:
            self._fail(exc)
            return
        if self.parser.done:
            self.waiter.set_result(self.parser.result)

    def eof_received(self) -> bool:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = rex.ConnectionError(f"redis closed the connection{f': {exc}' if exc else ''}")
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(self.lost)

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    async def call(self, command: bytes, timeout_s: float) -> Any:
        """Send `command` and return its parsed reply (an error reply is raised as
        ResponseError); no reply bytes for `timeout_s` is TimeoutError."""
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            raise self.lost or rex.ConnectionError("redis connection closed")
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        self.last_progress = time.monotonic()
        self._watchdog = loop.call_later(timeout_s, self._watch, timeout_s)
        try:
            self.parser.reset()
            self.transport.write(command)
            result = await waiter
        finally:
            self._watchdog.cancel()
            self.waiter = None
            if not waiter.done() or waiter.cancelled() or waiter.exception() is not None:
                self.transport.abort()  # the reply was not read to its end: never reuse the connection
        if isinstance(result, rex.ResponseError):
            raise result
        return result

    def _watch(self, timeout_s: float) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        idle = time.monotonic() - self.last_progress
        if idle >= timeout_s:
            self._fail(rex.TimeoutError(f"no reply bytes from redis for {timeout_s} s"))
        else:
            self._watchdog = asyncio.get_running_loop().call_later(timeout_s - idle, self._watch, timeout_s)


class BulkReader:
    """GET and MGET on connections of its own, values read in place (see the module docstring).

    Args:
        url: the tier's `redis://` or `unix://` URL (host, port, db, username, password).
        host, port: another node than the URL's, with the URL's credentials (a Cluster's nodes).
        socket_timeout_s: connect timeout, and the longest a reply may go without a byte.
        max_connections: calls in flight at once; more wait for a connection.
    """

    def __init__(self, url: str, *, host: str | None = None, port: int | None = None,
                 socket_timeout_s: float = 0.5, max_connections: int = 8) -> None:
        if not supports(url):
            raise ValueError(f"BulkReader serves redis:// and unix:// URLs, not {url.split('://')[0]}://")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        opts = parse_url(url)
        self._host = host or opts.get("host", "localhost")
        self._port = int(port or opts.get("port", 6379))
        self._path = None if host else opts.get("path")
        self._db = int(opts.get("db", 0) or 0)
        self._username = opts.get("username")
        self._password = opts.get("password")
        self._timeout_s = socket_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[BulkProtocol] = []
        self._closed = False

    async def get(self, name: bytes | str) -> memoryview | None:
        """The value of `name` as a read-only view of a buffer of its own (None when it does not exist)."""
        reply = await self._call(encode_command(b"GET", name))
        if reply is not None and not isinstance(reply, memoryview):
            raise rex.InvalidResponse(f"GET answered {type(reply).__name__}")
        return reply

    async def mget(self, names: Sequence[bytes | str]) -> list[memoryview | None]:
        """The values of `names` (as `get` gives them), None for each that does not exist."""
        if not names:
            return []
        reply = await self._call(encode_command(b"MGET", *names))
        if not isinstance(reply, list) or len(reply) != len(names):
            raise rex.InvalidResponse(f"MGET of {len(names)} keys answered {type(reply).__name__}")
        return reply

    async def aclose(self) -> None:
        """Close the idle connections; one in use closes when its call ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for proto in idle:
            if proto.transport is not None:
                proto.transport.close()

    async def _call(self, command: bytes) -> Any:
        """Run `command` on an idle connection, else a new one. A reused connection that turns
        out closed (Redis restarted while it sat idle) is dropped and the command sent once more
        on a new one: GET and MGET change nothing, so a second try is safe."""
        if self._closed:
            raise rex.ConnectionError("the redis bulk reader is closed")
        async with self._slots:
            proto = self._take_idle()
            if proto is not None:
                try:
                    return await self._call_on(proto, command)
                except rex.ConnectionError:
                    logger.debug("redis bulk reader: an idle connection was closed; reconnecting")
            return await self._call_on(await self._connect(), command)

    def _take_idle(self) -> BulkProtocol | None:
        while self._idle:
            proto = self._idle.pop()
            if proto.lost is None and proto.transport is not None and not proto.transport.is_closing():
                return proto
        return None

    async def _call_on(self, proto: BulkProtocol, command: bytes) -> Any:
        try:
            result = await proto.call(command, self._timeout_s)
        except rex.ResponseError:
            self._keep(proto)  # an error reply, read whole: the connection is fine
            raise
        self._keep(proto)  # only a connection whose reply was read whole comes back
        return result

    def _keep(self, proto: BulkProtocol) -> None:
        if self._closed and proto.transport is not None:
            proto.transport.close()
        else:
            self._idle.append(proto)

    async def _connect(self) -> BulkProtocol:
        loop = asyncio.get_running_loop()
        try:
            if self._path:
                connecting = loop.create_unix_connection(BulkProtocol, self._path)
            else:
                connecting = loop.create_connection(BulkProtocol, self._host, self._port)
            _, proto = await asyncio.wait_for(connecting, self._timeout_s)
        except asyncio.TimeoutError:
            raise rex.TimeoutError(f"connecting to redis took over {self._timeout_s} s") from None
        except OSError as exc:
            raise rex.ConnectionError(f"cannot connect to redis: {exc}") from exc
        try:
            if self._password is not None:
                auth = (b"AUTH", self._username, self._password) if self._username else (b"AUTH", self._password)
                try:
                    await proto.call(encode_command(*auth), self._timeout_s)
                except rex.ResponseError as exc:  # as redis-py says it: a connection failure (an outage)
                    raise rex.AuthenticationError(str(exc)) from None
            if self._db:
                await proto.call(encode_command(b"SELECT", str(self._db)), self._timeout_s)
            try:  # for operators (CLIENT LIST); a proxy without CLIENT SETNAME serves reads all the same
                await proto.call(encode_command(b"CLIENT", b"SETNAME", CLIENT_NAME), self._timeout_s)
            except rex.ResponseError:
                pass
        except BaseException:
            if proto.transport is not None:
                proto.transport.abort()
            raise
        return proto
