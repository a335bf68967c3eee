"""`outbox ui`: the dead-letter console, server-rendered pages and a JSON API over one store.

Every operation goes through the store's own methods (`list_dead`, `count_dead`, `purge_dead`,
`replay_dead`, `redrive_edited`, `trace`, `stats`, the audit log): the console holds no SQL.
The pages are plain HTML forms rendered by Jinja2 with autoescaping, and no script at all, so a
value holding `<script>` is text. See `outbox.ui.security` for the token, host and CSRF rules.

`create_app` only assembles the parts, each a module of its own:

* `console`: what they share (the store, the settings, the templates, the redrive jobs);
* `guard`: the middleware that applies the security rules to every request;
* `errors`: how a refusal or a failure is answered (JSON under /api/, an error page elsewhere);
* `api` and `pages`: the routes, on the shared operations of `operations` and the request
  readers of `inputs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from outbox.stores import Outbox
from outbox.ui import api, errors, pages, security
from outbox.ui.console import Console, templates
from outbox.ui.guard import guard
from outbox.ui.inputs import DEFAULT_RATE
from outbox.ui.jobs import Jobs


def create_app(
    store: Outbox,
    *,
    token: str | None = None,
    loopback: bool = True,
    location: str | None = None,
    default_rate: float = DEFAULT_RATE,
    kafka: Mapping[str, Any] | None = None,
) -> FastAPI:
    """The console's ASGI application over `store` (serve it with uvicorn).

    Args:
        store: the outbox store (its dead letters, producer's and consumers').
        token: required on every request when given (see `outbox.ui.security`).
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
        store=store, token=token, loopback=loopback, location=location or store.location,
        default_rate=default_rate, kafka=kafka, actor=security.who(token), templates=templates(), jobs=Jobs(store),
    )
    app.mount("/static", StaticFiles(packages=[("outbox.ui", "static")]), name="static")
    app.middleware("http")(guard)
    errors.add_handlers(app)
    app.include_router(api.router)
    app.include_router(pages.router)
    return app
