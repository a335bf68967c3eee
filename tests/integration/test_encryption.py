"""Encryption at rest with a real Kafka cluster, over SQLite and PostgreSQL: what an outage
stores is unreadable where it is stored (the file and its WAL; the table read raw), and it
reaches Kafka intact once the cluster (and the right key) is there."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from outbox import Drainer, ResilientProducer
from outbox.errors import DecryptionError
from outbox.stores import Outbox, open_outbox
from outbox.stores.encryption import Key, KeyRing
from outbox.stores.urls import parse_url

from ..waiting import wait_until

MARKER = b"IBAN-DE89370400440532013000"
HEADER_MARKER = b"card-holder-ALICE-EXAMPLE"
OLD = Key(bytes(range(32)))
NEW = Key(bytes(range(50, 82)))


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'o.db'}"
    return str(request.getfixturevalue("fresh_postgres_url"))


def raw_bytes(url: str) -> bytes:
    """What the store holds, read past the library: the SQLite file and its WAL, or every row of
    the PostgreSQL table as COPY gives it (bytea columns included)."""
    parsed = parse_url(url)
    if parsed.kind == "sqlite":
        path = Path(parsed.path)
        wal = Path(f"{path}-wal")
        return path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")
    import psycopg

    out = b""
    with psycopg.connect(**parsed.psycopg_kwargs()) as conn, conn.cursor().copy(
        f'COPY (SELECT * FROM "{parsed.schema}"."{parsed.table}") TO STDOUT (FORMAT BINARY)'
    ) as copy:
        for chunk in copy:
            out += bytes(chunk)
    return out


def opened(url: str, encryption: Key | KeyRing | None = None) -> Outbox:
    store = open_outbox(url, create=False)
    store.set_encryption(encryption if not isinstance(encryption, Key) else KeyRing([encryption]))
    return store


def spill(url: str, topic: str, n: int, ring: KeyRing) -> None:
    """`n` messages produced while no broker answers: every one is stored, encrypted."""
    with ResilientProducer(
        {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 1000},
        outbox=url, drain_workers=0, encryption=ring, circuit_failure_threshold=1,
        circuit_reset_timeout=3600,
    ) as p:
        for i in range(n):
            p.produce(topic, MARKER + b"-%d" % i, key=b"k%d" % (i % 7), headers=[("card", HEADER_MARKER)])
        wait_until(lambda: p.stats()["in_memory"] == 0 and p.stats()["unsaved"] == 0, 60, "all stored")
    store = opened(url, ring)
    try:
        assert store.stats(now=time.time()).pending == n
    finally:
        store.close()


def check_delivered(got: list[Any], n: int) -> None:
    assert sorted(m.value() for m in got) == sorted(MARKER + b"-%d" % i for i in range(n))
    for m in got:
        assert ("card", HEADER_MARKER) in (m.headers() or [])
    by_key: dict[bytes, list[int]] = {}
    for m in got:
        by_key.setdefault(m.key(), []).append(int(m.value().rsplit(b"-", 1)[1]))
    assert all(seq == sorted(seq) for seq in by_key.values())  # each key in order


def test_an_outage_is_stored_encrypted_and_delivered_intact(
    kafka_bootstrap: str, topic: str, url: str, consume_all: Callable[..., list[Any]]
) -> None:
    n = 300
    spill(url, topic, n, KeyRing([OLD]))
    data = raw_bytes(url)
    assert MARKER not in data and HEADER_MARKER not in data
    assert topic.encode() in data  # topics stay in clear (docs/encryption.md): the read finds text
    store = opened(url)
    try:
        result = Drainer(store, {"bootstrap.servers": kafka_bootstrap}, encryption=OLD).run(until_empty=True)
        assert result.delivered == n and result.dead == 0
    finally:
        store.close()
    check_delivered(consume_all(topic, n), n)


def test_a_missing_or_wrong_key_keeps_every_row_pending_until_the_right_key_sends_them(
    kafka_bootstrap: str, topic: str, url: str, consume_all: Callable[..., list[Any]]
) -> None:
    n = 50
    spill(url, topic, n, KeyRing([OLD]))
    for given in (None, NEW):
        store = opened(url)
        try:
            with pytest.raises(DecryptionError, match=f"key {OLD.id}") as info:
                Drainer(store, {"bootstrap.servers": kafka_bootstrap}, encryption=given).run(until_empty=True)
            assert info.value.key_id == OLD.id
            stats = store.stats(now=time.time())
            assert (stats.pending, stats.dead, stats.leased) == (n, 0, 0)
        finally:
            store.close()
    # The right key, in a producer whose drain runs in a process of its own.
    with ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap}, outbox=url, drain_in="process",
        encryption=[NEW, OLD], drain_poll_interval=0.2,
    ) as p:
        wait_until(lambda: p.stats()["pending"] == 0, 60, "the outbox is drained")
        assert p.stats()["dead"] == 0
    check_delivered(consume_all(topic, n), n)


def test_rotated_rows_deliver_with_the_new_key_alone(
    kafka_bootstrap: str, topic: str, url: str, consume_all: Callable[..., list[Any]]
) -> None:
    n = 120
    spill(url, topic, n, KeyRing([OLD]))
    store = opened(url, KeyRing([NEW, OLD]))
    try:
        rotation = store.rotate_keys(now=time.time(), batch=1)
        assert rotation.reencrypted == n and rotation.left == 0
        assert store.encrypted_key_ids() == [NEW.id]
    finally:
        store.close()
    assert MARKER not in raw_bytes(url)
    store = opened(url)
    try:
        result = Drainer(store, {"bootstrap.servers": kafka_bootstrap}, encryption=NEW).run(until_empty=True)
        assert result.delivered == n and result.dead == 0
    finally:
        store.close()
    check_delivered(consume_all(topic, n), n)


def test_a_dead_letter_edited_while_a_rotation_seals_it_keeps_the_edit(
    topic: str, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotation seals a page between its read and its write: an edit that lands in between is
    kept (not overwritten with the old value sealed again), and the rest is rotated."""
    from outbox.records import NewMessage

    n = 50
    spill(url, topic, n, KeyRing([OLD]))
    store = opened(url, OLD)
    try:
        (dead,) = store.add_dead([NewMessage(topic, MARKER, b"k", [("card", HEADER_MARKER)], msg_id="d-1")],
                                 failed_at=time.time())
    finally:
        store.close()
    rotating = opened(url, KeyRing([NEW, OLD]))
    read_page = rotating._rotation_page  # type: ignore[attr-defined]

    def page_then_edit(*args: Any) -> Any:
        page = read_page(*args)
        if any(row.id == dead for row in page):  # an operator edits the dead letter now
            assert rotating.redrive_edited(dead, value=b"edited", headers=[], now=time.time())
        return page

    monkeypatch.setattr(rotating, "_rotation_page", page_then_edit)
    try:
        rotation = rotating.rotate_keys(now=time.time())
        assert (rotation.reencrypted, rotation.left) == (n, 0)  # the edit sealed the dead letter itself
        assert rotating.encrypted_key_ids() == [NEW.id]
    finally:
        rotating.close()
    only_new = opened(url, NEW)
    try:
        got = {m.id: m.value for m in only_new.messages()}
        assert got.pop(dead) == b"edited"
        assert sorted(got.values()) == sorted(MARKER + b"-%d" % i for i in range(n))
    finally:
        only_new.close()
    assert MARKER not in raw_bytes(url)


