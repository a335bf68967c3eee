"""A viewer visits every route of the console, on a real SQLite file and a real PostgreSQL store.

The routes are read from the application itself (`app.routes`), not listed here: a route added
later is called too, and one this test does not know how to call fails it rather than being
skipped. Every answer must keep the default masking rules' secrets hidden, every write must be
refused, and the store (every row, byte and audit entry) must be as it was.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient
from starlette.routing import Mount

from outbox.records import NewMessage, OutboxMessage, Status
from outbox.stores.base import Outbox
from outbox.ui import create_app

from .durable_stores import durable_store

VIEWER, OPERATOR, ADMIN = "viewer-crawl-0123456789", "operator-crawl-0123456789", "admin-crawl-0123456789"
PASSWORD = "crawl-Pa55word-77"
BEARER_SECRET = "eyJcrawl.bearer-secret-part"
CARD = "5500 0000 0000 0004"
TOKEN = "tok-crawl-5ecret-91"
SECRETS = (PASSWORD, BEARER_SECRET, CARD, CARD.replace(" ", ""), TOKEN)
MARKERS = ("marker-dead-json", "marker-dead-text", "marker-pending")
READS = {"GET", "HEAD"}
WRITES = {"POST", "PUT", "PATCH", "DELETE"}


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Outbox]:
    yield from durable_store(request, tmp_path, "crawl")


def fill(store: Outbox) -> tuple[list[int], list[int]]:
    """Dead letters and pending messages whose values, headers and errors hold secrets."""
    value = json.dumps({"marker": MARKERS[0], "user": {"name": "Ann", "password": PASSWORD}}).encode()
    dead = store.add_dead([
        NewMessage("orders", value, key=b"customer-7", msg_id="crawl-dead-1",
                   headers=[("authorization", f"Bearer {BEARER_SECRET}".encode()), ("trace", b"t-1")], attempts=2,
                   error_name="builtins.ValueError", last_error=f"builtins.ValueError (consumer): card {CARD}"),
        NewMessage("orders", f"{MARKERS[1]} card={CARD} token={TOKEN}".encode(), key=b"customer-7",
                   msg_id="crawl-dead-2", attempts=1, error_code=10, error_name="MSG_SIZE_TOO_LARGE",
                   last_error="MSG_SIZE_TOO_LARGE (10): too big"),
    ], failed_at=time.time())
    pending = store.enqueue([
        NewMessage("orders", f"{MARKERS[2]} password={PASSWORD}".encode(), key=b"customer-7",
                   msg_id="crawl-pending-1", headers=[("authorization", f"Bearer {BEARER_SECRET}".encode())]),
    ])
    return dead, list(pending)


def state(store: Outbox) -> tuple[list[OutboxMessage], list[Any], dict[str, Any]]:
    """Every row (value, headers, every column), the audit log, and the counts."""
    rows = store.messages()
    counts = {s.name.lower(): sum(r.status is s for r in rows) for s in (Status.PENDING, Status.DEAD)}
    return rows, store.audit_log(limit=1000), counts


def routes(app: FastAPI) -> list[tuple[str, str]]:
    """Every (method, path) the application serves, read from `app.routes`."""
    out: set[tuple[str, str]] = set()
    for ctx in iter_route_contexts(app.routes):
        route = ctx.original_route
        if isinstance(route, Mount):  # the static files: read-only by construction
            out |= {("GET", route.path + "/{path}"), ("HEAD", route.path + "/{path}")}
            continue
        assert ctx.path is not None and ctx.methods, f"a route this test cannot read: {route!r}"
        out |= {(m, ctx.path) for m in ctx.methods}
    return sorted(out)


def urls(path: str, dead: list[int], pending: list[int]) -> list[str]:
    """`path` with its parameters filled by real ids (every row's), and the reads' queries."""
    fills: dict[str, list[str]] = {
        "{row_id}": [str(i) for i in dead + pending],
        "{msg_id}": ["crawl-dead-1", "crawl-dead-2", "crawl-pending-1"],
        "{job_id}": ["1"],  # a viewer can start no job: the page of one that does not exist
        "{path}": ["console.css"],
    }
    found = re.findall(r"\{[^}]+\}", path)
    for name in found:
        if name not in fills:
            pytest.fail(f"{path}: the crawl does not know how to fill {name}")
    out = [path]
    for name in found:
        out = [u.replace(name, v) for u in out for v in fills[name]]
    queries = {"/trace": "?msg_id=crawl-dead-1", "/login": f"?token={VIEWER}",
               "/api/dead-letters": "?text=card", "/dead-letters": "?key=customer-7"}
    return out + [u + queries[path] for u in out if path in queries]


def json_body(path: str, row: int) -> dict[str, Any]:
    """A plausible body for each API write: what an operator or admin would send."""
    bodies: dict[str, dict[str, Any]] = {
        "/api/redrive": {"ids": [row]},
        "/api/purge": {"confirm": True},
        "/api/erase": {"key": "customer-7", "confirm": True},
        "/api/dead-letters/{row_id}/redrive": {"value": "x", "headers": []},
        "/api/dead-letters/{row_id}/reveal": {},
        "/api/redrive-topic": {"dlq_topic": "orders.billing.dlq"},
    }
    if path not in bodies:
        pytest.fail(f"{path}: the crawl does not know how to call this API write")
    return bodies[path]


def form_body(path: str, csrf: str, row: int) -> dict[str, Any]:
    """A plausible form for each page write, with the CSRF field."""
    forms: dict[str, dict[str, Any]] = {
        "/actions": {"action": "purge", "scope": "filter", "ids": [str(row)]},
        "/actions/confirm": {"do": "purge:filter", "action": "purge", "scope": "filter"},
        "/dead-letters/{row_id}/redrive": {"value": "x", "value_encoding": "utf-8", "headers": ""},
        "/dead-letters/{row_id}/reveal": {},
    }
    if path not in forms:
        pytest.fail(f"{path}: the crawl does not know how to call this page form")
    return {"csrf": csrf, **forms[path]}


def assert_masked(r: httpx.Response) -> None:
    leaked = [s for s in SECRETS if s in r.text]
    assert not leaked, (r.request.method, str(r.request.url), leaked)


def test_a_viewer_visits_every_route_sees_no_secret_and_changes_nothing(store: Outbox) -> None:
    dead, pending = fill(store)
    app = create_app(store, token=ADMIN, tokens={VIEWER: "viewer", OPERATOR: "operator"}, loopback=False)
    c = TestClient(app, base_url="http://localhost", headers={"Authorization": f"Bearer {VIEWER}"})
    before = state(store)
    assert before[2] == {"pending": 1, "dead": 2} and before[1] == []
    page = c.get("/dead-letters")
    assert page.status_code == 200 and MARKERS[0] in page.text  # the rows are there, and shown
    csrf = c.cookies.get("outbox_csrf")
    assert csrf, page.headers
    seen: set[str] = set()
    found = routes(app)
    writes = [(m, p) for m, p in found if m in WRITES]
    assert len(found) > 20 and len(writes) >= 10, found
    for method, path in found:
        if method not in READS | WRITES:
            pytest.fail(f"{method} {path}: the crawl does not know how to call this method")
        for url in urls(path, dead, pending):
            if method in READS:
                r = c.request(method, url, follow_redirects=False)
                assert r.status_code in (200, 303, 401, 404), (method, url, r.status_code, r.text[:300])
                seen |= {m for m in MARKERS if m in r.text}
            elif path.startswith("/api/"):
                r = c.request(method, url, json=json_body(path, dead[0]), follow_redirects=False)
                assert r.status_code == 403 and "viewer role" in r.json()["error"], (method, url, r.text)
            else:
                r = c.request(method, url, data=form_body(path, csrf, dead[0]), follow_redirects=False)
                assert r.status_code == 403 and "viewer role" in r.text, (method, url, r.status_code)
            assert_masked(r)
    # The methods a path does not declare: a write is refused (405), never a success.
    for path in sorted({p for _m, p in found}):
        declared = {m for m, p in found if p == path}
        for method in sorted(READS | WRITES - declared):
            if method in declared:
                continue
            for url in urls(path, dead, pending)[:1]:
                r = c.request(method, url, json={}, follow_redirects=False)
                allowed = (401, 403, 405) if method in WRITES else (200, 303, 401, 404, 405)
                assert r.status_code in allowed, (method, url, r.status_code)
                assert_masked(r)
    assert seen == set(MARKERS)  # every message was shown, masked
    assert state(store) == before  # every row, byte, count and audit entry as it was
