"""The console's roles and masks, through its JSON API and pages (httpx, Starlette's TestClient),
on a real SQLite file and a real PostgreSQL store: a viewer sees masks and changes nothing, an
operator redrives and purges but sees no unmasked value, an admin's reveal is in the audit log,
an edit never stores a mask, and a proxy's role header is honoured only when enabled."""

from __future__ import annotations

import html
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from outbox.records import NewMessage, OutboxMessage, Status
from outbox.stores.base import Outbox
from outbox.ui import api, create_app, pages, security
from outbox.ui.masking import MASK, MaskRules

from .durable_stores import durable_store

VIEWER, OPERATOR, ADMIN = "viewer-token-0123456789", "operator-token-0123456789", "admin-token-0123456789"
CARD = "4111 1111 1111 1111"
PASSWORD = "hunter2-Pa55"
BEARER = "Bearer eyJhbGciOi.secret-part"
SECRETS = (CARD, PASSWORD, "secret-part", "4111111111111111")
SECRET_VALUE = json.dumps({"order": 42, "price": "x", "card": {"number": CARD},
                           "user": {"name": "Ann", "password": PASSWORD}}).encode()


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Outbox]:
    yield from durable_store(request, tmp_path, "roles")


def secret_letters(store: Outbox) -> list[int]:
    """Two dead letters holding secrets (value, header, error text), and one holding none."""
    return store.add_dead([
        NewMessage("orders", SECRET_VALUE, key=b"customer-42", msg_id="secret-1",
                   headers=[("authorization", BEARER.encode()), ("trace", b"t-1")], attempts=2,
                   error_name="builtins.ValueError", last_error=f"builtins.ValueError (consumer): bad card {CARD}"),
        NewMessage("orders", f"card={CARD} password={PASSWORD}".encode(), msg_id="secret-2", attempts=1,
                   error_code=10, error_name="MSG_SIZE_TOO_LARGE", last_error="MSG_SIZE_TOO_LARGE (10): too big"),
        NewMessage("orders", b'{"order": 43}', msg_id="plain-1", attempts=1, error_code=10,
                   error_name="MSG_SIZE_TOO_LARGE", last_error="MSG_SIZE_TOO_LARGE (10): too big"),
    ], failed_at=time.time())


def console(store: Outbox, **kw: Any) -> TestClient:
    tokens = {VIEWER: "viewer", OPERATOR: "operator"}
    return TestClient(create_app(store, token=ADMIN, tokens=tokens, loopback=False, **kw), base_url="http://localhost")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def no_secret(text: str) -> bool:
    return not any(s in text for s in SECRETS)


def state(store: Outbox) -> tuple[list[OutboxMessage], list[Any]]:
    """Every message, every byte and column, and the audit log: what a refused request must not change."""
    return store.messages(), store.audit_log(limit=1000)


def csrf_of(c: TestClient, token: str) -> str:
    page = c.get("/dead-letters", headers=bearer(token))
    found = re.search(r'name="csrf" value="([^"]+)"', page.text) or re.search(r"outbox_csrf=([^;]+)",
                                                                               page.headers.get("set-cookie", ""))
    assert found is not None, page.text
    return found.group(1)


def write_routes() -> list[tuple[str, str]]:
    """Every route of the API and the pages that is not a read: (method, path)."""
    out = []
    for route in [*api.router.routes, *pages.router.routes]:
        if isinstance(route, APIRoute):
            out += [(m, route.path) for m in sorted(route.methods - {"GET", "HEAD"})]
    return out


