"""Who may use the console, and how its writes are protected.

* **Token.** Bound to a loopback address the console needs none (only this host reaches it).
  Bound elsewhere it refuses to start without one, and then every request must carry it: the
  API as `Authorization: Bearer <token>`, a browser as a cookie set by opening
  `/login?token=<token>` once (HttpOnly, SameSite=Strict). The token is compared in constant
  time; who acted is recorded as `token:<first 8 hex of its SHA-256>`, never the token itself.
* **Host check.** A loopback console answers only requests addressed to a loopback name, so a
  web page cannot reach it through DNS rebinding (a hostile name resolved to 127.0.0.1).
* **CSRF.** Page forms carry a per-browser random token that must equal the `outbox_csrf` cookie
  (double submit: another site can make a browser post a form, but cannot read or set our
  cookie). API writes must be `Content-Type: application/json`: a cross-site page can send only
  form or plain-text bodies without a CORS pre-flight, and the console answers no pre-flight, so
  a JSON request comes from our own origin or from a program, never from a forged form.
* **Headers.** A strict Content-Security-Policy (no script at all: the console has none), no
  framing, no referrer (a `?token=` URL never leaks through a link).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

TOKEN_COOKIE = "outbox_ui_token"
CSRF_COOKIE = "outbox_csrf"
CSRF_FIELD = "csrf"

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

def is_loopback(host: str) -> bool:
    """Whether binding `host` exposes the console to this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def who(token: str | None) -> str:
    """How the audit log names whoever holds `token` ("local" without one)."""
    if not token:
        return "local"
    return "token:" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:8]


def token_matches(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8"))


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def new_csrf() -> str:
    return secrets.token_urlsafe(32)


def csrf_ok(cookie: str | None, field: object) -> bool:
    if not cookie or not isinstance(field, str):
        return False
    return hmac.compare_digest(cookie.encode(), field.encode())
