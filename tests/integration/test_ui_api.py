"""The console's JSON API and form endpoints, through httpx (Starlette's TestClient), against a real
SQLite file and a real PostgreSQL store: filters, keyset pages, 4xx errors, token, host check,
CSRF, redrive jobs (and their messages reaching Kafka), purge, edit-then-redrive, trace, audit,
and no password in any answer."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from outbox_cli.main import cli

from outbox.drain.workers import Drainer
from outbox.records import DeadLetterFilter, NewMessage, Status
from outbox.stores.audited import key_digest
from outbox.stores.base import Outbox
from outbox.stores.sqlite import SQLiteOutbox
from outbox.stores.urls import parse_url
from outbox.testing.consume import consume_to_end
from outbox.ui import create_app, security

from .durable_stores import durable_store

NOW = time.time()
TOKEN = "s3cret-token-0123456789"


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Outbox]:
    yield from durable_store(request, tmp_path, "ui")


def client(store: Outbox, **kw: Any) -> TestClient:
    return TestClient(create_app(store, **kw), base_url="http://localhost")


def consumer_headers(group: str, topic: str = "orders") -> list[tuple[str, bytes | None]]:
    return [
        ("outbox-original-topic", topic.encode()), ("outbox-original-partition", b"0"),
        ("outbox-original-offset", b"7"), ("outbox-original-timestamp", b"1700000000000"),
        ("outbox-group", group.encode()), ("outbox-attempt", b"4"),
        ("outbox-error-class", b"builtins.ValueError"), ("outbox-error-message", b"bad price"),
    ]


def fill(store: Outbox, topic: str = "orders") -> dict[str, list[int]]:
    """Producer dead letters of two errors, and a consumer group's dead letters.

    Failure times are relative to the moment of the fill, not of the module's import: in a full
    run the test executes many minutes after collection, and `since=45s` means "from now".
    """
    now = time.time()
    big = [NewMessage(topic, b'{"n": %d}' % i, key=b"k%d" % (i % 3), msg_id=f"big-{i}", attempts=1,
                      error_code=10, error_name="MSG_SIZE_TOO_LARGE", last_error="MSG_SIZE_TOO_LARGE (10): too big")
           for i in range(7)]
    auth = [NewMessage(topic, b"plain", msg_id=f"auth-{i}", attempts=1, error_code=29,
                       error_name="TOPIC_AUTHORIZATION_FAILED", last_error="TOPIC_AUTHORIZATION_FAILED (29): denied")
            for i in range(3)]
    grp = [NewMessage(f"{topic}.billing.retry-1", b"\x00\xff", msg_id=f"c-{i}", headers=consumer_headers("billing"),
                      attempts=4, error_name="builtins.ValueError",
                      last_error="builtins.ValueError (consumer): bad price")
           for i in range(2)]
    return {
        "big": store.add_dead(big, failed_at=now - 60),
        "auth": store.add_dead(auth, failed_at=now - 30),
        "group": store.add_dead(grp, failed_at=now),
    }


def all_pages(c: TestClient, query: str) -> list[int]:
    got: list[int] = []
    after = ""
    while True:
        r = c.get(f"/api/dead-letters?{query}&limit=3{after}")
        assert r.status_code == 200, r.text
        body = r.json()
        got += [m["id"] for m in body["items"]]
        if body["next_after"] is None:
            return got
        after = f"&after={body['next_after']}"


def test_filters_and_keyset_pages(store: Outbox) -> None:
    ids = fill(store)
    store.enqueue([NewMessage("orders", b"pending", msg_id="p-1")])
    c = client(store)
    assert all_pages(c, "") == ids["big"] + ids["auth"] + ids["group"]  # pending rows are not listed
    assert all_pages(c, "error=MSG_SIZE_TOO_LARGE") == ids["big"]
    assert all_pages(c, "error=msg_size_too_large") == ids["big"]  # names as the CLI reads them
    assert all_pages(c, "error=29") == ids["auth"]
    assert all_pages(c, "group=billing") == ids["group"]
    assert all_pages(c, "topic=orders&key=k1") == [ids["big"][i] for i in (1, 4)]
    assert all_pages(c, "text=DENIED") == ids["auth"]
    assert all_pages(c, "since=45s") == ids["auth"] + ids["group"]
    assert all_pages(c, "until=45s") == ids["big"]
    assert all_pages(c, "error=builtins.ValueError&topic=orders.billing.retry-1") == ids["group"]
    first = c.get("/api/dead-letters?group=billing").json()["items"][0]
    assert (first["group"], first["value_encoding"], first["value_preview"]) == ("billing", "hex", "00ff")
    stats = c.get("/api/stats").json()
    assert (stats["dead"], stats["pending"]) == (12, 1)
    assert stats["dead_by_group"] == {"billing": 2}
    assert stats["dead_by_error"] == {"MSG_SIZE_TOO_LARGE (10)": 7, "TOPIC_AUTHORIZATION_FAILED (29)": 3,
                                      "builtins.ValueError": 2}
    page = c.get("/dead-letters?error=MSG_SIZE_TOO_LARGE&limit=5")
    assert page.status_code == 200
    assert len(re.findall(r'name="ids" value="(\d+)"', page.text)) == 5 and "Next page" in page.text


def test_one_dead_letter_decoded(store: Outbox) -> None:
    [j, h] = store.add_dead([
        NewMessage("t", b'{"a": [1, 2]}', headers=[("trace", b"abc"), ("bin", b"\xff\x00"), ("none", None)]),
        NewMessage("t", b"<script>alert(1)</script>", key=b"<b>k</b>"),
    ], failed_at=NOW)
    c = client(store)
    doc = c.get(f"/api/dead-letters/{j}").json()
    assert (doc["value"], doc["value_encoding"]) == ('{"a": [1, 2]}', "utf-8")  # the stored bytes' text
    assert doc["value_pretty"] == '{\n  "a": [\n    1,\n    2\n  ]\n}'  # for reading only
    assert doc["headers"] == [{"name": "trace", "value": "abc", "encoding": "utf-8"},
                              {"name": "bin", "value": "ff00", "encoding": "hex"},
                              {"name": "none", "value": None, "encoding": None}]
    assert [e["what"] for e in doc["timeline"]][-1].startswith("last failure")
    html = c.get(f"/dead-letters/{h}").text
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;b&gt;k&lt;/b&gt;" in html


def test_bad_requests_are_4xx_with_a_clear_message(store: Outbox) -> None:
    [d] = store.add_dead([NewMessage("t", b"v")], failed_at=NOW)
    c = client(store)
    cases = {
        "/api/dead-letters?since=yesterday": (400, "since: cannot read the time 'yesterday'"),
        "/api/dead-letters?topc=orders": (400, "unknown filter field(s): topc"),
        "/api/dead-letters?limit=0": (400, "limit: 0 is not between 1 and 500"),
        "/api/dead-letters?after=x": (400, "after: 'x' is not a whole number"),
        "/api/dead-letters?since=1h&until=2h": (400, "since: must be before until"),
        "/api/dead-letters/999999": (404, "no message with id 999999"),
        "/api/jobs/999": (404, "no job 999"),
        "/api/trace/nope": (404, "no row with outbox-id 'nope'"),
        "/api/audit?limit=-1": (400, "limit: -1 is not between 1 and 1000"),
    }
    for url, (status, message) in cases.items():
        r = c.get(url)
        assert r.status_code == status and message in r.json()["error"], (url, r.text)
    assert c.get("/api/dead-letters/abc").status_code == 422  # FastAPI's own path validation
    page = c.get("/dead-letters?since=yesterday")
    assert page.status_code == 400 and "cannot read the time" in page.text and "Traceback" not in page.text
    assert c.get("/dead-letters/424242").status_code == 404
    for body, message in [
        ("[1]", "must be a JSON object"), ("{", "not valid JSON"), ('{"ids": "1"}', "ids: must be a list"),
        ('{"ids": [0]}', "ids: 0 is not between"), ('{"rate": 0}', "rate: must be above 0"),
        ('{"colour": "red"}', "unknown filter field(s): colour"),
    ]:
        r = c.post("/api/redrive", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and message in r.json()["error"], (body, r.text)
    r = c.post("/api/redrive", json={"ids": [d, 999_999], "dry_run": True})
    assert r.status_code == 404 and "no message with id 999999" in r.json()["error"]
    [p] = store.enqueue([NewMessage("t", b"p")])
    r = c.post("/api/purge", json={"ids": [p], "confirm": True})
    assert r.status_code == 409 and f"message {p} is pending, not a dead letter" in r.json()["error"]
    r = c.post("/api/purge", json={"ids": list(range(1, 1002)), "dry_run": True})
    assert r.status_code == 400 and "at most 1000" in r.json()["error"]
    r = c.post(f"/api/dead-letters/{d}/redrive", json={"value": "zz", "value_encoding": "hex"})
    assert r.status_code == 400 and "not valid hex" in r.json()["error"]
    r = c.post(f"/api/dead-letters/{d}/redrive", json={"headers": [["", "x"]]})
    assert r.status_code == 400 and "non-empty name" in r.json()["error"]
    assert store.get(d).status is Status.DEAD  # nothing changed by the refused requests


def test_redrive_dry_run_then_job_with_progress_and_audit(store: Outbox) -> None:
    ids = fill(store)
    c = client(store)
    r = c.post("/api/redrive", json={"error": "MSG_SIZE_TOO_LARGE", "dry_run": True})
    assert r.json()["count"] == 7
    assert store.count_dead() == 12  # a dry run changes nothing
    r = c.post("/api/redrive", json={"error": "MSG_SIZE_TOO_LARGE", "rate": 50})
    assert r.status_code == 202
    job = r.json()["job"]
    assert (job["total"], job["rate"]) == (7, 50)
    deadline = time.monotonic() + 30
    while job["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
        job = c.get(r.json()["url"]).json()
    assert (job["state"], job["done"]) == ("done", 7)
    assert [store.get(i).status for i in ids["big"]] == [Status.PENDING] * 7
    assert store.get(ids["big"][0]).attempts == 0
    assert store.count_dead() == 5
    # A selection: the consumer group's two, back into their group's first retry tier.
    r = c.post("/api/redrive", json={"ids": ids["group"]})
    job_url = r.json()["url"]
    while c.get(job_url).json()["state"] == "running":
        time.sleep(0.05)
    assert {store.get(i).topic for i in ids["group"]} == {"orders.billing.retry-1"}
    assert all(store.get(i).status is Status.PENDING for i in ids["group"])
    audit = c.get("/api/audit").json()["entries"]
    assert [(e["action"], e["count"], e["who"]) for e in audit] == [
        ("redrive (done)", 2, "local"), ("redrive (done)", 7, "local")
    ]
    assert '"error": "MSG_SIZE_TOO_LARGE"' in audit[1]["filter"]


def test_purge_needs_confirmation(store: Outbox) -> None:
    ids = fill(store)
    c = client(store)
    r = c.post("/api/purge", json={"topic": "orders", "error": "29"})
    assert r.status_code == 400 and '"confirm": true' in r.json()["error"]
    assert c.post("/api/purge", json={"topic": "orders", "error": "29", "dry_run": True}).json()["count"] == 3
    assert store.count_dead() == 12
    r = c.post("/api/purge", json={"topic": "orders", "error": "29", "confirm": True})
    assert r.json()["removed"] == 3
    assert store.count_dead() == 9 and store.list_dead(DeadLetterFilter(ids=tuple(ids["auth"]))) == []
    [entry] = c.get("/api/audit").json()["entries"]
    assert (entry["action"], entry["count"]) == ("purge", 3)
    # Filtered as `outbox audit` filters (`outbox.stores.audited.read_audit`).
    store.add_audit(who="cli:bob", action="erase", filter="{}", count=1, at=time.time() - 86400 * 3)
    assert [e["who"] for e in c.get("/api/audit?who=cli").json()["entries"]] == ["cli:bob"]
    assert [e["action"] for e in c.get("/api/audit?action=purge&action=erase").json()["entries"]] == [
        "erase", "purge"]
    assert [e["action"] for e in c.get("/api/audit?since=1d").json()["entries"]] == ["purge"]
    assert [e["action"] for e in c.get("/api/audit?until=1d&who=local").json()["entries"]] == []
    r = c.get("/api/audit?since=yesterday")
    assert r.status_code == 400 and "since: cannot read the time 'yesterday'" in r.json()["error"]


def test_erase_a_key_counted_first_then_confirmed_and_audited_by_its_digest(store: Outbox) -> None:
    key, other = b"customer-42", b"\x00customer-7"
    batch = [NewMessage("orders", b"o-%d" % i, key if i % 3 == 0 else other, msg_id=f"o{i}") for i in range(30)]
    ids = store.enqueue(batch)  # one group row holding both keys
    store.add_dead([NewMessage("orders", b"d", key), NewMessage("payments", b"d", key)], failed_at=NOW)
    store.claim("drain@elsewhere", 100, 600, now=time.time())  # the group, leased to a drain worker
    digest = key_digest(key)
    c = client(store, token=TOKEN, loopback=False)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    dry = c.post("/api/erase", json={"key": "customer-42", "dry_run": True}, headers=auth).json()
    assert dry == {"key_sha256": digest, "topic": None, "dry_run": True, "pending": 10, "dead": 2, "leased": 10,
                   "total": 12}
    r = c.post("/api/erase", json={"key": "customer-42"}, headers=auth)
    assert r.status_code == 400 and '"confirm": true' in r.json()["error"]
    assert c.post("/api/erase", json={"key": "customer-42", "confirm": True}).status_code == 401  # no token
    assert len(store.messages()) == 32 and store.audit_log() == []
    r = c.post("/api/erase", json={"key_hex": key.hex(), "topic": "payments", "confirm": True}, headers=auth)
    assert r.json() == {"key_sha256": digest, "topic": "payments", "dry_run": False, "pending": 0, "dead": 1,
                        "leased": 0, "total": 1}
    r = c.post("/api/erase", json={"key": "customer-42", "confirm": True}, headers=auth)
    assert (r.json()["pending"], r.json()["dead"], r.json()["leased"]) == (10, 1, 10)
    assert [m.key for m in store.messages()] == [other] * 20
    assert [m.id for m in store.messages()] == [i for i, m in zip(ids, batch, strict=True) if m.key == other]
    entries = c.get("/api/audit", headers=auth).json()["entries"]
    assert [(e["action"], e["count"], e["who"]) for e in entries] == [("erase", 11, security.who(TOKEN)),
                                                                       ("erase", 1, security.who(TOKEN))]
    assert "customer-42" not in str(entries) and key.hex() not in str(entries) and digest in str(entries)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"confirm": True}, "give the key once: key (text) or key_hex"),
        ({"key": "a", "key_hex": "61", "confirm": True}, "give the key once: key (text) or key_hex"),
        ({"key_hex": "zz-secret", "confirm": True}, "key_hex: not hex (two hex digits per byte; the value is not "
                                                    "repeated)"),
        ({"key": 42, "confirm": True}, "key: must be text (key_hex for bytes)"),
        ({"key": "k", "topic": "", "confirm": True}, "topic: must be a topic's name"),
        ({"key": "k", "ids": [1], "confirm": True}, "unknown field(s): ids"),
    ],
)
def test_a_bad_erase_request_is_a_400_naming_the_field(store: Outbox, body: dict[str, Any], error: str) -> None:
    store.enqueue([NewMessage("orders", b"v", b"k")])
    r = client(store).post("/api/erase", json=body)
    assert r.status_code == 400 and r.json() == {"error": error}
    assert len(store.messages()) == 1 and store.audit_log() == []


def test_edit_then_redrive_one(store: Outbox) -> None:
    [d] = store.add_dead([NewMessage("t", b'{"price": "x"}', key=b"k", headers=[("a", b"1")])], failed_at=NOW)
    c = client(store)
    r = c.post(f"/api/dead-letters/{d}/redrive", json={"value": '{"price": 3}', "headers": [["a", "2"], ["b", None]]})
    assert r.status_code == 200 and r.json()["status"] == "pending"
    row = store.get(d)
    assert (row.value, row.headers, row.key, row.status) == (b'{"price": 3}', [("a", b"2"), ("b", None)], b"k",
                                                             Status.PENDING)
    r = c.post(f"/api/dead-letters/{d}/redrive", json={"value": "again"})
    assert r.status_code == 409 and "pending, not a dead letter" in r.json()["error"]
    assert c.get("/api/audit").json()["entries"][0]["action"] == "edit-redrive"


# Values and headers an unchanged edit must send back byte for byte.
AWKWARD = [
    NewMessage("t", b'{"note":"compact","n":[1,2,3]}', headers=[("h", b"\xff\xfe binary"), ("j", b'{"a":1}')]),
    NewMessage("t", b"\xff\xfe\x00 binary", headers=[("empty", b""), ("none", None), ("pad", b" x ")]),
    NewMessage("t", b"", headers=[("crlf", b"a\r\nb")]),
    NewMessage("t", None, headers=[]),
]


def test_edit_unchanged_through_the_api_keeps_every_byte(store: Outbox) -> None:
    """What GET /api/dead-letters/{id} shows, posted back as is, stores the same bytes."""
    ids = store.add_dead(AWKWARD, failed_at=NOW)
    c = client(store)
    for i, sent in zip(ids, AWKWARD, strict=True):
        doc = c.get(f"/api/dead-letters/{i}").json()
        r = c.post(f"/api/dead-letters/{i}/redrive", json={
            "value": doc["value"], "value_encoding": doc["value_encoding"], "headers": doc["headers"]})
        assert r.status_code == 200, r.text
        row = store.get(i)
        assert (row.status, row.value, row.headers) == (Status.PENDING, sent.value, sent.headers)


def test_trace_by_outbox_id(store: Outbox) -> None:
    [d] = store.add_dead([NewMessage("orders", b"v", msg_id="m-42")], failed_at=NOW)
    [p] = store.enqueue([NewMessage("orders.billing.retry-2", b"v", msg_id="m-42")])
    c = client(store)
    doc = c.get("/api/trace/m-42").json()
    assert [(r["id"], r["status"]) for r in doc["rows"]] == [(d, "dead"), (p, "pending")]
    page = c.get("/trace?msg_id=m-42").text
    assert f'href="/dead-letters/{d}"' in page and f'href="/dead-letters/{p}"' in page


def test_token_on_every_request(store: Outbox) -> None:
    store.add_dead([NewMessage("t", b"v")], failed_at=NOW)
    c = client(store, token=TOKEN, loopback=False)
    for url in ("/api/stats", "/api/dead-letters", "/", "/dead-letters", "/api/openapi.json"):
        r = c.get(url)
        assert r.status_code == 401 and "token is required" in r.text, url
    assert c.get("/api/stats", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/api/stats", headers={"Authorization": f"Bearer {TOKEN}"}).json()["dead"] == 1
    assert c.get("/login?token=wrong", follow_redirects=False).status_code == 401
    r = c.get(f"/login?token={TOKEN}", follow_redirects=False)
    assert r.status_code == 303 and "httponly" in r.headers["set-cookie"].lower()
    assert c.get("/dead-letters").status_code == 200  # the cookie now
    r = c.post("/api/purge", json={"confirm": True})  # cookie + JSON: allowed, and audited by token
    assert r.json()["removed"] == 1
    assert c.get("/api/audit").json()["entries"][0]["who"].startswith("token:")
    assert TOKEN not in c.get("/api/audit").text


def test_host_check_on_loopback(store: Outbox) -> None:
    c = client(store)
    assert c.get("/api/stats").status_code == 200
    assert c.get("/api/stats", headers={"host": "127.0.0.2:8080"}).status_code == 200  # any loopback address
    assert c.get("/api/stats", headers={"host": "[::1]:8080"}).status_code == 200
    r = c.get("/api/stats", headers={"host": "evil.example:8080"})
    assert r.status_code == 400 and "localhost only" in r.json()["error"]


def test_csrf_and_json_content_type(store: Outbox) -> None:
    ids = fill(store)
    c = client(store)
    page = c.get("/dead-letters?error=29")
    token = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert token is not None and c.cookies.get("outbox_csrf") == token.group(1)
    form = {"do": "purge:selected", "ids": [str(ids["auth"][0])], "error": "29"}
    r = c.post("/actions", data=form)  # no CSRF field: refused
    assert r.status_code == 403 and "CSRF" in r.text
    r = c.post("/actions", data={**form, "csrf": "forged"})
    assert r.status_code == 403
    r = c.post("/actions", data={**form, "csrf": token.group(1)})
    assert r.status_code == 200 and 'id="confirm-count">1<' in r.text
    assert store.count_dead() == 12  # the first step only counts
    r = c.post("/actions/confirm", data={"action": "purge", "scope": "selected", "ids": [str(ids["auth"][0])],
                                         "error": "29", "csrf": token.group(1)}, follow_redirects=False)
    assert r.status_code == 303 and "Purged+1" in r.headers["location"]
    assert store.count_dead() == 11
    # API writes in a form's content type (what a cross-site page can send) are refused.
    r = c.post("/api/purge", data={"confirm": "true"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]
    r = c.post("/api/purge", content='{"confirm": true}', headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert store.count_dead() == 11


def test_security_headers(store: Outbox) -> None:
    r = client(store).get("/")
    assert "script-src" not in r.headers["content-security-policy"]  # default-src 'none': no script
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY" and r.headers["referrer-policy"] == "no-referrer"


def test_no_password_in_any_answer() -> None:
    """A PostgreSQL server of our own, whose password is a distinctive string to look for."""
    from outbox.stores.postgres import PostgresOutbox

    from .private_pg import PrivatePostgres

    pg = PrivatePostgres("Ui-S3cret-9f2e7")
    pg.start()
    try:
        _no_password(PostgresOutbox(pg.url, pool_size=1), parse_url(pg.url))
    finally:
        pg.close()


def _no_password(store: Outbox, url: Any) -> None:
    assert url.password == "Ui-S3cret-9f2e7"
    ids = fill(store)
    c = client(store, location=url.redacted())
    answers = [c.get(u) for u in ("/", "/dead-letters", f"/dead-letters/{ids['big'][0]}", "/trace?msg_id=big-1",
                                  "/api/stats", "/api/dead-letters", "/audit", "/api/openapi.json")]
    store.close()  # now every store call fails: the errors must not show the password either
    answers += [c.get("/api/stats"), c.get("/dead-letters")]
    assert [a.status_code for a in answers[-2:]] == [503, 503]
    assert "the outbox store failed" in answers[-2].json()["error"]
    for a in answers:
        assert url.password not in a.text, a.url
    assert "***" in answers[0].text  # the location is shown, redacted


def test_cli_refuses_other_hosts_without_a_token(tmp_path: Any) -> None:
    SQLiteOutbox(str(tmp_path / "o.db")).close()
    runner = CliRunner()
    r = runner.invoke(cli, ["ui", "--outbox", str(tmp_path / "o.db"), "--host", "0.0.0.0"], env={"OUTBOX_UI_TOKEN": ""})
    assert r.exit_code == 2 and "give a token" in r.output
    r = runner.invoke(cli, ["ui", "--outbox", str(tmp_path / "o.db"), "--host", "0.0.0.0", "--token", "short"])
    assert r.exit_code == 2 and "at least 16 characters" in r.output
    r = runner.invoke(cli, ["ui", "--outbox", str(tmp_path / "missing.db")])
    assert r.exit_code == 1 and "does not exist" in r.output


def test_redriven_dead_letters_reach_kafka(
    tmp_path: Any, kafka_bootstrap: str, make_topic: Callable[..., str]
) -> None:
    """Redrive through the API, then a drain: exactly the redriven messages arrive, once each."""
    topic = make_topic(partitions=1)
    store = SQLiteOutbox(str(tmp_path / "k.db"))
    try:
        ids = fill(store, topic)
        c = client(store)
        r = c.post("/api/redrive", json={"ids": ids["big"][:2] + ids["auth"][:1]})
        while c.get(r.json()["url"]).json()["state"] == "running":
            time.sleep(0.05)
        drain = Drainer(store, {"bootstrap.servers": kafka_bootstrap})
        result = drain.run(until_empty=True)
        assert result.delivered == 3
        got = consume_to_end(kafka_bootstrap, topic)
        assert sorted(m.value() for m in got) == [b"plain", b'{"n": 0}', b'{"n": 1}']
        assert store.count_dead() == 9
    finally:
        store.close()


def test_redrive_a_dlq_topic_into_the_first_retry_tier(
    tmp_path: Any, kafka_bootstrap: str, make_topic: Callable[..., str]
) -> None:
    """A consumer's DLQ *topic* (dead_letters="topic"), republished through the console."""
    from confluent_kafka import Producer

    main = make_topic(partitions=1)
    dlq = make_topic(partitions=1, name=f"{main}.billing.dlq")
    tier = make_topic(partitions=1, name=f"{main}.billing.retry-1")
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(2):
        p.produce(dlq, b"dead-%d" % i, headers=consumer_headers("billing", main))
    assert p.flush(30) == 0
    store = SQLiteOutbox(str(tmp_path / "t.db"))
    try:
        r = client(store).post("/api/redrive-topic", json={"dlq_topic": dlq})
        assert r.status_code == 409 and "--bootstrap-servers" in r.json()["error"]
        c = client(store, kafka={"bootstrap.servers": kafka_bootstrap})
        r = c.post("/api/redrive-topic", json={"dlq_topic": dlq})
        assert r.status_code == 200, r.text
        assert r.json() == {"dlq_topic": dlq, "replayed": 2, "by_topic": {tier: 2}}
        assert sorted(m.value() for m in consume_to_end(kafka_bootstrap, tier)) == [b"dead-0",
                                                                                                     b"dead-1"]
        assert c.post("/api/redrive-topic", json={"dlq_topic": dlq}).json()["replayed"] == 0  # progress kept
        r = c.post("/api/redrive-topic", json={"dlq_topic": "no-such-topic-here"})
        assert r.status_code == 400 and "does not exist" in r.json()["error"]
        r = c.post("/api/redrive-topic", json={"dlq_topic": "bad topic!"})
        assert r.status_code == 400 and "dlq_topic" in r.json()["error"]
        assert [(e["action"], e["count"]) for e in c.get("/api/audit").json()["entries"]] == [
            ("redrive-topic", 0), ("redrive-topic", 2)
        ]
    finally:
        store.close()