def test_a_viewer_sees_masks_everywhere_and_no_action(store: Outbox) -> None:
    secret, text, plain = secret_letters(store)
    c = console(store)
    auth = bearer(VIEWER)
    doc = c.get(f"/api/dead-letters/{secret}", headers=auth).json()
    assert doc["masked"] is True
    assert json.loads(doc["value"]) == {"order": 42, "price": "x", "card": {"number": MASK},
                                        "user": {"name": "Ann", "password": MASK}}  # still JSON
    assert json.loads(doc["value_pretty"]) == json.loads(doc["value"])
    assert doc["headers"] == [{"name": "authorization", "value": MASK, "encoding": "utf-8"},
                              {"name": "trace", "value": "t-1", "encoding": "utf-8"}]
    assert doc["last_error"] == f"builtins.ValueError (consumer): bad card {MASK}"
    assert (doc["key"], doc["size"]) == ("customer-42", len(SECRET_VALUE))  # keys and sizes as stored
    assert c.get(f"/api/dead-letters/{text}", headers=auth).json()["value"] == f"card={MASK} password={MASK}"
    assert c.get(f"/api/dead-letters/{plain}", headers=auth).json()["masked"] is False
    listed = c.get("/api/dead-letters", headers=auth).json()["items"]
    assert [m["masked"] for m in listed] == [True, True, False]
    answers = [c.get(u, headers=auth) for u in (
        "/api/dead-letters", f"/api/dead-letters/{secret}", f"/api/dead-letters/{text}", "/api/trace/secret-1",
        "/dead-letters", f"/dead-letters/{secret}", f"/dead-letters/{text}", "/trace?msg_id=secret-1", "/")]
    for a in answers:
        assert a.status_code == 200 and no_secret(a.text), a.url
    page = answers[5].text
    assert MASK in page and "Only an admin may reveal them" in page
    for action in ('id="selection"', 'id="redrive-selected"', 'id="purge-filter"', 'name="ids"', 'id="edit-form"',
                   'id="edit-redrive"', 'id="reveal"'):
        assert action not in answers[4].text + page, action
    assert '<span class="role" id="role"' in page and ">viewer<" in page


def test_a_viewer_gets_a_403_naming_the_role_on_every_write_and_nothing_changes(store: Outbox) -> None:
    secret, _text, _plain = secret_letters(store)
    store.enqueue([NewMessage("orders", b"pending", b"customer-42")])
    c = console(store)
    csrf = csrf_of(c, VIEWER)
    before = state(store)
    routes = write_routes()
    assert len(routes) == 10  # 6 in the API, 4 page forms
    bodies: dict[str, Any] = {
        "/api/redrive": {"ids": [secret]}, "/api/purge": {"confirm": True}, "/api/erase": {"key": "customer-42",
                                                                                         "confirm": True},
        "/api/dead-letters/{row_id}/redrive": {"value": "x"}, "/api/dead-letters/{row_id}/reveal": {},
        "/api/redrive-topic": {"dlq_topic": "orders.billing.dlq"},
    }
    for method, path in routes:
        url = path.replace("{row_id}", str(secret))
        if path.startswith("/api/"):
            r = c.request(method, url, json=bodies[path], headers=bearer(VIEWER))
            assert r.status_code == 403, (path, r.text)
            body = r.json()
            assert body["needs"] in ("operator", "admin") and f"needs the {body['needs']} role" in body["error"]
            assert "this request has the viewer role" in body["error"]
        else:
            form = {"csrf": csrf, "do": "purge:filter", "action": "purge", "scope": "filter", "value": "x",
                    "value_encoding": "utf-8", "headers": ""}
            r = c.request(method, url, data=form, headers=bearer(VIEWER))
            assert r.status_code == 403 and "role (this request has the viewer role)" in r.text, (path, r.text)
            assert 'id="error"' in r.text  # the error page
        assert no_secret(r.text)
    assert c.post(f"/api/dead-letters/{secret}/reveal", json={}, headers=bearer(VIEWER)).json()["needs"] == "admin"
    assert c.post("/api/purge", json={"confirm": True}, headers=bearer(VIEWER)).json()["needs"] == "operator"
    assert state(store) == before  # every row, byte and audit entry as it was


