"""ResilientConsumer(dedup=True) against the real cluster, with a SQLite and a PostgreSQL store:
copies of an outbox-id are skipped and counted, a transactional handler's writes commit with the
mark, a failed attempt's writes are rolled back and its retry-tier copy applies it once."""

from __future__ import annotations

import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Message, Producer
from sqlalchemy.orm import Session

from outbox import ResilientConsumer, RetryTopics, StoreError
from outbox.consumer.inbox import InboxCommitFailed
from outbox.stores import open_outbox
from outbox.stores.urls import parse_url
from outbox.transactions import sqlalchemy_connection

from ..group_protocols import group_settings
from .test_consumer import running, wait_until

# id i is produced 1 + i % 3 times; two messages carry no outbox-id (handled as without dedup).
IDS = [f"id-{i}" for i in range(12)]
COPIES = sum(1 + i % 3 for i in range(12))


def produce_copies(bootstrap: str, topic: str) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    for round_ in range(3):
        for i, mid in enumerate(IDS):
            if round_ <= i % 3:
                p.produce(topic, mid.encode(), key=mid.encode(), headers=[("outbox-id", mid.encode())])
    p.produce(topic, b"anonymous", key=b"a")
    p.produce(topic, b"anonymous", key=b"a")
    assert p.flush(30) == 0


def store_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'consumer.db'}"
    return str(request.getfixturevalue("fresh_postgres_url"))


def effects(url: str) -> list[tuple[str, int]]:
    """Rows per value in the handler's table."""
    sql = "SELECT v, count(*) FROM effects GROUP BY v ORDER BY v"
    if url.startswith("sqlite"):
        with sqlite3.connect(parse_url(url).path) as c:
            return list(c.execute(sql))
    import psycopg

    with psycopg.connect(**parse_url(url).psycopg_kwargs()) as c:  # type: ignore[arg-type]
        return [(v, int(n)) for v, n in c.execute(sql)]


def create_effects(url: str) -> None:
    sql = "CREATE TABLE effects (v TEXT NOT NULL)"
    if url.startswith("sqlite"):
        with sqlite3.connect(parse_url(url).path) as c:
            c.execute(sql)
        return
    import psycopg

    with psycopg.connect(**parse_url(url).psycopg_kwargs(), autocommit=True) as c:  # type: ignore[arg-type]
        c.execute(sql)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_copies_skipped_one_parameter_handler(
    kind: str, tmp_path: Path, kafka_bootstrap: str, topic: str, request: pytest.FixtureRequest, group_protocol: str
) -> None:
    url = store_url(kind, tmp_path, request)
    produce_copies(kafka_bootstrap, topic)
    seen: list[bytes] = []
    c = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": f"g{uuid.uuid4().hex[:8]}",
         **group_settings(group_protocol)},
        topics=[topic], handler=lambda m: seen.append(m.value()), outbox=url, dedup=True, batch_size=7,
    )
    with running(c):
        wait_until(lambda: len(seen) + c.stats()["duplicates_skipped"] == COPIES + 2, 60, "every copy was read")
    assert sorted(seen) == sorted([m.encode() for m in IDS] + [b"anonymous", b"anonymous"])
    assert c.stats()["duplicates_skipped"] == COPIES - len(IDS)


