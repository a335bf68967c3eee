"""`outbox ui`: the dead-letter console, server-rendered pages and a JSON API over one store.

Every operation goes through the store's own methods (`list_dead`, `count_dead`, `purge_dead`,
`replay_dead`, `redrive_edited`, `trace`, `stats`, the audit log): the console holds no SQL.
The pages are plain HTML forms rendered by Jinja2 with autoescaping, and no script at all, so a
value holding `<script>` is text. See `outbox.ui.security` for the token, host and CSRF rules,
`outbox.ui.roles` for the roles, and `outbox.ui.masking` for what every page and answer masks.

`create_app` only assembles the parts, each a module of its own:

* `console`: what they share (the store, the settings, the templates, the redrive jobs);
* `guard`: the middleware that applies the security rules to every request, and says who asks;
* `roles`: the roles (viewer, operator, admin) and what each may do;
* `errors`: how a refusal or a failure is answered (JSON under /api/, an error page elsewhere);
* `api` and `pages`: the routes, on the shared operations of `operations` and the request
  readers of `inputs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from outbox.errors import ConfigError
from outbox.stores import Outbox
from outbox.ui import api, errors, pages
from outbox.ui.console import Console, templates
from outbox.ui.guard import guard
from outbox.ui.inputs import DEFAULT_RATE
from outbox.ui.jobs import Jobs
from outbox.ui.masking import Masker, MaskRules
from outbox.ui.roles import Access, Role


def create_app(
    store: Outbox,
    *,
    token: str | None = None,
    tokens: Mapping[str, str | Role] | None = None,
    role_header: str | None = None,
    masking: MaskRules | None = None,
    loopback: bool = True,
    location: str | None = None,
    default_rate: float = DEFAULT_RATE,
    kafka: Mapping[str, Any] | None = None,
) -> FastAPI:
    """The console's ASGI application over `store` (serve it with uvicorn).

    Args:
        store: the outbox store (its dead letters, producer's and consumers').
        token: the admin's token: with it (or `tokens`), every request must carry an accepted
            token (see `outbox.ui.security`).
        tokens: more tokens, each with its role: "viewer", "operator" or "admin"
            (`outbox.ui.roles`).
        role_header: a request header that names the request's role (viewer, operator, admin),
            set by a reverse proxy after its own sign-in. Only safe when every request passes
            that proxy and it replaces the header a client sends. None: ignored.
        masking: what the pages and the API mask (`outbox.ui.masking`); None: the default rules.
            An admin may reveal one message, which the audit log records.
        loopback: the server is bound to a loopback address: requests must name a loopback host.
        location: where the store lives, as shown on the pages (never with a password; default
            `store.location`, which has none).
        default_rate: redrive messages/s when a request names none.
        kafka: client settings (`bootstrap.servers`, security) for what needs the cluster: the
            redrive of a consumer's DLQ *topic* (POST /api/redrive-topic). None: not offered.
    """
    app = FastAPI(
        title="kafka-outbox console",
        description="Dead letters of a kafka-outbox store: list, search, redrive, purge, trace.",
        version="1",
        # Swagger UI and ReDoc load their scripts from a CDN: not here (no CDN, no script). The
        # schema itself is served, for any OpenAPI viewer or client generator.
        docs_url=None,
        redoc_url=None,
        openapi_url="/api/openapi.json",
    )
    app.state.console = Console(
        store=store, access=access(token, tokens, role_header), loopback=loopback,
        location=location or store.location, default_rate=default_rate, kafka=kafka, masker=Masker(masking),
        templates=templates(), jobs=Jobs(store),
    )
    app.mount("/static", StaticFiles(packages=[("outbox.ui", "static")]), name="static")
    app.middleware("http")(guard)
    errors.add_handlers(app)
    app.include_router(api.router)
    app.include_router(pages.router)
    return app


def access(token: str | None, tokens: Mapping[str, str | Role] | None, role_header: str | None) -> Access:
    """The tokens by role (`token` is admin's) and the role header.

    Raises:
        ConfigError: an unknown role, a token given two roles, an empty token or header name.
    """
    roles: dict[str, Role] = {}
    named = [(token, Role.ADMIN)] if token is not None else []
    for given, role in [*named, *(tokens or {}).items()]:
        parsed = role if isinstance(role, Role) else Role.parse(role)
        if parsed is None:
            raise ConfigError(f"tokens: {role!r} is not a role (viewer, operator or admin)")
        if not given:
            raise ConfigError(f"tokens: the {parsed.label} token is empty")
        if roles.get(given, parsed) is not parsed:
            raise ConfigError(f"tokens: one token is given two roles ({roles[given].label} and {parsed.label})")
        roles[given] = parsed
    if role_header is not None and not role_header.strip():
        raise ConfigError("role_header: must name a header, e.g. X-Outbox-Role")
    return Access(tokens=roles, role_header=role_header.strip() if role_header else None)