def test_an_operator_redrives_and_purges_but_may_not_reveal(store: Outbox) -> None:
    secret, text, plain = secret_letters(store)
    c = console(store)
    auth = bearer(OPERATOR)
    r = c.post(f"/api/dead-letters/{secret}/reveal", json={}, headers=auth)
    assert r.status_code == 403 and r.json()["needs"] == "admin" and no_secret(r.text)
    page = c.get(f"/dead-letters/{secret}", headers=auth).text
    assert 'id="reveal"' not in page and "Only an admin may reveal them" in page
    assert 'id="edit-redrive"' in page and no_secret(page)
    r = c.post("/api/redrive", json={"ids": [plain]}, headers=auth)
    assert r.status_code == 202
    job = r.json()["url"]
    deadline = time.monotonic() + 30
    while c.get(job, headers=auth).json()["state"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert store.get(plain).status is Status.PENDING
    assert c.post("/api/purge", json={"ids": [text], "confirm": True}, headers=auth).json()["removed"] == 1
    assert [r.id for r in store.list_dead()] == [secret]
    entries = [(e.action, e.who, e.count) for e in store.audit_log()]
    assert entries == [("purge", security.who(OPERATOR), 1), ("redrive (done)", security.who(OPERATOR), 1)]
    assert "reveal" not in {e.action for e in store.audit_log()}


def test_an_edit_never_stores_a_mask(store: Outbox) -> None:
    secret, text, _plain = secret_letters(store)
    stored = store.get(secret)
    c = console(store)
    auth = bearer(OPERATOR)
    shown = c.get(f"/api/dead-letters/{secret}", headers=auth).json()
    # Masked text changed with its mask kept in it: refused, nothing stored.
    changed = shown["value"].replace('"x"', "3")
    r = c.post(f"/api/dead-letters/{secret}/redrive", json={"value": changed}, headers=auth)
    assert r.status_code == 400 and "still holds the mask" in r.json()["error"]
    # A masked value replaced without having seen it: the admin's, who may reveal it.
    r = c.post(f"/api/dead-letters/{secret}/redrive", json={"value": '{"order": 42, "price": 3}'}, headers=auth)
    assert r.status_code == 403 and r.json()["needs"] == "admin"
    r = c.post(f"/api/dead-letters/{secret}/redrive", json={"headers": [["trace", "t-2"]]}, headers=auth)
    assert r.status_code == 403 and r.json()["needs"] == "admin"  # the masked authorization header dropped
    assert store.get(secret) == stored
    # What GET showed, posted back with a header added: the masked parts keep their stored bytes.
    r = c.post(f"/api/dead-letters/{secret}/redrive", headers=auth, json={
        "value": shown["value"], "value_encoding": shown["value_encoding"],
        "headers": [*shown["headers"], {"name": "fixed-by", "value": "ops", "encoding": "utf-8"}]})
    assert r.status_code == 200, r.text
    row = store.get(secret)
    assert (row.status, row.value, row.headers) == (
        Status.PENDING, SECRET_VALUE, [("authorization", BEARER.encode()), ("trace", b"t-1"), ("fixed-by", b"ops")])
    assert no_secret(r.text)
    # The page's form, submitted unchanged on a masked text value: the stored bytes again.
    csrf = csrf_of(c, OPERATOR)
    page = c.get(f"/dead-letters/{text}", headers=auth).text
    value = re.search(r'<textarea name="value"[^>]*>\n(.*?)</textarea>', page, re.S)
    headers = re.search(r'<textarea name="headers"[^>]*>\n(.*?)</textarea>', page, re.S)
    assert value is not None and headers is not None and MASK in value.group(1)
    r = c.post(f"/dead-letters/{text}/redrive", headers=auth, follow_redirects=False, data={
        "csrf": csrf, "value": html.unescape(value.group(1)), "value_encoding": "utf-8",
        "headers": html.unescape(headers.group(1))})
    assert r.status_code == 303, r.text
    assert store.get(text).value == f"card={CARD} password={PASSWORD}".encode()
    assert [e.action for e in store.audit_log()] == ["edit-redrive", "edit-redrive"]


def test_an_admins_reveal_is_audited_and_may_edit_the_revealed_value(store: Outbox) -> None:
    secret, _text, _plain = secret_letters(store)
    c = console(store)
    auth = bearer(ADMIN)
    assert c.get(f"/api/dead-letters/{secret}", headers=auth).json()["masked"] is True  # masked until revealed
    assert store.audit_log() == []
    r = c.post(f"/api/dead-letters/{secret}/reveal", json={}, headers=auth)
    assert r.status_code == 200
    doc = r.json()
    assert (doc["value"], doc["masked"]) == (SECRET_VALUE.decode(), False)
    assert doc["headers"][0] == {"name": "authorization", "value": BEARER, "encoding": "utf-8"}
    [entry] = store.audit_log()
    assert (entry.action, entry.who, json.loads(entry.filter), entry.count) == (
        "reveal", security.who(ADMIN), {"ids": [secret]}, 1)
    assert ADMIN not in entry.who
    # The page: a Reveal button, a form that shows the revealed message, audited again.
    csrf = csrf_of(c, ADMIN)
    page = c.get(f"/dead-letters/{secret}", headers=auth).text
    assert 'id="reveal"' in page and no_secret(page)
    page = c.post(f"/dead-letters/{secret}/reveal", data={"csrf": csrf}, headers=auth).text
    assert PASSWORD in page and BEARER in page and 'id="revealed"' in page
    assert [e.action for e in store.audit_log()] == ["reveal", "reveal"]
    assert c.post(f"/dead-letters/{secret}/reveal", data={"csrf": "forged"}, headers=auth).status_code == 403
    assert len(store.audit_log()) == 2  # a forged form reveals nothing and records nothing
    # The revealed value, edited: stored as sent.
    edited = SECRET_VALUE.replace(b'"x"', b"3")
    r = c.post(f"/api/dead-letters/{secret}/redrive", json={"value": edited.decode()}, headers=auth)
    assert r.status_code == 200 and store.get(secret).value == edited
    r = c.post("/api/dead-letters/999999/reveal", json={}, headers=auth)
    assert r.status_code == 404 and len(store.audit_log()) == 3  # the edit's entry; no reveal of nothing


def test_a_console_without_tokens_is_the_local_admin_and_masks_too(store: Outbox) -> None:
    [secret, *_] = secret_letters(store)
    c = TestClient(create_app(store), base_url="http://localhost")
    assert no_secret(c.get(f"/api/dead-letters/{secret}").text)
    assert c.post(f"/api/dead-letters/{secret}/reveal", json={}).json()["value"] == SECRET_VALUE.decode()
    assert [(e.action, e.who) for e in store.audit_log()] == [("reveal", "local")]
    assert ">admin<" in c.get("/").text


def test_the_role_header_is_honoured_only_when_enabled(store: Outbox) -> None:
    secret_letters(store)
    plain = TestClient(create_app(store), base_url="http://localhost")
    r = plain.post("/api/purge", json={"confirm": True}, headers={"X-Outbox-Role": "viewer"})
    assert r.status_code == 200  # not enabled: ignored, and the loopback console is the local admin
    [secret, *_] = secret_letters(store)
    proxied = TestClient(create_app(store, role_header="X-Outbox-Role"), base_url="http://localhost")
    assert proxied.get("/api/stats").status_code == 401
    before = state(store)
    r = proxied.post("/api/purge", json={"confirm": True}, headers={"X-Outbox-Role": "viewer"})
    assert r.status_code == 403 and r.json()["needs"] == "operator" and state(store) == before
    r = proxied.post(f"/api/dead-letters/{secret}/reveal", json={}, headers={"X-Outbox-Role": "operator"})
    assert r.status_code == 403 and r.json()["needs"] == "admin"
    r = proxied.post(f"/api/dead-letters/{secret}/reveal", json={}, headers={"X-Outbox-Role": "admin"})
    assert r.json()["value"] == SECRET_VALUE.decode()
    assert [(e.action, e.who) for e in store.audit_log()][0] == ("reveal", "proxy:admin")


def test_the_masking_rules_given_are_the_ones_applied(store: Outbox) -> None:
    [d] = store.add_dead([NewMessage("orders", b'{"user": {"email": "a@b.c", "password": "p"}, "ssn": "078-05-1120"}',
                                     headers=[("x-customer", b"Ann"), ("authorization", b"t")])], failed_at=time.time())
    rules = MaskRules(headers=("x-customer",), json_paths=("$.user.email",), regexes=(r"\d{3}-\d{2}-\d{4}",),
                      defaults=False)
    doc = TestClient(create_app(store, masking=rules), base_url="http://localhost").get(f"/api/dead-letters/{d}").json()
    assert json.loads(doc["value"]) == {"user": {"email": MASK, "password": "p"}, "ssn": MASK}
    assert [h["value"] for h in doc["headers"]] == [MASK, "t"]
