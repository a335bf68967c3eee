"""The middleware that applies `outbox.ui.security`'s rules to every request, before any route.

In order: the host check, who asks (the token or the role header, `outbox.ui.roles.resolve`:
kept on `request.state.identity` for the routes), JSON-only API writes; then the per-browser
CSRF token, kept on `request.state.csrf` for the forms and set as a cookie the first time a page
is shown; and the security headers on every answer. What each role may do, the routes say.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from outbox.ui import security
from outbox.ui.console import console_of
from outbox.ui.errors import refuse
from outbox.ui.roles import Refused, resolve


async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    console = console_of(request)
    api = request.url.path.startswith("/api/")
    if console.loopback and not security.is_loopback(request.url.hostname or ""):
        return refuse(console, api, 400, "this console answers requests addressed to localhost only")
    if request.url.path != "/login":  # which checks the token it is given itself
        given = security.bearer(request.headers.get("authorization")) or request.cookies.get(security.TOKEN_COOKIE)
        header = request.headers.get(console.access.role_header) if console.access.role_header else None
        try:
            request.state.identity = resolve(console.access, token=given, header=header)
        except Refused as exc:
            return refuse(console, api, exc.status, exc.message)
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
