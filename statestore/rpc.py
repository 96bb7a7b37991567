"""How a call becomes a status: the service's error types, their status codes (DESIGN.md §6),
and the wrappers every handler of both servicers goes through.

Handlers raise; `unary`/`streaming` resolve the caller's tenant from its bearer token, map what
was raised to a status with a useful message and count the call (`status_for`)::

    ValueError / RecordError / BadField    INVALID_ARGUMENT   (the message names the field)
    NotFound, SessionNotFound              NOT_FOUND
    SessionExists                          ALREADY_EXISTS
    ModelMismatch, Precondition,
    CheckpointIncomplete,
    DurabilityUnavailable (tier absent)    FAILED_PRECONDITION
    BudgetExceeded, QuotaExceeded,
    Exhausted                              RESOURCE_EXHAUSTED (the message gives the budget or quota)
    AuthError, Denied                      PERMISSION_DENIED
    DurabilityUnavailable (tier down)      UNAVAILABLE        (the service itself cannot serve it)
    anything else                          INTERNAL, logged with the traceback; the server keeps serving
 `add_servicer` registers a servicer as the
generated code would, except that a request whose bytes do not parse reaches the handler as
`Undecodable` (INVALID_ARGUMENT, not grpc's UNKNOWN), and the record data path moves bytes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from proto.statestore.v1 import common_pb2
from statestore import sessions as ss
from statestore.auth import AuthError, TokenAuth
from statestore.metrics import ServiceMetrics
from statestore.quotas import QuotaExceeded
from statestore.store import BudgetExceeded, DurabilityUnavailable

logger = logging.getLogger(__name__)

_MAX_DETAILS = 2048  # error messages echo client input; clients refuse metadata over 16 KiB by default
T = TypeVar("T")


class BadField(ValueError):
    """INVALID_ARGUMENT naming the request field."""


class NotFound(LookupError):
    """NOT_FOUND."""


class Precondition(Exception):
    """FAILED_PRECONDITION."""


class Denied(Exception):
    """PERMISSION_DENIED."""


class Exhausted(Exception):
    """RESOURCE_EXHAUSTED for a server-side limit that is not a store budget or a quota."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a failure maps to (None: unexpected, i.e. INTERNAL)."""
    table: list[tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode]] = [
        ((AuthError, Denied), grpc.StatusCode.PERMISSION_DENIED),
        ((NotFound, ss.SessionNotFound), grpc.StatusCode.NOT_FOUND),
        (ss.SessionExists, grpc.StatusCode.ALREADY_EXISTS),
        ((ss.ModelMismatch, ss.CheckpointIncomplete, Precondition), grpc.StatusCode.FAILED_PRECONDITION),
        ((BudgetExceeded, QuotaExceeded, Exhausted), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # RecordError and BadField included
    ]
    if isinstance(exc, DurabilityUnavailable):
        code = grpc.StatusCode.FAILED_PRECONDITION if exc.tier is None else grpc.StatusCode.UNAVAILABLE
        return code, str(exc)
    for types, code in table:
        if isinstance(exc, types):
            return code, str(exc)
    return None


class Undecodable:
    """A request whose bytes do not parse as its message type. The deserializer returns it
    instead of raising (grpc would answer UNKNOWN); the handler answers INVALID_ARGUMENT."""

    __slots__ = ("type_name", "error")

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name, self.error = type_name, error

    def check(self) -> None:
        raise BadField(f"the request is not a valid {self.type_name} message ({self.error})")


def lenient_deserializer(message_class: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Undecodable(message_class.DESCRIPTOR.full_name, str(exc))

    return deserialize


class Calls:
    """Tenant resolution, error mapping and per-call metrics shared by both servicers."""

    def __init__(self, auth: TokenAuth, metrics: ServiceMetrics) -> None:
        self.auth = auth
        self.metrics = metrics

    def tenant(self, context: grpc.aio.ServicerContext) -> str:
        return self.auth.tenant_for(context.invocation_metadata())

    async def fail(self, method: str, exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        mapped = status_for(exc)
        if mapped is None:
            logger.error("%s failed unexpectedly", method, exc_info=exc)
            mapped = (grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}; see the server log")
        self.metrics.calls.labels(method, mapped[0].name).inc()
        await context.abort(mapped[0], clip(mapped[1]))


def clip(message: str) -> str:
    """An error message short enough for the status trailer: a message that echoes a 100 KB
    session id would exceed the client's metadata limit, which then reports its own
    RESOURCE_EXHAUSTED and drops the connection instead of showing the real status."""
    if len(message) <= _MAX_DETAILS:
        return message
    return f"{message[:_MAX_DETAILS]}... ({len(message) - _MAX_DETAILS} more characters)"


def unary(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Wrap `fn(self, request, context, tenant)` as a unary (or client-streaming) handler."""
    method = fn.__name__

    @functools.wraps(fn)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        started = time.perf_counter()
        try:
            tenant = self._calls.tenant(context)
            if isinstance(request, Undecodable):
                request.check()
            result = await fn(self, request, context, tenant)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the service boundary: map, never crash
            await self._calls.fail(method, exc, context)
            raise AssertionError("unreachable: abort raises") from exc
        finally:
            self._calls.metrics.took(method, time.perf_counter() - started)
        self._calls.metrics.calls.labels(method, "OK").inc()
        return result

    return handler


def streaming(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Wrap an async-generator handler `fn(self, request, context, tenant)`."""
    method = fn.__name__

    @functools.wraps(fn)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        started = time.perf_counter()
        try:
            tenant = self._calls.tenant(context)
            if isinstance(request, Undecodable):
                request.check()
            async for item in fn(self, request, context, tenant):
                yield item
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the service boundary
            await self._calls.fail(method, exc, context)
            return
        finally:
            self._calls.metrics.took(method, time.perf_counter() - started)
        self._calls.metrics.calls.labels(method, "OK").inc()

    return handler


def serialize_chunk(message: bytes | common_pb2.RecordChunk) -> bytes:
    """RecordChunk serializer that passes frames already serialized by `statestore.wire` through."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_servicer(servicer: Any, server: grpc.aio.Server, service: Any) -> None:
    """Register `servicer`'s methods of `service` (a descriptor) as the generated code does, with
    requests that fail to parse passed to the handler as `Undecodable` (INVALID_ARGUMENT)."""
    handlers = {}
    for method in service.methods:
        deserialize = None if method.name == "PutRecords" else lenient_deserializer(GetMessageClass(method.input_type))
        serialize = serialize_chunk if method.name == "GetRecords" else \
            GetMessageClass(method.output_type).SerializeToString
        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[method.client_streaming, method.server_streaming]
        handlers[method.name] = kind(getattr(servicer, method.name), request_deserializer=deserialize,
                                     response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
