"""The `outbox` command line, through click's CliRunner, against real SQLite outboxes.

The outboxes are filled through the store API (enqueue / add_dead); each test reads back both
what the command printed and what the store holds afterwards.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from outbox_cli.common import parse_time
from outbox_cli.format import as_text, duration, render_bytes, short_bytes, size
from outbox_cli.main import cli

from outbox.records import NewMessage, Status
from outbox.stores import SQLiteOutbox

HOUR = 3600.0
TIMED_OUT = "_MSG_TIMED_OUT (-192): Local: Message timed out"
TOO_LARGE = "MSG_SIZE_TOO_LARGE (10): Broker: Message size too large"


def run(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
    runner = CliRunner()
    base = {"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""}
    # An empty env var counts as unset for click, so the machine's own settings cannot leak in.
    return runner.invoke(cli, list(args), input=input, env={**base, **(env or {})}, catch_exceptions=False)


def one_error_line(result: Result) -> str:
    """The command's stderr, which must be exactly one `Error: ...` line, and no traceback."""
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), lines
    return lines[0][len("Error: ") :]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[tuple[str, SQLiteOutbox]]:
    """An outbox with 3 pending messages and 3 dead letters, with known times.

    Ids: 1-3 pending (orders x2, payments), 4 = dead orders timed out 3h ago (binary key/value,
    headers), 5 = dead payments too large 1h ago (JSON text value), 6 = dead orders timed out
    10 minutes ago (long binary value).
    """
    path = str(tmp_path / "outbox.db")
    store = SQLiteOutbox(path)
    now = time.time()
    store.enqueue(
        [
            NewMessage(topic="orders", value=b"order-1", key=b"k1", msg_id="p1"),
            NewMessage(topic="orders", value=b"order-2", key=b"k2", msg_id="p2"),
            NewMessage(topic="payments", value=b"pay-1", key=None, msg_id="p3"),
        ]
    )
    store.add_dead(
        [
            NewMessage(
                topic="orders",
                value=b"\x00\x01\xfe\xff",
                key=b"\x00\x9f",
                headers=[("trace", b"abc"), ("bin", b"\x00\x01"), ("empty", None), ("trace", b"def")],
                msg_id="d1",
                attempts=3,
                first_failed_at=now - 3 * HOUR,
                last_error=TIMED_OUT,
                error_code=-192,
                error_name="_MSG_TIMED_OUT",
            )
        ],
        failed_at=now - 3 * HOUR,
    )
    store.add_dead(
        [
            NewMessage(
                topic="payments",
                value=b'{"amount": 12}\nsecond line',
                key=b"customer-7",
                msg_id="d2",
                attempts=1,
                first_failed_at=now - HOUR,
                last_error=TOO_LARGE,
                error_code=10,
                error_name="MSG_SIZE_TOO_LARGE",
            )
        ],
        failed_at=now - HOUR,
    )
    store.add_dead(
        [
            NewMessage(
                topic="orders",
                value=bytes(range(256)) * 2,
                key=b"k9",
                msg_id="d3",
                attempts=3,
                first_failed_at=now - 600,
                last_error=TIMED_OUT,
                error_code=-192,
                error_name="_MSG_TIMED_OUT",
            )
        ],
        failed_at=now - 600,
    )
    yield path, store
    store.close()


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- help, version ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["drain"],
        ["status"],
        ["dlq"],
        ["dlq", "list"],
        ["dlq", "show"],
        ["dlq", "purge"],
        ["dlq", "replay"],
    ],
)
def test_every_command_has_help_with_examples(args: list[str]) -> None:
    result = run(*args, "--help")
    assert result.exit_code == 0
    assert "Examples:" in result.output
    assert "outbox " in result.output
    if args != ["dlq"]:
        assert "Exit codes:" in result.output
        for code in ("0 ", "1 ", "2 ", "3 ", "4 ", "130"):
            assert f"\n    {code}" in result.output


def test_help_documents_env_vars_time_format_and_exit_codes() -> None:
    top = run("--help").output
    assert "without a zone it is UTC" in top
    assert "130" in top
    drain = run("drain", "--help").output
    assert "OUTBOX_URL" in drain and "KAFKA_BOOTSTRAP_SERVERS" in drain
    assert "--max-attempts" in drain and "default: 3" in drain
    assert "--backoff [fixed|exponential]" in drain


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0
    assert result.output.startswith("outbox, version ")