def test_the_console_reads_and_edits_an_encrypted_outbox_and_names_a_missing_key(url: str) -> None:
    from fastapi.testclient import TestClient

    from outbox.records import NewMessage
    from outbox.ui import create_app

    store = open_outbox(url)
    store.set_encryption(KeyRing([OLD]))
    try:
        [d] = store.add_dead([NewMessage("t", MARKER, key=b"k", headers=[("card", HEADER_MARKER)])],
                             failed_at=time.time())
        c = TestClient(create_app(store), base_url="http://localhost")
        doc = c.get(f"/api/dead-letters/{d}").json()
        assert doc["value"] == MARKER.decode()
        r = c.post(f"/api/dead-letters/{d}/redrive", json={"value": MARKER.decode() + "-edited"})
        assert r.status_code == 200 and r.json()["status"] == "pending"
        assert store.get(d).value == MARKER + b"-edited"
        assert MARKER not in raw_bytes(url)  # the edit is stored encrypted too
    finally:
        store.close()
    keyless = open_outbox(url, create=False)
    try:
        r = TestClient(create_app(keyless), base_url="http://localhost").get(f"/api/dead-letters/{d}")
        assert r.status_code == 503 and OLD.id in r.json()["error"]
        assert keyless.stats(now=time.time()).pending == 1
    finally:
        keyless.close()


def test_outbox_drain_names_a_missing_key_then_delivers_with_key_file(
    kafka_bootstrap: str, topic: str, url: str, tmp_path: Path, consume_all: Callable[..., list[Any]]
) -> None:
    from click.testing import CliRunner
    from outbox_cli.main import cli

    n = 40
    spill(url, topic, n, KeyRing([OLD]))
    key_file = tmp_path / "old.key"
    key_file.write_text(bytes(range(32)).hex())
    wrong_file = tmp_path / "new.key"
    wrong_file.write_bytes(bytes(range(50, 82)))
    env = {"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": "", "OUTBOX_ENCRYPTION_KEYS": ""}
    args = ["drain", "--outbox", url, "-b", kafka_bootstrap]
    store = opened(url, OLD)
    try:
        ids = [m.id for m in store.messages()]  # the ids `outbox dlq list` and `dlq show` use
    finally:
        store.close()
    for given, why in (([], "but no encryption key was given"),
                       (["--key-file", str(wrong_file)], f"which is not among the given keys \\({NEW.id}\\)")):
        failed = CliRunner().invoke(cli, [*args, *given], env=env, catch_exceptions=False)
        assert failed.exit_code == 1, failed.output
        (line,) = failed.stderr.splitlines()  # one line: no worker or settling lines beside it
        # (The topic as the line shows it: the command masks the test bed's password, a word in it.)
        named = re.fullmatch(
            rf"Error: messages? (\d+)(?: to (\d+))?(?: \(topic [^)]+\))?: encrypted with key "
            rf"{OLD.id}, {why}", line)
        assert named is not None, line
        first, last = int(named[1]), int(named[2] or named[1])
        assert first == min(ids) and set(range(first, last + 1)) <= set(ids)  # the first claimed row's messages
        as_json = CliRunner().invoke(cli, [*args, *given, "--json"], env=env, catch_exceptions=False)
        assert as_json.exit_code == 1 and as_json.stderr == ""
        assert json.loads(as_json.stdout) == {
            "error": {"type": "error", "message": line.removeprefix("Error: "), "exit_code": 1}}
        store = opened(url)
        try:
            stats = store.stats(now=time.time())
            assert (stats.pending, stats.dead, stats.leased) == (n, 0, 0)
        finally:
            store.close()
    keyed = CliRunner().invoke(cli, [*args, "--key-file", str(key_file)], env=env, catch_exceptions=False)
    assert keyed.exit_code == 0, keyed.output
    check_delivered(consume_all(topic, n), n)
