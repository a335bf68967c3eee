"""Who is asking, and what they may do: the console's three roles.

* **viewer**: reads everything, masked (`outbox.ui.masking`); changes nothing.
* **operator**: also redrives (a filter, a selection, an edited message, a DLQ topic), purges
  and erases.
* **admin**: also reveals a message unmasked; each reveal is written to the audit log.

A request's role comes from the token it carries (each role has its own; the single token of
`--token` is admin's), or, when the console is started with a role header, from that header,
which a reverse proxy in front sets after its own sign-in. Without any token or role header the
console serves its own host only (loopback) and everyone is admin, as before roles existed.

`resolve` decides, given the request's token and header; it is pure. `need` is the routes'
dependency: a request whose role is below the route's gets a 403 naming the role needed, before
the route reads its body or changes anything.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from fastapi import Request

from outbox.ui import security


class Role(enum.IntEnum):
    """The roles, each allowed what the ones below it are."""

    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Role | None:
        """A role by its name (`viewer`, `operator`, `admin`, without regard to case); None if none."""
        return cls.__members__.get(text.strip().upper())


@dataclass(frozen=True)
class Identity:
    """Who asks: a role, and how the audit log names them (never a token)."""

    role: Role
    who: str

    def may(self, role: Role) -> bool:
        return self.role >= role


@dataclass(frozen=True)
class Access:
    """How a console knows who asks.

    Attributes:
        tokens: each accepted token and its role.
        role_header: the request header a trusted reverse proxy sets to the role (None: ignored).
    """

    tokens: Mapping[str, Role] = field(default_factory=dict)
    role_header: str | None = None

    @property
    def open(self) -> bool:
        """No token and no role header: everyone who reaches the console is admin."""
        return not self.tokens and self.role_header is None


class Refused(Exception):
    """A request without an identity (401), or with one that may not do what it asks (403)."""

    def __init__(self, status: int, message: str, needs: Role | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.needs = needs


#: The one identity of a console without tokens or role header.
LOCAL = Identity(Role.ADMIN, "local")

_TOKEN_REQUIRED = (
    "a token is required: send 'Authorization: Bearer <token>', or open /login?token=<token> once in the browser"
)


def resolve(access: Access, *, token: str | None, header: str | None) -> Identity:
    """The identity of a request carrying `token` (bearer or cookie) and `header` (the role
    header's value, when the console reads one).

    The role header, when enabled and present, decides: the proxy in front signed the person in.
    Otherwise a token must match one of `access.tokens` (compared in constant time); a console
    with neither is `LOCAL`.

    Raises:
        Refused: 401 without an accepted token or header; 403 for a header naming no role.
    """
    if access.open:
        return LOCAL
    if access.role_header is not None and header is not None:
        role = Role.parse(header)
        if role is None:
            raise Refused(403, f"the {access.role_header} header names no role: it must be viewer, operator or admin")
        return Identity(role, f"proxy:{role.label}")
    matched = [(t, r) for t, r in access.tokens.items() if security.token_matches(t, token)]
    if matched:
        known, role = matched[0]
        return Identity(role, security.who(known))
    if not access.tokens:
        raise Refused(401, f"the {access.role_header} header is required (set by the reverse proxy in front)")
    raise Refused(401, _TOKEN_REQUIRED)


def identity_of(request: Request) -> Identity:
    """The identity the middleware resolved for `request`."""
    identity: Identity = request.state.identity
    return identity


def forbidden(identity: Identity, needs: Role, what: str) -> Refused:
    """The 403 for `identity` asking to do `what`, which needs the role `needs`."""
    return Refused(403, f"{what} needs the {needs.label} role (this request has the {identity.role.label} role)",
                   needs)


def need(role: Role, what: str) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: the request's role must be at least `role` to do `what`."""

    async def check(request: Request) -> None:
        identity = identity_of(request)
        if not identity.may(role):
            raise forbidden(identity, role, what)

    return check
