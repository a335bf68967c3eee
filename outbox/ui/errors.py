"""How the console says no: a JSON `{"error": ...}` under /api/, an HTML error page elsewhere.

Every refusal, whether raised by a route (`ConsoleError`, a `FilterError`, a store or Kafka
failure) or decided by the middleware before any route runs (`refuse`), has the same shape and
carries the security headers itself: a 500 is answered outside the middleware that adds them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from outbox.errors import ConfigError, KafkaDeliveryError, KafkaUnavailableError, StoreError, UnknownMessageError
from outbox.ui import security
from outbox.ui.console import Console, console_of
from outbox.ui.filters import FilterError
from outbox.ui.roles import Refused, Role

# The name the console has always logged under: a logging configuration may select it by name.
log = logging.getLogger("outbox.ui.app")


class ConsoleError(Exception):
    """A request the console refuses, with its HTTP status and a message for people."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def refuse(console: Console, api: bool, status: int, message: str, needs: Role | None = None) -> Response:
    """The answer to a refused request: JSON for the API, the error page for a browser. A 403
    for want of a role names it (`needs`, in the JSON too)."""
    if api:
        body = {"error": message} if needs is None else {"error": message, "needs": needs.label}
        response: Response = JSONResponse(body, status_code=status)
    else:
        html = console.templates.get_template("error.html").render(
            status=status, message=message, location=console.location
        )
        response = HTMLResponse(html, status_code=status)
    for name, value in security.SECURITY_HEADERS.items():
        response.headers[name] = value
    return response


def _error(request: Request, status: int, message: str) -> Response:
    return refuse(console_of(request), request.url.path.startswith("/api/"), status, message)


async def on_console_error(request: Request, exc: ConsoleError) -> Response:
    return _error(request, exc.status, exc.message)


async def on_refused(request: Request, exc: Refused) -> Response:
    return refuse(console_of(request), request.url.path.startswith("/api/"), exc.status, exc.message, exc.needs)


async def on_filter_error(request: Request, exc: FilterError) -> Response:
    return _error(request, 400, str(exc))


async def on_unknown(request: Request, exc: UnknownMessageError) -> Response:
    return _error(request, 404, str(exc))


async def on_store_error(request: Request, exc: StoreError) -> Response:
    # Store errors name the store by location (host/database or file), never its password.
    return _error(request, 503, f"the outbox store failed: {exc}")


async def on_config_error(request: Request, exc: ConfigError) -> Response:
    return _error(request, 400, str(exc))  # e.g. a DLQ topic that does not exist


async def on_kafka_down(request: Request, exc: KafkaUnavailableError) -> Response:
    return _error(request, 503, f"Kafka: {exc}")


async def on_kafka_failed(request: Request, exc: KafkaDeliveryError) -> Response:
    return _error(request, 502, f"Kafka: {exc}")


async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    return _error(request, exc.status_code, str(exc.detail))


async def on_bug(request: Request, exc: Exception) -> Response:
    # A bug: logged by the server with its traceback, never shown to the client.
    log.exception("console: %s %s failed", request.method, request.url.path)
    return _error(request, 500, f"internal error ({type(exc).__name__}); see the console's log")


#: Each failure a route may raise, and what answers it.
HANDLERS: tuple[tuple[type[Exception], Callable[..., Awaitable[Response]]], ...] = (
    (ConsoleError, on_console_error),
    (Refused, on_refused),
    (FilterError, on_filter_error),
    (UnknownMessageError, on_unknown),
    (StoreError, on_store_error),
    (ConfigError, on_config_error),
    (KafkaUnavailableError, on_kafka_down),
    (KafkaDeliveryError, on_kafka_failed),
    (StarletteHTTPException, on_http_error),
    (Exception, on_bug),
)


def add_handlers(app: FastAPI) -> None:
    """Answer each kind of failure with its status and message, in the console's own shape."""
    for exc_class, handler in HANDLERS:
        app.exception_handler(exc_class)(handler)
