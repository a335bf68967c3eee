"""What every part of the console shares: the store, the settings it was started with, the
templates and the redrive jobs, in one `Console` kept on the application (`app.state.console`).

Routes take it as a dependency (`ConsoleDep`), and who asks as another (`IdentityDep`, resolved
by the middleware); the middleware and the exception handlers, which FastAPI does not inject
into, read the console with `console_of(request)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import Depends, Request
from jinja2 import Environment, PackageLoader, select_autoescape

from outbox.stores import Outbox
from outbox.ui import present
from outbox.ui.jobs import Jobs
from outbox.ui.masking import Masker
from outbox.ui.roles import Access, Identity, identity_of


@dataclass(frozen=True)
class Console:
    """One console: its store and how it was started (see `create_app` for each setting)."""

    store: Outbox
    #: The tokens and the role header that say who asks (`outbox.ui.roles`).
    access: Access
    loopback: bool
    #: Where the store lives, as the pages show it (never with a password).
    location: str
    default_rate: float
    kafka: Mapping[str, Any] | None
    #: What the pages and the API mask of every message (`outbox.ui.masking`).
    masker: Masker
    templates: Environment
    jobs: Jobs


def templates() -> Environment:
    """The pages' Jinja2 templates, autoescaped: a stored value holding `<script>` is text."""
    env = Environment(loader=PackageLoader("outbox.ui", "templates"), autoescape=select_autoescape(default=True))
    env.filters["qs"] = lambda d: urlencode(d, doseq=True)
    env.filters["one_line"] = present.one_line
    return env


def console_of(request: Request) -> Console:
    """The console that serves `request`."""
    console: Console = request.app.state.console
    return console


# async, so that FastAPI calls it on the event loop rather than in its thread pool.
async def _console(request: Request) -> Console:
    return console_of(request)


#: A route's parameter `console: ConsoleDep` receives the `Console`.
ConsoleDep = Annotated[Console, Depends(_console)]


async def _identity(request: Request) -> Identity:
    return identity_of(request)


#: A route's parameter `me: IdentityDep` receives who asks (their role, and their audit name).
IdentityDep = Annotated[Identity, Depends(_identity)]
