"""Record timestamps through the outbox, read back from the real cluster.

A message's record timestamp is the one given to produce(), or else the time of its first
produce() call, however long it waits in the outbox and whichever path sends it again; rows
stored before the outbox kept timestamps are sent as they always were (stamped when sent).
Consumer hops and dead letters keep the consumed record's own timestamp.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from click.testing import CliRunner, Result
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer, Message, Producer, TopicPartition
from outbox_cli.main import cli

from outbox import DeadLetter, ResilientConsumer, ResilientProducer, RetryTopics
from outbox.records import NewMessage
from outbox.stores import grouped, open_outbox
from outbox.stores.codec import encode_headers
from outbox.stores.postgres import SCHEMA_VERSION, PostgresOutbox
from outbox.stores.sqlite import SQLiteOutbox
from outbox.stores.urls import parse_url
from outbox.testing import KafkaCluster
from outbox.testing.consume import readable_partitions

from ..old_schema import sqlite_v5
from ..waiting import wait_until
from .delivery import Arrivals, header, read_topic
from .test_producer import drained, make_producer

#: Explicit timestamps: far from any clock reading, so that none can be mistaken for a send time.
EXPLICIT = 1_600_000_000_000
OUTAGE_SECONDS = 15.0


def run(*args: str) -> Result:
    return CliRunner().invoke(
        cli, list(args), env={"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""}, catch_exceptions=False
    )


def written(bootstrap: str, topic: str) -> int:
    """Records in `topic`: the sum of its partitions' high watermarks."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"watermarks-{uuid.uuid4().hex}"})
    try:
        parts = readable_partitions(consumer, topic, 30)
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts)
    finally:
        consumer.close()


def ms(t: float) -> int:
    return int(t * 1000)


def stamps(got: Arrivals) -> dict[str, tuple[int, int]]:
    """(timestamp type, ms) of each arrival by outbox-id; every id must have arrived once."""
    assert got.duplicates == 0 or all(len({m.timestamp() for m in ms_}) == 1 for ms_ in got.by_id.values())
    return {mid: found[0].timestamp() for mid, found in got.by_id.items()}


class Recorder:
    """produce() calls and the clock around each: what a record's timestamp must be."""

    def __init__(self, p: ResilientProducer, topic: str) -> None:
        self.p, self.topic = p, topic
        self.calls: dict[str, tuple[int, int, int]] = {}  # id -> (before ms, after ms, explicit or 0)

    def produce(self, value: bytes, key: bytes | None = None, timestamp: int = 0, **kw: Any) -> str:
        before = time.time()
        msg_id = self.p.produce(self.topic, value, key=key, timestamp=timestamp, **kw)
        self.calls[msg_id] = (ms(before), ms(time.time()), timestamp)
        return msg_id

    def check(self, got: Arrivals) -> None:
        """Each record carries its explicit timestamp exactly, else its produce() time within 1 s."""
        found = stamps(got)
        assert set(found) == set(self.calls), "every produced message arrived"
        for msg_id, (before, after, explicit) in self.calls.items():
            kind, stamp = found[msg_id]
            assert kind == TIMESTAMP_CREATE_TIME
            if explicit:
                assert stamp == explicit, msg_id
            else:
                assert before - 1000 <= stamp <= after + 1000, (msg_id, before, stamp, after)


def test_an_outage_of_every_broker_keeps_each_messages_produce_time(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    """15 s without any broker: fallback mode's failed first sends (stamped from their reports),
    messages stored while the circuit is open or behind their key, and write-ahead mode's rows
    all reach Kafka with their produce() time, not the time of the re-send 15 s or more later."""
    bs = chaos_cluster.bootstrap_servers
    fallback_topic, ahead_topic = make_topic(), make_topic()
    chaos_cluster.stop_all()
    stopped = time.monotonic()
    fallback = make_producer(bs, tmp_path / "fallback.db", message_timeout_ms=2000)
    ahead = make_producer(bs, tmp_path / "ahead.db", message_timeout_ms=2000, mode="write-ahead")
    try:
        f, a = Recorder(fallback, fallback_topic), Recorder(ahead, ahead_topic)
        # Into librdkafka while the circuit is closed: each fails after message.timeout.ms.
        for i in range(30):
            f.produce(b"first-%d" % i, b"k%d" % (i % 5) if i % 2 else None, EXPLICIT + i if i % 3 == 0 else 0)
            a.produce(b"ahead-%d" % i, b"k%d" % (i % 5), EXPLICIT + i if i % 3 == 0 else 0)
            time.sleep(0.05)
        wait_until(lambda: fallback.stats()["circuit"] == "open", 60, "the fallback producer's circuit opens")
        wait_until(lambda: fallback.stats()["outboxed"] >= 30, 60, "the failed first sends are stored")
        # Stored at once: the circuit is open, or their key has rows in the outbox.
        for i in range(30):
            f.produce(b"later-%d" % i, b"k%d" % (i % 5) if i % 2 else None, EXPLICIT + 100 + i if i % 3 == 0 else 0)
            time.sleep(0.05)
        time.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - stopped)))
        chaos_cluster.start_all()
        wait_until(lambda: drained(fallback) and drained(ahead), 180, "both outboxes are drained")
        assert fallback.stats()["delivered_from_outbox"] >= 60 and ahead.stats()["pending"] == 0
    finally:
        fallback.close(30)
        ahead.close(30)
    f.check(read_topic(bs, fallback_topic, 60))
    a.check(read_topic(bs, ahead_topic, 30))


