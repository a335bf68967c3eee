"""`outbox dlq` on a ResilientConsumer's dead letters: origin shown, --group filter, replay to the group's tier."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from outbox_cli.main import cli

from outbox.consumer import headers as H
from outbox.records import Headers, NewMessage, Status
from outbox.stores import SQLiteOutbox


def run(*args: str) -> Result:
    return CliRunner().invoke(
        cli, list(args), env={"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""}, catch_exceptions=False
    )


def consumer_headers(group: str, offset: int) -> Headers:
    return [
        ("app", b"kept"),
        ("outbox-id", f"id-{group}-{offset}".encode()),
        (H.ORIGINAL_TOPIC, b"orders"),
        (H.ORIGINAL_PARTITION, b"2"),
        (H.ORIGINAL_OFFSET, str(offset).encode()),
        (H.ORIGINAL_TIMESTAMP, b"1700000000000"),
        (H.GROUP, group.encode()),
        (H.ATTEMPT, b"4"),
        (H.ERROR_CLASS, b"builtins.TimeoutError"),
        (H.ERROR_MESSAGE, "downstream timed out: é".encode()),
        (H.SPRING_ORIGINAL_TOPIC, b"orders"),
    ]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[str]:
    """Dead letters: 1 = billing's, 2 = shipping's, 3 = a producer's (no consumer headers)."""
    path = str(tmp_path / "outbox.db")
    store = SQLiteOutbox(path)
    now = time.time()
    store.add_dead(
        [
            NewMessage("orders.billing.retry-1", b"v1", b"k1", consumer_headers("billing", 17), 2, "id-b", 4,
                       now - 60, "builtins.TimeoutError (consumer): downstream timed out"),
            NewMessage("orders.shipping.retry-1", b"v2", b"k2", consumer_headers("shipping", 18), 2, "id-s", 4,
                       now - 60, "builtins.TimeoutError (consumer): downstream timed out"),
            NewMessage("payments", b"v3", b"k3", [("outbox-id", b"id-p")], -1, "id-p", 3, now - 60,
                       "MSG_SIZE_TOO_LARGE (10): Broker: Message size too large"),
        ],
        failed_at=now,
    )
    store.close()
    yield f"sqlite:///{path}"


def test_list_shows_the_origin_of_consumer_dead_letters(db: str) -> None:
    r = run("dlq", "list", "--outbox", db)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[:3] == ["ID", "TOPIC", "ORIGIN"]
    assert "billing: orders [2] @17" in lines[1] and "orders.billing.retry-1" in lines[1]
    assert "shipping: orders [2] @18" in lines[2]
    assert lines[3].split()[2] == "-"  # a producer's dead letter has no origin


def test_list_by_group_and_json_carries_the_consumer_metadata(db: str) -> None:
    r = run("dlq", "list", "--outbox", db, "--group", "billing", "--json")
    assert r.exit_code == 0, r.output
    docs = json.loads(r.output)
    assert [d["id"] for d in docs] == [1]
    assert docs[0]["consumer"] == {
        "group": "billing",
        "original_topic": "orders",
        "original_partition": 2,
        "original_offset": 17,
        "original_timestamp_ms": 1700000000000,
        "attempt": 4,
        "error_class": "builtins.TimeoutError",
        "error_message": "downstream timed out: é",
    }
    r = run("dlq", "list", "--outbox", db, "--group", "nobody")
    assert r.output.strip() == "No dead letters matching group nobody."


def test_show_prints_group_origin_and_exception(db: str) -> None:
    r = run("dlq", "show", "1", "--outbox", db)
    assert r.exit_code == 0, r.output
    text = r.output
    for expected in ("consumer group", "billing", "original topic", "original offset", "17",
                     "exception", "builtins.TimeoutError", "downstream timed out: é"):
        assert expected in text, expected


def test_replay_of_a_group_goes_to_its_first_retry_tier_only(db: str) -> None:
    r = run("dlq", "replay", "--outbox", db, "--group", "billing")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Replayed 1 dead letter(s)")
    store = SQLiteOutbox(db.removeprefix("sqlite:///"))
    try:
        one, two, three = store.get(1), store.get(2), store.get(3)
    finally:
        store.close()
    assert one.status is Status.PENDING and one.topic == "orders.billing.retry-1" and one.attempts == 0
    assert one.headers == consumer_headers("billing", 17)  # byte for byte
    assert two.status is Status.DEAD and three.status is Status.DEAD
    r = run("dlq", "purge", "--outbox", db, "--group", "shipping", "--yes")
    assert r.output.strip() == "Removed 1 dead letter(s)."
    r = run("dlq", "purge", "--outbox", db, "--group", "billing", "--yes")
    assert r.output.strip() == "No dead letters matching group billing; removed 0."