# -- status -----------------------------------------------------------------------------------


def test_status_text(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    result = run("status", "--outbox", path)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"outbox          sqlite:///{path}" in out
    assert "pending         3\n" in out
    assert "dead letters    3\n" in out
    assert "next due        now" in out
    assert "oldest pending  " in out and "ago)" in out
    assert "file size       " in out and "write-ahead log" in out
    assert "pending by topic:\n  orders    2\n  payments  1\n" in out
    assert "dead letters by topic:\n  orders    2\n  payments  1\n" in out
    assert f"dead letters by error:\n  _MSG_TIMED_OUT (-192)    2\n  {TOO_LARGE.split(':')[0]}  1" in out


def test_status_json(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    result = run("status", "--outbox", path, "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["outbox"] == f"sqlite:///{path}"
    assert doc["pending"] == 3 and doc["dead"] == 3 and doc["leased"] == 0
    assert doc["pending_by_topic"] == {"orders": 2, "payments": 1}
    assert doc["dead_by_topic"] == {"orders": 2, "payments": 1}
    assert doc["dead_by_error"] == {"_MSG_TIMED_OUT (-192)": 2, "MSG_SIZE_TOO_LARGE (10)": 1}
    assert doc["file_bytes"] == os.path.getsize(path)
    assert doc["next_due_in_seconds"] == 0
    assert 0 <= doc["oldest_pending_age_seconds"] < 60
    assert doc["oldest_pending_at"].endswith("Z")


def test_status_empty_outbox_and_env_default(tmp_path: Path) -> None:
    path = str(tmp_path / "empty.db")
    SQLiteOutbox(path).close()
    result = run("status", "--json", env={"OUTBOX_URL": f"sqlite:///{path}"})
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert (doc["pending"], doc["dead"], doc["oldest_pending_at"], doc["next_due_at"]) == (0, 0, None, None)
    text = run("status", env={"OUTBOX_URL": path}).stdout
    assert "pending         0" in text and "next due" not in text


def test_status_shows_leased_rows_and_future_due_time(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    store.claim("someone", 1, 300, now=time.time())
    out = run("status", "--outbox", path).stdout
    assert "pending         3 (1 leased now)" in out
    store.claim("someone", 10, 300, now=time.time())
    out = run("status", "--outbox", path).stdout
    assert re.search(r"\nnext due        \S+ \S+ \(in [45]m \d+s\)\n", out), out


# -- dlq list ---------------------------------------------------------------------------------


def test_dlq_list_text(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    result = run("dlq", "list", "--outbox", path)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "ID",
        "TOPIC",
        "KEY",
        "SIZE",
        "ATTEMPTS",
        "FIRST",
        "FAILED",
        "LAST",
        "FAILED",
        "ERROR",
    ]
    assert [line.split()[0] for line in lines[1:]] == ["4", "5", "6"]
    row4, row5, row6 = lines[1:]
    assert row4.split()[1:5] == ["orders", "0x009f", "4", "3"]
    assert row4.endswith(TIMED_OUT)
    assert row5.split()[1:5] == ["payments", "customer-7", "26", "1"]
    assert row5.endswith(TOO_LARGE)
    assert row6.split()[1:5] == ["orders", "k9", "512", "3"]


def test_dlq_list_json_items_carry_id(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    result = run("dlq", "list", "--outbox", path, "--json")
    docs = json.loads(result.stdout)
    assert isinstance(docs, list) and [d["id"] for d in docs] == [4, 5, 6]
    d4 = docs[0]
    assert d4["status"] == "dead" and d4["topic"] == "orders" and d4["attempts"] == 3
    assert (d4["key"], d4["key_encoding"]) == ("009f", "hex")
    assert (d4["value"], d4["value_encoding"]) == ("0001feff", "hex")
    assert d4["last_error"] == TIMED_OUT and d4["msg_id"] == "d1"
    assert docs[1]["value"] == '{"amount": 12}\nsecond line' and docs[1]["value_encoding"] == "utf-8"
    assert docs[2]["value_encoding"] == "base64"
    assert base64.b64decode(docs[2]["value"]) == bytes(range(256)) * 2


@pytest.mark.parametrize(
    ("args", "ids"),
    [
        (["--topic", "orders"], [4, 6]),
        (["--topic", "nope"], []),
        (["--error", "_MSG_TIMED_OUT"], [4, 6]),
        (["--error", "msg_timed_out"], [4, 6]),
        (["--error", "-192"], [4, 6]),
        (["--error", "10"], [5]),
        (["--error", "MSG_SIZE_TOO_LARGE"], [5]),
        (["--since", "2h"], [5, 6]),
        (["--since", "30m"], [6]),
        (["--until", "30m"], [4, 5]),
        (["--since", "4h", "--until", "2h"], [4]),
        (["--since", "1d", "--topic", "orders", "--error", "-192", "--limit", "1"], [4]),
        (["--limit", "2"], [4, 5]),
    ],
)
def test_dlq_list_filters(db: tuple[str, SQLiteOutbox], args: list[str], ids: list[int]) -> None:
    path, _ = db
    result = run("dlq", "list", "--outbox", path, "--json", *args)
    assert result.exit_code == 0, result.output
    assert [d["id"] for d in json.loads(result.stdout)] == ids


def test_dlq_list_iso_times(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    t5 = store.get(5).last_failed_at
    assert t5 is not None
    naive_utc = datetime.fromtimestamp(t5 - 1, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    result = run("dlq", "list", "--outbox", path, "--json", "--since", naive_utc, "--until", "15m")
    assert [d["id"] for d in json.loads(result.stdout)] == [5]
    # The same instant written with a +02:00 offset selects the same dead letters.
    shifted = datetime.fromtimestamp(t5 - 1, UTC).astimezone(datetime.fromisoformat("2024-01-01T00:00+02:00").tzinfo)
    result = run("dlq", "list", "--outbox", path, "--json", "--since", shifted.isoformat(), "--until", "15m")
    assert [d["id"] for d in json.loads(result.stdout)] == [5]


def test_dlq_list_nothing_matches(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    result = run("dlq", "list", "--outbox", path, "--topic", "nope")
    assert result.exit_code == 0
    assert result.stdout == "No dead letters matching topic nope.\n"
    assert json.loads(run("dlq", "list", "--outbox", path, "--topic", "nope", "--json").stdout) == []


# -- dlq show ---------------------------------------------------------------------------------


def test_dlq_show_binary_message(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    result = run("dlq", "show", "4", "--outbox", path)
    assert result.exit_code == 0
    out = result.stdout
    assert "id            4\n" in out
    assert "message id    d1\n" in out
    assert "status        dead\n" in out
    assert "topic         orders\n" in out
    assert "partition     any\n" in out
    assert "attempts      3\n" in out
    assert f"last error    {TIMED_OUT}\n" in out
    assert "key           009f (hex, 2 bytes)\n" in out
    assert "headers (4):\n  trace: abc\n  bin: 0001 (hex)\n  empty: null\n  trace: def\n" in out
    assert out.endswith("value (hex, 4 bytes):\n0001feff\n")
    # Never a raw control byte on the terminal.
    assert "\x00" not in out


def test_dlq_show_text_and_long_binary(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    out = run("dlq", "show", "5", "--outbox", path).stdout
    assert "key           customer-7\n" in out
    assert out.endswith('value (utf-8, 26 bytes):\n{"amount": 12}\nsecond line\n')
    out = run("dlq", "show", "6", "--outbox", path).stdout
    b64 = base64.b64encode(bytes(range(256)) * 2).decode()
    assert out.endswith(f"value (base64, 512 bytes):\n{b64}\n")


def test_dlq_show_forced_encoding_and_json(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    out = run("dlq", "show", "5", "--outbox", path, "--encoding", "hex").stdout
    hexed = b'{"amount": 12}\nsecond line'.hex()
    assert out.endswith(f"value (hex, 26 bytes):\n{hexed}\n")
    doc = json.loads(run("dlq", "show", "4", "--outbox", path, "--json", "--encoding", "base64").stdout)
    assert doc["id"] == 4 and doc["value_encoding"] == "base64"
    assert base64.b64decode(doc["value"]) == b"\x00\x01\xfe\xff"
    assert doc["headers"] == [
        {"name": "trace", "value": "YWJj", "encoding": "base64"},
        {"name": "bin", "value": "AAE=", "encoding": "base64"},
        {"name": "empty", "value": None, "encoding": None},
        {"name": "trace", "value": "ZGVm", "encoding": "base64"},
    ]
    assert doc["first_failed_at"].endswith("Z") and doc["last_error"] == TIMED_OUT


def test_dlq_show_refuses_a_pending_message(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "show", "1", "--outbox", path)
    assert result.exit_code == 1
    assert one_error_line(result) == "message 1 is pending, not a dead letter (`outbox status` shows what is pending)"
    assert result.stdout == ""
    assert store.get(1).status is Status.PENDING


def test_dlq_show_unknown_id(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    result = run("dlq", "show", "99", "--outbox", path)
    assert result.exit_code == 1
    assert one_error_line(result) == f"no message with id 99 in outbox {path}"
    assert result.stdout == ""


# -- dlq purge --------------------------------------------------------------------------------


def test_dlq_purge_by_filter_with_yes(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "purge", "--outbox", path, "--topic", "orders", "--yes")
    assert result.exit_code == 0
    assert result.stdout == "Removed 2 dead letter(s).\n"
    assert [r.id for r in store.list_dead()] == [5]
    assert store.stats(now=time.time()).pending == 3  # pending messages are never purged


def test_dlq_purge_asks_for_confirmation(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "purge", "--outbox", path, "--error", "-192", input="n\n")
    assert result.exit_code == 1
    assert (
        f"Delete 2 dead letter(s) matching error -192 from sqlite:///{path}? This cannot be undone [y/N]: "
        in result.stderr
    )
    assert "Aborted" in result.stderr
    assert len(store.list_dead()) == 3
    result = run("dlq", "purge", "--outbox", path, "--error", "-192", input="y\n")
    assert result.exit_code == 0
    assert result.stdout == "Removed 2 dead letter(s).\n"
    assert [r.id for r in store.list_dead()] == [5]


def test_dlq_purge_without_terminal_or_yes_aborts(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "purge", "--outbox", path)
    assert result.exit_code == 1
    assert len(store.list_dead()) == 3


def test_dlq_purge_by_id_and_json(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "purge", "--outbox", path, "--id", "4", "--id", "6", "--yes", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"outbox": f"sqlite:///{path}", "removed": 2}
    assert [r.id for r in store.list_dead()] == [5]


def test_dlq_purge_everything_and_nothing_left(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    assert run("dlq", "purge", "--outbox", path, "-y").stdout == "Removed 3 dead letter(s).\n"
    assert store.list_dead() == []
    result = run("dlq", "purge", "--outbox", path)  # nothing to confirm
    assert result.exit_code == 0
    assert result.stdout == "No dead letters; removed 0.\n"


def test_dlq_purge_older_than_deletes_by_the_age_of_the_last_failure_and_audits_it(
    db: tuple[str, SQLiteOutbox],
) -> None:
    path, store = db
    result = run("dlq", "purge", "--outbox", path, "--older-than", "2h", "--yes")
    assert result.exit_code == 0, result.output
    assert result.stdout == "Removed 1 dead letter(s).\n"
    assert [r.id for r in store.list_dead()] == [5, 6]  # failed 1 h and 10 min ago
    [entry] = store.audit_log()
    assert (entry.action, entry.count) == ("purge", 1)
    assert entry.who.startswith("cli")
    assert time.time() - 2 * HOUR - 5 < json.loads(entry.filter)["until"] <= time.time() - 2 * HOUR
    # Combined with the other filters; with --until, the earlier bound holds (the payment failed 1 h ago).
    result = run("dlq", "purge", "--outbox", path, "--older-than", "5m", "--topic", "payments", "--until", "2h",
                 "--yes")
    assert result.stdout.startswith("No dead letters matching topic payments, failed before ")
    assert result.stdout.endswith("; removed 0.\n")
    assert run("dlq", "purge", "--outbox", path, "--older-than", "5m", "--topic", "payments", "--yes").stdout == (
        "Removed 1 dead letter(s).\n")
    assert [r.id for r in store.list_dead()] == [6]


def test_dlq_purge_goes_in_batches_each_audited(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    store.add_dead([NewMessage("bulk", b"%d" % i, None) for i in range(2100)], failed_at=time.time() - 30 * 86400)
    result = run("dlq", "purge", "--outbox", path, "--older-than", "1w", "--json", "--yes")
    assert json.loads(result.stdout) == {"outbox": f"sqlite:///{path}", "removed": 2100}
    assert [e.count for e in store.audit_log()] == [100, 1000, 1000]
    assert store.count_dead() == 3


@pytest.mark.parametrize("duration", ["7x", "0s", "-1d", "1d ago", "7", "", "2024-05-01"])
def test_dlq_purge_bad_duration_is_a_usage_error_and_deletes_nothing(
    db: tuple[str, SQLiteOutbox], duration: str
) -> None:
    path, store = db
    result = run("dlq", "purge", "--outbox", path, "--older-than", duration, "--yes")
    assert result.exit_code == 2
    assert one_error_line(result) == (
        f"--older-than: cannot read the duration {duration!r}: use a number above 0 and a unit, s, m, h, d or w "
        "(90s, 30m, 12h, 7d, 2w)")
    assert len(store.list_dead()) == 3 and store.audit_log() == []


def test_dlq_purge_older_than_is_a_filter_not_to_combine_with_ids(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "purge", "--outbox", path, "--id", "4", "--older-than", "1h", "--yes")
    assert result.exit_code == 2
    assert one_error_line(result).startswith("--id cannot be combined with --older-than: ")
    result = run("dlq", "purge", "--outbox", path, "--since", "1d", "--older-than", "2d", "--yes")
    assert result.exit_code == 2
    assert one_error_line(result).startswith("--since (")
    assert ") is not before --older-than (" in result.stderr
    assert len(store.list_dead()) == 3


@pytest.mark.parametrize("command", ["purge", "replay"])
def test_dlq_unknown_or_pending_id_is_an_error(db: tuple[str, SQLiteOutbox], command: str) -> None:
    path, store = db
    yes = ["--yes"] if command == "purge" else []
    result = run("dlq", command, "--outbox", path, "--id", "4", "--id", "77", *yes)
    assert result.exit_code == 1
    assert one_error_line(result) == f"no message with id 77 in outbox {path}"
    result = run("dlq", command, "--outbox", path, "--id", "2", *yes)
    assert result.exit_code == 1
    assert one_error_line(result) == "message 2 is pending, not a dead letter"
    assert len(store.list_dead()) == 3  # nothing was touched


# -- dlq replay -------------------------------------------------------------------------------


def test_dlq_replay_by_id_keeps_bytes_and_resets_attempts(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    before = store.get(4)
    result = run("dlq", "replay", "--outbox", path, "--id", "4")
    assert result.exit_code == 0
    assert result.stdout == (
        "Replayed 1 dead letter(s) into the pending queue, attempts reset; `outbox drain` sends them.\n"
    )
    after = store.get(4)
    assert after.status is Status.PENDING and after.attempts == 0
    assert (after.topic, after.key, after.value, after.headers) == (
        before.topic,
        before.key,
        before.value,
        before.headers,
    )
    assert after.next_attempt_at <= time.time()
    assert [r.id for r in store.list_dead()] == [5, 6]


def test_dlq_replay_filter_to_topic_json(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "replay", "--outbox", path, "--error", "_MSG_TIMED_OUT", "--to-topic", "orders.retry", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {
        "outbox": f"sqlite:///{path}",
        "replayed": 2,
        "to_topic": "orders.retry",
    }
    assert store.get(4).topic == "orders.retry" and store.get(6).topic == "orders.retry"
    assert store.get(6).value == bytes(range(256)) * 2
    assert store.stats(now=time.time()).pending_by_topic == {"orders": 2, "payments": 1, "orders.retry": 2}
    text = run("dlq", "replay", "--outbox", path, "--to-topic", "other").stdout
    assert text.startswith("Replayed 1 dead letter(s) into the pending queue addressed to topic other,")


def test_dlq_replay_nothing_and_bad_topic(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "replay", "--outbox", path, "--topic", "nope")
    assert result.exit_code == 0 and result.stdout == "No dead letters matching topic nope; replayed 0.\n"
    result = run("dlq", "replay", "--outbox", path, "--to-topic", "bad/topic")
    assert result.exit_code == 2
    assert one_error_line(result) == (
        "--to-topic: topic name 'bad/topic' has characters Kafka does not allow (only a-z A-Z 0-9 . _ -)"
    )
    result = run("dlq", "replay", "--outbox", path, "--to-topic", "..")  # Kafka's own exception
    assert result.exit_code == 2 and one_error_line(result) == "--to-topic: topic name '..' is not allowed by Kafka"
    assert len(store.list_dead()) == 3


# -- bad input: one line, exit code, no traceback ---------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["status"], ["dlq", "list"], ["dlq", "show", "1"], ["dlq", "purge", "--yes"], ["dlq", "replay"]],
)
def test_missing_outbox_file_is_reported_and_never_created(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "typo.db"
    result = run(*command, "--outbox", f"sqlite:///{missing}")
    assert result.exit_code == 1
    assert one_error_line(result) == f"outbox file {missing} does not exist"
    assert not missing.exists()


def test_drain_missing_outbox_file(tmp_path: Path) -> None:
    missing = tmp_path / "typo.db"
    result = run("drain", "--outbox", str(missing), "-b", f"127.0.0.1:{closed_port()}")
    assert result.exit_code == 1
    assert one_error_line(result) == f"outbox file {missing} does not exist"
    assert not missing.exists()


def test_unreadable_outbox(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    result = run("status", "--outbox", str(garbage))
    assert result.exit_code == 1
    assert one_error_line(result) == (
        f"outbox {garbage}: file is not a valid SQLite outbox (corrupt?): file is not a database"
    )
    result = run("dlq", "list", "--outbox", str(tmp_path))
    assert result.exit_code == 1
    assert one_error_line(result) == f"outbox {tmp_path}: unable to open database file"


def test_unknown_url_scheme() -> None:
    result = run("status", "--outbox", "oracle://app:hunter2@db/outbox")
    assert result.exit_code == 2
    assert one_error_line(result) == (
        "unknown outbox URL scheme 'oracle': use sqlite:///path.db, jdbc:sqlite:/path.db, "
        "postgresql://host/db, jdbc:postgresql://host/db or mysql://host/db"
    )


def test_postgres_password_is_never_printed() -> None:
    result = run("dlq", "list", "--outbox", f"postgresql://app:s3cr3t-pw@127.0.0.1:{closed_port()}/outbox")
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "s3cr3t-pw" not in result.output
    assert line.startswith("PostgreSQL outbox 127.0.0.1:")


def test_missing_outbox_option() -> None:
    result = run("status")
    assert result.exit_code == 2
    assert result.stderr.strip().endswith("Error: Missing option '--outbox' (env var: 'OUTBOX_URL').")


@pytest.mark.parametrize("flag", ["--since", "--until"])
def test_bad_time(db: tuple[str, SQLiteOutbox], flag: str) -> None:
    path, _ = db
    result = run("dlq", "list", "--outbox", path, flag, "last tuesday")
    assert result.exit_code == 2
    assert one_error_line(result) == (
        f"{flag}: cannot read the time 'last tuesday': use ISO-8601 (2024-05-01T12:00, UTC when no zone "
        "is given) or an age such as 30m, 2h, 1d"
    )


def test_bad_time_on_purge_deletes_nothing(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "purge", "--outbox", path, "--until", "2024-13-45", "--yes")
    assert result.exit_code == 2
    assert one_error_line(result).startswith("--until: cannot read the time '2024-13-45'")
    assert len(store.list_dead()) == 3


def test_drain_malformed_setting(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("drain", "--outbox", path, "-b", "localhost:9092", "-X", "acks")
    assert result.exit_code == 2
    assert one_error_line(result) == (
        "malformed -X #1: expected key=value, e.g. -X acks=all (not echoed: it may hold a secret)"
    )
    result = run("drain", "--outbox", path, "-b", "localhost:9092", "-X", "=all")
    assert result.exit_code == 2
    # A value typed without its key may be a password: it is not echoed whole.
    result = run("drain", "--outbox", path, "-b", "localhost:9092", "-X", "acks=all", "-X", "hunter2secret")
    assert result.exit_code == 2
    assert one_error_line(result).startswith("malformed -X #2: ")
    assert "hunter2secret" not in result.output
    assert store.stats(now=time.time()).pending == 3


def test_drain_unknown_setting(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    result = run("drain", "--outbox", path, "-b", "localhost:9092", "-X", "no.such.setting=1")
    assert result.exit_code == 2
    assert one_error_line(result) == 'Kafka producer: No such configuration property: "no.such.setting"'


def test_drain_unreachable_cluster_leaves_everything_pending(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    port = closed_port()
    result = run(
        "drain",
        "--outbox",
        path,
        "--connect-timeout",
        "1",
        "-X",
        "security.protocol=SASL_PLAINTEXT",
        "-X",
        "sasl.mechanism=PLAIN",
        "-X",
        "sasl.username=app",
        "-X",
        "sasl.password=TopSecret99",
        "--json",
        env={"KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}"},
    )
    assert result.exit_code == 3
    assert "TopSecret99" not in result.output
    assert "%3|" not in result.output  # librdkafka's connection-refused log lines are not shown
    assert result.stderr == ""  # with --json the error is the document on stdout
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "pending" and error["exit_code"] == 3
    assert error["message"].startswith(f"cannot reach Kafka: no Kafka broker answered at 127.0.0.1:{port} within 1s (")
    assert error["message"].endswith(f"nothing was sent, 3 message(s) stay pending in sqlite:///{path}")
    assert "TopSecret99" not in result.stdout
    st = store.stats(now=time.time())
    assert (st.pending, st.dead, st.leased) == (3, 3, 0)
    assert [m.attempts for m in (store.get(1), store.get(2), store.get(3))] == [0, 0, 0]


@pytest.mark.parametrize("flags", [[], ["-v"], ["--json"]])
def test_drain_leaves_the_processes_logging_as_it_found_it(db: tuple[str, SQLiteOutbox], flags: list[str]) -> None:
    """A command run inside an application (or a test session) routes the SDK's loggers only
    while it runs: afterwards their records reach the application's own handlers again."""
    path, _ = db
    names = ("outbox", "outbox_cli.librdkafka")
    before = [(lg.handlers[:], lg.level, lg.propagate) for lg in map(logging.getLogger, names)]
    result = run("drain", "--outbox", path, "--connect-timeout", "0.5", "-b", f"127.0.0.1:{closed_port()}", *flags)
    assert result.exit_code == 3
    assert [(lg.handlers[:], lg.level, lg.propagate) for lg in map(logging.getLogger, names)] == before


def test_drain_needs_bootstrap_servers(db: tuple[str, SQLiteOutbox]) -> None:
    path, _ = db
    result = run("drain", "--outbox", path)
    assert result.exit_code == 2
    assert "Missing option '--bootstrap-servers'" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "Invalid value for '--workers'"),
        (["--max-attempts", "0"], "Invalid value for '--max-attempts'"),
        (["--backoff", "linear"], "Invalid value for '--backoff'"),
        (["--initial-delay", "-1"], "Invalid value for '--initial-delay'"),
        (["--max-messages", "0"], "Invalid value for '--max-messages'"),
    ],
)
def test_drain_bad_options(db: tuple[str, SQLiteOutbox], args: list[str], message: str) -> None:
    path, _ = db
    result = run("drain", "--outbox", path, "-b", "localhost:9092", *args)
    assert result.exit_code == 2
    assert message in result.stderr


# -- helpers: TIME and value printing ---------------------------------------------------------


def test_parse_time() -> None:
    now = 1_700_000_000.0
    assert parse_time("90s", now=now) == now - 90
    assert parse_time("30m", now=now) == now - 1800
    assert parse_time("2h", now=now) == now - 7200
    assert parse_time("1d ago", now=now) == now - 86400
    assert parse_time("1.5h", now=now) == now - 5400
    assert parse_time("2w", now=now) == now - 14 * 86400
    assert parse_time("2024-05-01T12:00:00") == datetime(2024, 5, 1, 12, tzinfo=UTC).timestamp()
    assert parse_time("2024-05-01T12:00:00Z") == datetime(2024, 5, 1, 12, tzinfo=UTC).timestamp()
    assert parse_time("2024-05-01T14:00:00+02:00") == datetime(2024, 5, 1, 12, tzinfo=UTC).timestamp()
    assert parse_time("2024-05-01") == datetime(2024, 5, 1, tzinfo=UTC).timestamp()
    for bad in ("", "yesterday", "5 parsecs", "2024-02-30", "-3h"):
        with pytest.raises(ValueError):
            parse_time(bad, now=now)


def test_value_printing() -> None:
    assert render_bytes(None) == (None, None)
    assert render_bytes(b"h\xc3\xa9llo\n\tworld") == ("héllo\n\tworld", "utf-8")
    assert render_bytes(b"\x1b[31mred") == ("1b5b33316d726564", "hex")  # escape codes never raw
    assert render_bytes(b"\xff" * 65)[1] == "base64"
    assert render_bytes(b"abc", "hex") == ("616263", "hex")
    assert render_bytes(b"abc", "base64") == ("YWJj", "base64")
    assert as_text(b"\x00") is None
    assert short_bytes(None) == "-"
    assert short_bytes(b"a\nb") == "a b"
    assert short_bytes(b"x" * 40, width=10) == "xxxxxxxxx…"
    assert short_bytes(b"\x01\x02") == "0x0102"
    assert [duration(s) for s in (0, 59, 61, 3600, 3725, 90000)] == [
        "0s",
        "59s",
        "1m 1s",
        "1h 0m",
        "1h 2m",
        "1d 1h",
    ]
    assert [size(n) for n in (0, 1023, 1536, 5 * 1024 * 1024)] == ["0 B", "1023 B", "1.5 KiB", "5.0 MiB"]


def test_dlq_list_error_matches_a_consumer_exception_class(tmp_path: Path) -> None:
    """A consumer dead letter carries its exception class as error name; --error finds it as given."""
    path = str(tmp_path / "c.db")
    with SQLiteOutbox(path) as store:
        (kept,) = store.add_dead(
            [
                NewMessage(
                    "orders", b"v", error_name="builtins.ValueError", last_error="builtins.ValueError (consumer): bad"
                )
            ],
            failed_at=time.time(),
        )
        store.add_dead(
            [NewMessage("orders", b"w", error_name="_MSG_TIMED_OUT", error_code=-192)], failed_at=time.time()
        )
    result = run("dlq", "list", "--outbox", path, "--json", "--error", "builtins.ValueError")
    assert result.exit_code == 0, result.output
    assert [d["id"] for d in json.loads(result.stdout)] == [kept]
    assert (
        json.loads(run("dlq", "list", "--outbox", path, "--json", "--error", "msg_timed_out").stdout)[0]["id"] != kept
    )


# -- what a command line gets wrong is said, naming the option --------------------------------


@pytest.mark.parametrize(
    ("args", "bad"),
    [
        (("dlq", "show", "abc"), "abc"),
        (("dlq", "purge", "--id", "abc", "--yes"), "abc"),
        (("dlq", "replay", "--id", "0"), "0"),
        # One past the largest id a store holds: SQLite would raise OverflowError.
        (("dlq", "purge", "--id", "9223372036854775808", "--yes"), "9223372036854775808"),
        (("dlq", "show", "\u00b2"), "\u00b2"),  # a digit to str.isdigit(), not to int()
    ],
)
def test_a_bad_id_says_what_an_id_is(db: tuple[str, SQLiteOutbox], args: tuple[str, ...], bad: str) -> None:
    path, store = db
    result = run(*args, "--outbox", path)
    assert result.exit_code == 2
    assert (
        f"{bad!r} is not a message id: ids are whole numbers from 1 to 9223372036854775807, "
        "as `outbox dlq list` shows"
    ) in result.stderr
    assert "Traceback" not in result.stderr
    assert "integer range" not in result.stderr
    assert len(store.list_dead()) == 3


@pytest.mark.parametrize("command", ["purge", "replay"])
def test_id_with_a_filter_is_a_usage_error(db: tuple[str, SQLiteOutbox], command: str) -> None:
    """--id names dead letters exactly; a filter beside it would silently narrow it to nothing."""
    path, store = db
    yes = ["--yes"] if command == "purge" else []
    result = run("dlq", command, "--outbox", path, "--id", "4", "--topic", "payments", *yes)
    assert result.exit_code == 2
    assert one_error_line(result) == (
        "--id cannot be combined with --topic: give either ids or filters (--topic, --error, --since, "
        "--until, --group)")
    assert len(store.list_dead()) == 3 and store.get(4).status is Status.DEAD


@pytest.mark.parametrize("command", ["list", "purge", "replay"])
def test_an_empty_time_range_is_a_usage_error(db: tuple[str, SQLiteOutbox], command: str) -> None:
    path, store = db
    yes = ["--yes"] if command == "purge" else []
    result = run("dlq", command, "--outbox", path, "--since", "1h", "--until", "1d", *yes)
    assert result.exit_code == 2
    assert re.fullmatch(r"--since \(\S+ \S+Z\) is not before --until \(\S+ \S+Z\): no dead letter can match an "
                        r"empty range", one_error_line(result))
    assert len(store.list_dead()) == 3


def test_purge_json_without_yes_is_refused_without_a_prompt(db: tuple[str, SQLiteOutbox]) -> None:
    path, store = db
    result = run("dlq", "purge", "--outbox", path, "--json", input="y\n")
    assert result.exit_code == 2 and result.stderr == ""
    error = json.loads(result.stdout)["error"]
    assert (error["type"], error["message"]) == (
        "usage", "--json needs --yes: a purge asks for confirmation, and a JSON reader cannot answer it")
    assert len(store.list_dead()) == 3