def test_served_console_keeps_the_token_out_of_its_log(tmp_path: Any) -> None:
    """The real `outbox ui` process: its request log shows *** where the token was."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    SQLiteOutbox(str(tmp_path / "o.db")).close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from outbox_cli.main import main; main()", "ui", "--outbox", str(tmp_path / "o.db"),
         "--port", str(port)],
        cwd=Path(__file__).resolve().parents[2], env={**os.environ, "OUTBOX_UI_TOKEN": TOKEN},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                stats = httpx.get(f"{base}/api/stats", headers=bearer, timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "outbox ui did not start"
                time.sleep(0.2)
        assert stats.json()["dead"] == 0
        assert httpx.get(f"{base}/login?token={TOKEN}", timeout=5).status_code == 303
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert "GET /login?token=*** HTTP" in out and "GET /api/stats HTTP" in out, out
    assert TOKEN not in out


def test_overview_shows_the_retry_tiers_lag(
    tmp_path: Any, kafka_bootstrap: str, make_topic: Callable[..., str]
) -> None:
    from confluent_kafka import Consumer, Producer, TopicPartition

    group = f"g{uuid.uuid4().hex[:8]}"
    main = make_topic(partitions=2)
    tier1 = make_topic(partitions=2, name=f"{main}.{group}.retry-1")
    tier2 = make_topic(partitions=1, name=f"{main}.{group}.retry-2")
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(5):
        p.produce(tier1, b"%d" % i, partition=0)
    p.produce(tier2, b"x", partition=0)
    assert p.flush(30) == 0
    committer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
    committer.commit(offsets=[TopicPartition(tier1, 0, 2)], asynchronous=False)  # 2 of tier 1 handled
    committer.close()
    store = SQLiteOutbox(str(tmp_path / "l.db"))
    try:
        stats = client(store, kafka={"bootstrap.servers": kafka_bootstrap}).get("/api/stats").json()
        mine = [t for t in stats["tier_lag"] if t["group"] == group]
        assert mine == [
            {"group": group, "topic": main, "tier": tier1, "number": 1, "lag": 3},
            {"group": group, "topic": main, "tier": tier2, "number": 2, "lag": 1},
        ]
        page = client(store, kafka={"bootstrap.servers": kafka_bootstrap}).get("/").text
        assert tier1 in page
        down = client(store, kafka={"bootstrap.servers": "127.0.0.1:1"}).get("/api/stats")
        assert down.status_code == 200 and down.json()["tier_lag"] is None
        assert "could not read the retry tiers' offsets" in down.json()["tier_lag_error"]
        assert client(store).get("/api/stats").json()["tier_lag"] is None  # no -b: not asked
    finally:
        store.close()


def test_page_forms_redrive_a_whole_filter_and_edit_one(store: Outbox) -> None:
    ids = fill(store)
    c = client(store)
    csrf = re.search(r'name="csrf" value="([^"]+)"', c.get("/dead-letters").text)
    assert csrf is not None
    r = c.post("/actions", data={"do": "redrive:filter", "error": "29", "csrf": csrf.group(1)})
    assert 'id="confirm-count">3<' in r.text and 'name="rate"' in r.text
    r = c.post("/actions/confirm", data={"action": "redrive", "scope": "filter", "error": "29", "rate": "1000",
                                         "csrf": csrf.group(1)}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/jobs/")
    deadline = time.monotonic() + 30
    while 'id="job-state">done<' not in (page := c.get(r.headers["location"]).text):
        assert time.monotonic() < deadline, page
        time.sleep(0.05)
    assert all(store.get(i).status is Status.PENDING for i in ids["auth"])
    assert c.post("/actions", data={"do": "purge:selected", "csrf": csrf.group(1)}).status_code == 400  # none ticked
    [d] = ids["group"][:1]
    r = c.post(f"/dead-letters/{d}/redrive", follow_redirects=False, data={
        "csrf": csrf.group(1), "value": '{"price": 1}', "value_encoding": "utf-8",
        "headers": "outbox-group: billing\nfixed-by: ops\nempty"})
    assert r.status_code == 303
    row = store.get(d)
    assert (row.status, row.value, row.headers) == (
        Status.PENDING, b'{"price": 1}', [("outbox-group", b"billing"), ("fixed-by", b"ops"), ("empty", None)])
    r = c.post(f"/dead-letters/{d}/redrive", data={"csrf": csrf.group(1), "value": "x", "headers": ": no name"})
    assert r.status_code == 400 and "needs a name" in r.text


def test_openapi_schema_lists_the_api(store: Outbox) -> None:
    paths = client(store).get("/api/openapi.json").json()["paths"]
    assert {"/api/stats", "/api/dead-letters", "/api/dead-letters/{row_id}", "/api/redrive", "/api/jobs/{job_id}",
            "/api/purge", "/api/dead-letters/{row_id}/redrive", "/api/redrive-topic", "/api/trace/{msg_id}",
            "/api/audit", "/api/erase", "/api/dead-letters/{row_id}/reveal"} == set(paths)
