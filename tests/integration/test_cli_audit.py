"""`outbox audit` over every store it can open (SQLite, PostgreSQL), after real purges and
erasures by the `outbox` command, and the filter it shares with the console over the memory store
too (`outbox.stores.audited.read_audit`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from outbox_cli.common import who
from outbox_cli.main import cli

from outbox.records import NewMessage
from outbox.stores import MemoryOutbox, open_outbox
from outbox.stores.audited import AuditQuery, key_digest, read_audit
from outbox.stores.base import StoreAdmin

DAY = 86400.0


def run(*args: str) -> Result:
    env = {"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": "", "OUTBOX_ENCRYPTION_KEYS": ""}
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'o.db'}"
    return str(request.getfixturevalue("fresh_postgres_url"))


def fill(store: StoreAdmin) -> None:
    """Two dead letters of billing, one of orders, a pending message of customer-42, and an
    older reveal by a console token (ten days ago)."""
    now = time.time()
    store.add_dead([NewMessage("billing", b"b%d" % i, b"k", msg_id=f"b{i}") for i in range(2)], failed_at=now)
    store.add_dead([NewMessage("orders", b"o", b"k", msg_id="o1")], failed_at=now)
    store.enqueue([NewMessage("orders", b"c", b"customer-42", msg_id="c1")])
    store.add_audit(who="token:1a2b3c4d", action="reveal", filter='{"ids": [3]}', count=1, at=now - 10 * DAY)


def entries(url: str, *options: str) -> list[dict[str, object]]:
    done = run("audit", "--outbox", url, "--json", *options)
    assert done.exit_code == 0 and done.stderr == "", done.output
    doc = json.loads(done.stdout)
    assert set(doc) == {"outbox", "entries"}
    return list(doc["entries"])


def test_outbox_audit_lists_and_filters_what_the_commands_did(url: str) -> None:
    store = open_outbox(url)
    try:
        fill(store)
    finally:
        store.close()
    assert run("dlq", "purge", "--outbox", url, "--topic", "billing", "--yes").exit_code == 0
    assert run("erase", "--outbox", url, "--key", "customer-42", "--yes").exit_code == 0
    me = who()

    every = entries(url)

    assert [(e["who"], e["action"], e["count"]) for e in every] == [
        (me, "erase", 1), (me, "purge", 2), ("token:1a2b3c4d", "reveal", 1)]
    assert every[0]["filter"] == {"key_sha256": key_digest(b"customer-42")}  # never the key's bytes
    assert every[1]["filter"] == {"topic": "billing"}
    ids = [e["id"] for e in every]
    assert ids == sorted(ids, reverse=True)  # newest first
    assert [e["action"] for e in entries(url, "--who", "cli")] == ["erase", "purge"]
    assert [e["action"] for e in entries(url, "--who", me)] == ["erase", "purge"]
    assert [e["action"] for e in entries(url, "--who", "token:1a2b3c4d")] == ["reveal"]
    assert [e["action"] for e in entries(url, "--action", "erase", "--action", "reveal")] == ["erase", "reveal"]
    assert [e["action"] for e in entries(url, "--since", "1d")] == ["erase", "purge"]
    assert [e["action"] for e in entries(url, "--until", "1d")] == ["reveal"]
    assert [e["action"] for e in entries(url, "--limit", "1")] == ["erase"]
    assert entries(url, "--who", "nobody") == []

    text = run("audit", "--outbox", url, "--action", "purge")
    assert text.exit_code == 0 and text.stderr == ""
    head, row = text.stdout.splitlines()
    assert head.split() == ["id", "when", "who", "action", "count", "what"]
    assert row.split()[3:] == [me, "purge", "2", '{"topic":', '"billing"}']
    none = run("audit", "--outbox", url, "--who", "nobody")
    assert none.exit_code == 0 and none.stdout.startswith("No audit entries in ")


def test_the_shared_filter_reads_every_store_alike_and_pages_through_a_long_log(tmp_path: Path) -> None:
    sqlite = open_outbox(f"sqlite:///{tmp_path / 'o.db'}")
    stores: list[StoreAdmin] = [MemoryOutbox(), sqlite]
    try:
        base = 1_700_000_000.0
        for store in stores:
            for i in range(1200):  # more than two pages of `read_audit`
                store.add_audit(who="retention" if i % 3 else "cli:bob", action="purge", filter="{}", count=i,
                                at=base + i)
        for store in stores:
            bobs = read_audit(store, AuditQuery(who="cli", limit=1000))
            assert [e.count for e in bobs] == list(range(1197, -1, -3))  # all 400, newest first
            window = AuditQuery(who="retention", since=base + 1100, until=base + 1150, limit=1000)
            assert [e.count for e in read_audit(store, window)] == [i for i in range(1149, 1099, -1) if i % 3]
            page = read_audit(store, AuditQuery(before_id=bobs[0].id, limit=2))
            assert [e.id for e in page] == [bobs[0].id - 1, bobs[0].id - 2]
    finally:
        sqlite.close()