def test_rows_stored_before_timestamps_are_migrated_and_sent_stamped_when_sent(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, postgres_url: str
) -> None:
    """An SQLite outbox of schema version 5 (one-message rows and a group body without
    timestamps) and a PostgreSQL outbox of version 3 (the column dropped): migrated when opened,
    their old rows go out with timestamp 0, i.e. librdkafka's now when sent, and rows stored
    after the migration with their own."""
    sqlite_topic, pg_topic = make_topic(), make_topic()
    db = str(tmp_path / "v5.db")
    old = [NewMessage(sqlite_topic, b"single-%d" % i, b"k", [("outbox-id", b"s%d" % i)], -1, f"s{i}") for i in range(3)]
    group = [
        NewMessage(sqlite_topic, b"grouped-%d" % i, b"k%d" % i, [("outbox-id", b"g%d" % i)], -1, f"g{i}")
        for i in range(grouped.GROUP_MIN)
    ]
    sqlite_v5(db, old, [group], now=time.time() - 3600)
    schema = f"old_{uuid.uuid4().hex[:8]}"
    pg = dataclasses.replace(parse_url(postgres_url), schema=schema)
    PostgresOutbox(pg).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:  # back to version 3
        conn.execute(f'ALTER TABLE "{schema}".outbox DROP COLUMN timestamp')
        conn.execute(f'DELETE FROM "{schema}".outbox_schema_version WHERE version >= 4')
        for i in range(3):
            conn.execute(
                f'INSERT INTO "{schema}".outbox (msg_id, topic, value, headers, created_at) VALUES (%s, %s, %s, %s, 0)',
                [f"p{i}", pg_topic, b"old-%d" % i, encode_headers([("outbox-id", f"p{i}".encode())])],
            )
    try:
        lite, post = SQLiteOutbox(db, create=False), PostgresOutbox(pg, create=False)  # both migrated here
        assert [m.timestamp for m in lite.messages()] == [0] * (3 + grouped.GROUP_MIN)
        assert [post.get(i).timestamp for i in (1, 2, 3)] == [0, 0, 0]
        for store, topic in ((lite, sqlite_topic), (post, pg_topic)):
            store.enqueue([NewMessage(topic, b"new", None, [("outbox-id", b"new")], -1, "new", timestamp=EXPLICIT)])
            store.close()
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute(f'SELECT max(version) FROM "{schema}".outbox_schema_version').fetchone() == (
                SCHEMA_VERSION,
            )
        sent_from = ms(time.time())
        for url in (f"sqlite:///{db}", postgres_schema_url(postgres_url, schema)):
            r = run("drain", "--outbox", url, "-b", kafka_bootstrap, "--json")
            assert r.exit_code == 0, r.output
        sent_until = ms(time.time())
        for topic, count in ((sqlite_topic, 3 + grouped.GROUP_MIN + 1), (pg_topic, 4)):
            found = stamps(read_topic(kafka_bootstrap, topic, count))
            assert len(found) == count and found.pop("new") == (TIMESTAMP_CREATE_TIME, EXPLICIT)
            for msg_id, (kind, stamp) in found.items():
                assert kind == TIMESTAMP_CREATE_TIME and sent_from <= stamp <= sent_until, (msg_id, stamp)
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def postgres_schema_url(base: str, schema: str) -> str:
    """`base` with the outbox in `schema` (the URL's `schema` query parameter)."""
    return f"{base}{'&' if '?' in base else '?'}schema={schema}"