@pytest.mark.parametrize("through", ["dbapi", "sqlalchemy"])
@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_transactional_handler_applies_each_id_once(
    kind: str, through: str, tmp_path: Path, kafka_bootstrap: str, topic: str, request: pytest.FixtureRequest
) -> None:
    url = store_url(kind, tmp_path, request)
    produce_copies(kafka_bootstrap, topic)
    group = f"g{uuid.uuid4().hex[:8]}"
    failed_once: set[bytes] = set()
    mark = "?" if kind == "sqlite" else "%s"

    def handler(m: Message, tx: Any) -> None:
        v: bytes = m.value()  # type: ignore[assignment]
        if through == "dbapi":
            tx.execute(f"INSERT INTO effects VALUES ({mark})", (v.decode(),))
        else:
            with sqlalchemy_connection(tx) as c, Session(bind=c) as session:
                session.execute(sa.text("INSERT INTO effects VALUES (:v)"), {"v": v.decode()})
                session.commit()  # the inbox's to end: it commits with the mark
        if v == b"id-4" and v not in failed_once:  # its write is rolled back; its tier copy applies it
            failed_once.add(v)
            raise RuntimeError("fails once, after its write")

    first = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group},
        topics=[topic], handler=handler, outbox=url, dedup=True, strategy=RetryTopics(delays=[1]),
    )
    create_effects(url)
    with running(first):
        wait_until(lambda: sum(n for _, n in effects(url)) == len(IDS) + 2, 60, "every id applied")
        time.sleep(2)  # room for a wrong second application to show
    assert first.stats()["failed"] == 1
    assert first.stats()["duplicates_skipped"] == COPIES - len(IDS)
    # A second group member started from the beginning of the topic (as after a lost commit): all copies.
    again = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group + "-replay"},
        topics=[topic], handler=handler, outbox=url, dedup=True,
    )
    with running(again):
        wait_until(lambda: again.stats()["duplicates_skipped"] >= COPIES - len(IDS), 60, "the replay read")
    got = dict(effects(url))
    # The replay is another group: it applies each id once more, never twice.
    assert got == {**{m: 2 for m in IDS}, "anonymous": 4}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_message_dead_lettered_to_the_store_mid_batch_leaves_nothing_and_the_batch_goes_on(
    kind: str, tmp_path: Path, kafka_bootstrap: str, topic: str, request: pytest.FixtureRequest
) -> None:
    # One poll batch holds every copy; id-4 fails for good after its write. Its dead letter is
    # written to the consumer's store (on SQLite: the write lock the batch's transaction held is
    # free by then), its write and mark are rolled back, the others' commit, once each.
    url = store_url(kind, tmp_path, request)
    produce_copies(kafka_bootstrap, topic)
    mark = "?" if kind == "sqlite" else "%s"
    runs: list[bytes] = []

    def handler(m: Message, tx: Any) -> None:
        v: bytes = m.value()  # type: ignore[assignment]
        runs.append(v)
        tx.execute(f"INSERT INTO effects VALUES ({mark})", (v.decode(),))
        if v == b"id-4":
            raise ValueError("never valid, after its write")

    c = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": f"g{uuid.uuid4().hex[:8]}"},
        topics=[topic], handler=handler, outbox=url, dedup=True, dead_on=ValueError, dead_letters="store",
    )
    create_effects(url)
    with running(c):
        wait_until(lambda: c.stats()["handled"] + c.stats()["duplicates_skipped"] + c.stats()["failed"] == COPIES + 2,
                   60, "every copy read")
        wait_until(lambda: c.stats()["dead"] == 2, 30, "both copies of id-4 dead-lettered")
    assert dict(effects(url)) == {**{m: 1 for m in IDS if m != "id-4"}, "anonymous": 2}
    assert runs.count(b"id-4") == 2  # the second copy is a new attempt: the first one's mark was rolled back
    store = open_outbox(url)
    try:
        assert sorted(d.value or b"" for d in store.list_dead()) == [b"id-4", b"id-4"]
    finally:
        store.close()


def test_a_lost_batch_transaction_is_read_again_and_applied_once(
    tmp_path: Path, kafka_bootstrap: str, topic: str, fresh_postgres_url: str, group_protocol: str
) -> None:
    # The inbox's PostgreSQL session dies in the middle of a batch (the handler ends it): the
    # batch's transaction is lost, poll_once() raises InboxCommitFailed, the inbox reconnects, and
    # the batch is read again: every id's write exists once, none lost, none doubled.
    url = fresh_postgres_url
    produce_copies(kafka_bootstrap, topic)
    killed: list[bytes] = []

    def handler(m: Message, tx: Any) -> None:
        v: bytes = m.value()  # type: ignore[assignment]
        tx.execute("INSERT INTO effects VALUES (%s)", (v.decode(),))
        if v == b"id-5" and not killed:
            killed.append(v)
            tx.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    c = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": f"g{uuid.uuid4().hex[:8]}",
         **group_settings(group_protocol)},
        topics=[topic], handler=handler, outbox=url, dedup=True,
    )
    create_effects(url)
    raised: list[BaseException] = []
    try:
        deadline = time.monotonic() + 90
        while sum(n for _, n in effects(url)) < len(IDS) + 2 and time.monotonic() < deadline:
            try:
                c.poll_once()
            except StoreError as exc:
                raised.append(exc)
        for _ in range(20):  # room for a wrong second application to show
            c.poll_once()
    finally:
        c.close()
    assert killed == [b"id-5"]
    assert [type(e) for e in raised] == [InboxCommitFailed]
    assert dict(effects(url)) == {**{m: 1 for m in IDS}, "anonymous": 2}
