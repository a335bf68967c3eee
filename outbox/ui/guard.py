"""The middleware that applies `outbox.ui.security`'s rules to every request, before any route.

In order: the host check, the token, JSON-only API writes; then the per-browser CSRF token,
kept on `request.state.csrf` for the forms and set as a cookie the first time a page is shown;
and the security headers on every answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from outbox.ui import security
from outbox.ui.console import console_of
from outbox.ui.errors import refuse

_TOKEN_REQUIRED = (
    "a token is required: send 'Authorization: Bearer <token>', or open /login?token=<token> once in the browser"
)


async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    console = console_of(request)
    api = request.url.path.startswith("/api/")
    if console.loopback and not security.is_loopback(request.url.hostname or ""):
        return refuse(console, api, 400, "this console answers requests addressed to localhost only")
    if console.token is not None and request.url.path != "/login":
        given = security.bearer(request.headers.get("authorization")) or request.cookies.get(security.TOKEN_COOKIE)
        if not security.token_matches(console.token, given):
            return refuse(console, api, 401, _TOKEN_REQUIRED)
    if api and request.method not in ("GET", "HEAD", "OPTIONS"):
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return refuse(console, True, 415, "API writes must be sent as Content-Type: application/json")
    csrf = request.cookies.get(security.CSRF_COOKIE)
    fresh = not csrf
    request.state.csrf = csrf or security.new_csrf()
    response = await call_next(request)
    for name, value in security.SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    if fresh and not api:
        response.set_cookie(security.CSRF_COOKIE, request.state.csrf, httponly=True, samesite="strict")
    return response