def test_dead_letter_replay_and_an_edited_redrive_send_the_stored_timestamp(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic, other = make_topic(), make_topic()
    url = f"sqlite:///{tmp_path / 'o.db'}"
    store = open_outbox(url)
    dead = [
        NewMessage(topic, b"dead-%d" % i, b"k%d" % i, [("outbox-id", b"d%d" % i)], -1, f"d{i}", 3, 1.0,
                   "_MSG_TIMED_OUT (-192): gone", 0.0, -192, "_MSG_TIMED_OUT", EXPLICIT + i)
        for i in range(4)
    ]
    d0, d1, d2, d3 = store.add_dead(dead, failed_at=time.time())
    # The console's edit-and-redrive: a new value, the record timestamp kept.
    assert store.redrive_edited(d3, value=b"edited", headers=[("outbox-id", b"d3")], now=time.time())
    store.close()
    assert run("dlq", "replay", "--outbox", url, "--id", str(d0), "--id", str(d1)).exit_code == 0
    assert run("dlq", "replay", "--outbox", url, "--id", str(d2), "--to-topic", other).exit_code == 0
    r = run("drain", "--outbox", url, "-b", kafka_bootstrap, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["delivered"] == 4
    # What the drain counted as delivered is in Kafka: each topic's high watermarks (read from
    # the partitions' leaders) hold it, before anything is read back.
    assert written(kafka_bootstrap, topic) == 3 and written(kafka_bootstrap, other) == 1
    assert stamps(read_topic(kafka_bootstrap, topic, 3)) == {
        f"d{i}": (TIMESTAMP_CREATE_TIME, EXPLICIT + i) for i in (0, 1, 3)
    }
    assert stamps(read_topic(kafka_bootstrap, other, 1)) == {"d2": (TIMESTAMP_CREATE_TIME, EXPLICIT + 2)}


def test_consumer_hops_dlq_records_dead_letters_and_their_redrives_keep_the_original_timestamp(
    kafka_bootstrap: str, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]], tmp_path: Path
) -> None:
    main = make_topic(partitions=1)
    group = f"g{uuid.uuid4().hex[:8]}"
    retry1, retry2, dlq = (f"{main}.{group}.retry-1", f"{main}.{group}.retry-2", f"{main}.{group}.dlq")
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(main, b"stamped", key=b"k", timestamp=EXPLICIT)
    p.produce(main, b"now", key=b"k")
    assert p.flush(10) == 0
    [_, original] = consume_all(main, 2)
    now_stamp = original.timestamp()[1]
    assert original.timestamp()[0] == TIMESTAMP_CREATE_TIME and now_stamp > EXPLICIT
    seen: list[tuple[str, bytes, tuple[int, int]]] = []
    dead: list[DeadLetter] = []

    def handle(msg: Message) -> None:
        seen.append((msg.topic() or "", msg.value() or b"", msg.timestamp()))
        raise TimeoutError("downstream down")

    url = f"sqlite:///{tmp_path / 'c.db'}"
    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, "session.timeout.ms": 6000},
        topics=[main],
        handler=handle,
        strategy=RetryTopics(delays=[0.1, 0.1]),
        dead_letters="both",
        outbox=url,
        on_dead_letter=dead.append,
    )
    try:
        deadline = time.monotonic() + 90
        while len(dead) < 2 or consumer.stats()["waiting_hops"]:
            assert time.monotonic() < deadline, "both messages dead-lettered and their DLQ records durable"
            consumer.poll_once()
    finally:
        consumer.close()
    want = {b"stamped": (TIMESTAMP_CREATE_TIME, EXPLICIT), b"now": (TIMESTAMP_CREATE_TIME, now_stamp)}
    # Handled from the main topic and both tiers, each time with the original's timestamp.
    assert sorted((t, v) for t, v, _ in seen) == sorted((t, v) for t in (main, retry1, retry2) for v in want)
    assert all(stamp == want[v] for _, v, stamp in seen)
    for topic in (retry1, retry2, dlq):
        assert {m.value(): m.timestamp() for m in consume_all(topic, 2)} == want, topic
    assert {d.value: d.timestamp for d in dead} == {v: s for v, (_, s) in want.items()}
    # The DLQ topic redriven into the first tier, and the stored dead letters replayed there.
    r = run("dlq", "replay-topic", dlq, "-b", kafka_bootstrap, "--json")
    assert r.exit_code == 0, r.output
    assert run("dlq", "replay", "--outbox", url, "--group", group).exit_code == 0
    assert run("drain", "--outbox", url, "-b", kafka_bootstrap).exit_code == 0
    copies = consume_all(retry1, 6)
    assert len(copies) == 6
    for m in copies:
        assert m.timestamp() == want[m.value()], (header(m, "outbox-id"), m.timestamp())



def test_a_message_enqueued_in_a_database_transaction_keeps_its_produce_time(
    kafka_bootstrap: str, topic: str, fresh_postgres_url: str
) -> None:
    """`produce(..., transaction=conn)`: stored, never sent by produce(); sent seconds later by
    `outbox drain` with the time of the produce() call, or the timestamp given."""
    with ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap, "acks": "all"}, outbox=fresh_postgres_url, drain_workers=0
    ) as p:
        r = Recorder(p, topic)
        with psycopg.connect(fresh_postgres_url) as conn, conn.transaction():
            plain_id = r.produce(b"plain", b"k", transaction=conn)
            r.produce(b"given", b"k", EXPLICIT, transaction=conn)
    time.sleep(3)  # a re-send stamped at sending would be seconds off
    drained_at = time.time()
    result = run("drain", "--outbox", fresh_postgres_url, "-b", kafka_bootstrap, "--json")
    assert result.exit_code == 0, result.output
    got = read_topic(kafka_bootstrap, topic, 2)
    r.check(got)
    assert got.by_id[plain_id][0].timestamp()[1] < ms(drained_at) - 1000
