"""`outbox erase`, through click's CliRunner, against real SQLite outboxes filled through the
store API: what it prints, what the store holds afterwards, and what the audit log says."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from outbox_cli.main import cli

from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox
from outbox.stores.audited import key_digest

KEY = b"customer-42"
DIGEST = key_digest(KEY)
ONCE = "give the key once: --key TEXT, or --key-hex HEX for a key that is not text"


def run(*args: str, input: str | None = None) -> Result:
    env = {"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""}
    return CliRunner().invoke(cli, list(args), input=input, env=env, catch_exceptions=False)


def one_error_line(result: Result) -> str:
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    return lines[0][len("Error: "):]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[tuple[str, SQLiteOutbox]]:
    """40 pending messages of three keys in one group row (every third is KEY's), one more of KEY
    on topic payments, and two dead letters of KEY (orders, payments) and one of another key."""
    path = str(tmp_path / "outbox.db")
    store = SQLiteOutbox(path)
    keys = [KEY, b"customer-7", b"\x00\xff"]
    store.enqueue([NewMessage("orders", b"order-%d" % i, keys[i % 3], msg_id=f"o{i}") for i in range(40)])
    store.enqueue([NewMessage("payments", b"pay", KEY, msg_id="p1")])
    store.add_dead([NewMessage("orders", b"d", KEY, msg_id="d1"), NewMessage("payments", b"d", KEY, msg_id="d2"),
                    NewMessage("orders", b"d", b"customer-7", msg_id="d3")], failed_at=time.time())
    yield path, store
    store.close()


def keys_left(store: SQLiteOutbox) -> dict[bytes | None, int]:
    out: dict[bytes | None, int] = {}
    for m in store.messages():
        out[m.key] = out.get(m.key, 0) + 1
    return out


def test_a_dry_run_counts_and_changes_nothing(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("erase", "--outbox", path, "--key", "customer-42", "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"Would erase 17 message(s) of key sha256:{DIGEST}: 15 pending, 2 dead letter(s), 0 of them leased.\n")
    assert keys_left(store)[KEY] == 17 and store.audit_log() == []


def test_erase_asks_then_deletes_every_message_of_the_key_and_records_it(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    before = {m.msg_id: m.id for m in store.messages() if m.key != KEY}
    result = run("erase", "--outbox", path, "--key", "customer-42", input="n\n")
    assert result.exit_code == 1
    assert (f"Erase 17 message(s) of key sha256:{DIGEST} (15 pending, 2 dead letter(s), 0 of them leased) from "
            f"sqlite:///{path}? This cannot be undone [y/N]: ") in result.stderr
    assert keys_left(store)[KEY] == 17
    result = run("erase", "--outbox", path, "--key", "customer-42", input="y\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"Erased 17 message(s) of key sha256:{DIGEST}: 15 pending, 2 dead letter(s), 0 of them leased.\n")
    assert KEY not in keys_left(store)
    # The other keys' messages, split out of their group row, keep their ids.
    assert {m.msg_id: m.id for m in store.messages()} == before
    [entry] = store.audit_log()
    assert (entry.action, entry.count) == ("erase", 17) and entry.who.startswith("cli")
    assert json.loads(entry.filter) == {"key_sha256": DIGEST}
    assert "customer-42" not in result.output + entry.filter
    result = run("erase", "--outbox", path, "--key", "customer-42")  # nothing left: nothing to confirm
    assert result.stdout == f"No message of key sha256:{DIGEST} in the outbox; erased 0.\n"
    assert [e.count for e in store.audit_log()] == [0, 17]


def test_erase_of_one_topic_in_json_by_hex_key(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("erase", "--outbox", path, "--key-hex", KEY.hex(), "--topic", "payments", "--yes", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "outbox": f"sqlite:///{path}", "key_sha256": DIGEST, "topic": "payments", "dry_run": False,
        "pending": 1, "dead": 1, "leased": 0, "total": 2,
    }
    assert keys_left(store)[KEY] == 15
    assert json.loads(store.audit_log()[0].filter) == {"key_sha256": DIGEST, "topic": "payments"}
    result = run("erase", "--outbox", path, "--key-hex", "00ff", "--yes")
    binary = key_digest(bytes([0, 255]))
    assert result.stdout == (
        f"Erased 13 message(s) of key sha256:{binary}: 13 pending, 0 dead letter(s), 0 of them leased.\n")
    assert b"\x00\xff" not in keys_left(store)


def test_erase_counts_the_leased_messages_it_deleted(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    store.claim("drain@elsewhere", 100, 600, now=time.time())  # the group and the payment, leased
    result = run("erase", "--outbox", path, "--key", "customer-42", "--yes")
    assert result.stdout == (
        f"Erased 17 message(s) of key sha256:{DIGEST}: 15 pending, 2 dead letter(s), 15 of them leased.\n"
        "15 were leased to a sender: their send may have been in flight, and they may still reach Kafka.\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), ONCE),
        (("--key", "a", "--key-hex", "61"), ONCE),
        (("--key-hex", "customer-42"),
         "--key-hex: not hex (two hex digits per byte, e.g. 00ff10; the value is not echoed)"),
        (("--key", "customer-42", "--json"),
         "--json needs --yes (or --dry-run): an erasure asks for confirmation, and a JSON reader cannot answer it"),
    ],
)
def test_a_bad_command_line_is_a_usage_error_and_erases_nothing(
    db: tuple[str, SQLiteOutbox], args: tuple[str, ...], message: str
) -> None:
    path, store = db
    result = run("erase", "--outbox", path, *args)
    assert result.exit_code == 2
    if "--json" in args:
        assert json.loads(result.stdout)["error"]["message"] == message
    else:
        assert one_error_line(result) == message
    assert keys_left(store)[KEY] == 17 and store.audit_log() == []


def test_a_missing_outbox_is_an_error(tmp_path: Path) -> None:
    result = run("erase", "--outbox", str(tmp_path / "none.db"), "--key", "k", "--yes")
    assert result.exit_code == 1
    assert "none.db" in one_error_line(result)
