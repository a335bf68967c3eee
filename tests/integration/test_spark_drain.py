"""The Spark bulk drain against real Kafka, real PostgreSQL and SQLite, and Spark local[2]."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer, TopicPartition

from outbox.errors import ConfigError, KafkaUnavailableError, OutboxError, StoreNotFoundError
from outbox.records import DeadLetterFilter, NewMessage, Status
from outbox.stores import open_outbox
from outbox.stores.base import Outbox
from outbox.stores.codec import decode_headers
from outbox.stores.encryption import KEYS_ENV, Key, KeyRing
from outbox.stores.urls import parse_url
from outbox.testing import KafkaCluster, create_topic
from outbox.testing.consume import consume_to_end, topic_size
from outbox.testing.maven import jdbc_jar
from spark_drain import JobOptions, JobReport, preflight, run_job

ROOT = Path(__file__).resolve().parents[2]

# 200,000 rows per backend does not fit the time budget of this shared 2-core machine next to
# the other suites (see the module's report); 50,000 exercises the same paths: several mark
# batches per task, every key spread over thousands of rows.
N_ROWS = int(os.environ.get("SPARK_DRAIN_TEST_ROWS", "50000"))
N_KEYS = 64
BATCH = 5000
STAMP = 1_795_634_888_790  # a record timestamp (ms), past what a 32-bit JDBC column could hold


def header(msg: Any, name: str) -> bytes | None:
    for h, v in msg.headers() or []:
        if h == name:
            return v  # type: ignore[no-any-return]
    return None


def fill(store: Outbox, topic: str, n: int, *, prefix: str = "m", stamped: bool = False) -> list[str]:
    """n pending rows over N_KEYS keys; value = b"key:seq" with seq counting up per key; with
    `stamped`, the i-th row's record timestamp is STAMP + i.

    Every other row carries the outbox-id header already (as the SDK stores them); the others
    rely on the job to add it from msg_id.
    """
    ids: list[str] = []
    seq: dict[int, int] = defaultdict(int)
    for start in range(0, n, BATCH):
        batch = []
        for i in range(start, min(n, start + BATCH)):
            k = i % N_KEYS
            seq[k] += 1
            msg_id = f"{prefix}-{i:08d}"
            headers: list[tuple[str, bytes | None]] = [("app", b"x")]
            if i % 2 == 0:
                headers.append(("outbox-id", msg_id.encode()))
            batch.append(
                NewMessage(
                    topic=topic, value=f"k{k}:{seq[k]}".encode(), key=f"k{k}".encode(), headers=headers,
                    msg_id=msg_id, timestamp=STAMP + i if stamped else 0,
                )
            )
            ids.append(msg_id)
        store.enqueue(batch)
    return ids


def check_consumed(messages: list[Any], expected_ids: list[str]) -> None:
    """Every expected id arrived (duplicates allowed), and each key's sequence never goes back."""
    got = [header(m, "outbox-id") for m in messages]
    assert None not in got, "a message arrived without the outbox-id header"
    assert {g.decode() for g in got if g is not None} == set(expected_ids)
    last: dict[bytes, int] = {}
    for m in messages:  # one key → one partition; the consumer reads each partition in order
        key, seq = m.value().split(b":")
        assert key == m.key()
        # >= and not >: an at-least-once resend may repeat a sequence number, never go back.
        assert int(seq) >= last.get(key, 0), f"key {key!r} out of order: {seq!r} after {last.get(key)}"
        last[key] = int(seq)
        assert header(m, "app") == b"x"
        assert header(m, "outbox-attempt") is not None


@pytest.fixture(params=["sqlite", "postgresql"])
def outbox_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A new, empty outbox of each backend, as the URL form Spark's users pass (jdbc: for PostgreSQL)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'outbox.db'}"
    else:
        # The JDBC form, as a Spark user would pass it (credentials as query parameters).
        pg = urlsplit(request.getfixturevalue("fresh_postgres_url"))
        url = f"jdbc:postgresql://{pg.hostname}:{pg.port or 5432}{pg.path}"
        url += f"?user={pg.username}&password={pg.password}"
    open_outbox(url).close()  # creates the schema
    yield url


def opts(url: str, bootstrap: str, **kw: Any) -> JobOptions:
    kw.setdefault("partitions", 2)
    kw.setdefault("kafka_config", {"message.timeout.ms": "20000"})
    return JobOptions(outbox=url, bootstrap_servers=bootstrap, **kw)


def pending(url: str) -> int:
    with open_outbox(url, create=False) as s:
        return s.stats(now=time.time() + 10**6).pending


def test_bulk_drain_delivers_everything_in_key_order_once(
    spark: Any, outbox_url: str, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    with open_outbox(outbox_url, create=False) as store:
        ids = fill(store, topic, N_ROWS)

    report = run_job(spark, opts(outbox_url, kafka_bootstrap))

    assert report.total.read == N_ROWS
    assert report.total.delivered == N_ROWS
    assert report.total.failed == report.total.dead == report.total.left == 0
    assert report.ok
    assert pending(outbox_url) == 0
    messages = consume_all(topic, N_ROWS, timeout=120)
    assert len(messages) == N_ROWS
    check_consumed(messages, ids)

    again = run_job(spark, opts(outbox_url, kafka_bootstrap))
    assert again.total.read == 0 and again.total.delivered == 0
    assert topic_size(kafka_bootstrap, topic) == N_ROWS  # no message sent twice, by either run


def test_bulk_drain_of_a_mysql_outbox_delivers_everything_in_key_order_once(
    spark: Any, fresh_mysql_url: str, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    """A MySQL / MariaDB outbox read through MariaDB Connector/J (one message per row): every row
    sent once and deleted, each key in order; a key whose first row another drainer holds is
    left whole, in the outbox."""
    n = 10_000
    with open_outbox(fresh_mysql_url) as store:
        ids = fill(store, topic, n)
        [held] = store.claim("another-drainer", 1, 600, now=time.time())
    assert held.key is not None
    left = [msg_id for i, msg_id in enumerate(ids) if f"k{i % N_KEYS}".encode() == held.key]

    report = run_job(spark, opts(fresh_mysql_url, kafka_bootstrap))

    assert report.total.delivered == n - len(left)
    assert report.total.failed == report.total.dead == 0
    assert pending(fresh_mysql_url) == len(left)
    messages = consume_all(topic, n - len(left), timeout=120)
    assert len(messages) == n - len(left)
    check_consumed(messages, [i for i in ids if i not in set(left)])


def test_a_drain_in_waves_sends_every_key_in_order_across_them(
    spark: Any, outbox_url: str, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    """Pending rows go in waves of growing size (`--first-wave`): every row is sent once, and a
    key's messages of one wave leave before those of the next."""
    with open_outbox(outbox_url, create=False) as store:
        ids = fill(store, topic, N_ROWS)

    report = run_job(spark, opts(outbox_url, kafka_bootstrap, first_wave=N_ROWS // 20))

    assert report.waves == 5  # 1/20, 2/20, 4/20, 8/20 and the last 5/20 of the ids
    assert (report.total.read, report.total.delivered, report.total.left, report.not_sent) == (N_ROWS, N_ROWS, 0, 0)
    assert pending(outbox_url) == 0
    messages = consume_all(topic, N_ROWS, timeout=120)
    assert len(messages) == N_ROWS
    check_consumed(messages, ids)


def test_a_wave_that_leaves_a_row_pending_ends_the_run_and_the_next_run_sends_the_rest_in_order(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, make_topic: Callable[..., str],
    consume_all: Callable[..., list[Any]],
) -> None:
    """Key a's first message goes to a topic that does not exist yet: it fails, retriably, in the
    first wave. No later wave is sent: its rows stay pending, counted as left. Once the topic
    exists, the next run sends the rest, each key in order."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    real = make_topic(partitions=1)
    later = f"{real}-later"  # does not exist yet
    with open_outbox(url) as store:
        store.enqueue([NewMessage(later, b"a:1", b"a", msg_id="a:1")])
        for start in range(1, 400, 100):
            store.enqueue([NewMessage(real, b"b:%d" % i, b"b%d" % (i % 7), msg_id=f"b:{i}")
                           for i in range(start, start + 100)])
        store.enqueue([NewMessage(later, b"a:2", b"a", msg_id="a:2")])

    first = run_job(spark, opts(url, kafka_bootstrap, first_wave=50, max_attempts=5, retry_delay=0,
                                kafka_config=NO_AUTO_CREATE))

    t = first.total
    assert first.waves == 1 and t.failed == 1 and first.not_sent > 0
    assert t.read == 402 and t.delivered == 401 - first.not_sent and t.left == first.not_sent
    assert not first.ok
    assert in_topic(kafka_bootstrap, real) == t.delivered
    assert pending(url) == 1 + first.not_sent

    make_topic(partitions=1, name=later)
    again = run_job(spark, opts(url, kafka_bootstrap, first_wave=50))

    assert again.ok and again.total.delivered == 1 + first.not_sent
    assert pending(url) == 0
    assert [m.value() for m in consume_all(later, 2, timeout=30)] == [b"a:1", b"a:2"]
    got = [m.value() for m in consume_all(real, 400, timeout=30)]
    assert sorted(got) == sorted(b"b:%d" % i for i in range(1, 401))
    for key in range(7):  # each key's messages in outbox order
        seq = [int(v.split(b":")[1]) for v in got if int(v.split(b":")[1]) % 7 == key]
        assert seq == sorted(seq)


def test_dead_letter_replay_sends_only_the_selected_dead_letters(
    spark: Any, outbox_url: str, kafka_bootstrap: str, make_topic: Callable[..., str],
) -> None:
    t1, t2 = make_topic(), make_topic()
    now = time.time()
    timed_out = "_MSG_TIMED_OUT (-192): Local: Message timed out"
    with open_outbox(outbox_url, create=False) as store:
        keep = fill(store, t1, 10)  # pending rows of t1: not part of a dead-letter replay
        dead_ids = store.add_dead(
            [NewMessage(topic=t1, value=f"k1:{i}".encode(), key=b"k1", msg_id=f"d-{i}", attempts=3,
                        first_failed_at=now - 60, last_error=timed_out, error_code=-192,
                        error_name="_MSG_TIMED_OUT", timestamp=STAMP + i) for i in range(1, 301)]
            + [NewMessage(topic=t2, value=b"k2:1", key=b"k2", msg_id="other-topic", attempts=3,
                          first_failed_at=now - 60, last_error=timed_out, error_code=-192,
                          error_name="_MSG_TIMED_OUT")]
            + [NewMessage(topic=t1, value=b"k3:1", key=b"k3", msg_id="too-large", attempts=1,
                          first_failed_at=now - 60, last_error="MSG_SIZE_TOO_LARGE (10): too large",
                          error_code=10, error_name="MSG_SIZE_TOO_LARGE")],
            failed_at=now - 30,
        )
        assert len(dead_ids) == 302

    dry = run_job(spark, opts(outbox_url, kafka_bootstrap, dead_letters=True, topics=(t1,),
                              error="_MSG_TIMED_OUT", dry_run=True))
    assert dry.dry_run and dry.topics[t1].read == 300 and t2 not in dry.topics

    report = run_job(spark, opts(outbox_url, kafka_bootstrap, dead_letters=True, topics=(t1,), error="-192"))

    assert report.replayed == 300
    assert report.total.delivered == 300 and report.ok
    with open_outbox(outbox_url, create=False) as store:
        left_dead = {r.msg_id for r in store.list_dead(DeadLetterFilter())}
        assert left_dead == {"other-topic", "too-large"}
        assert store.stats(now=time.time()).pending == len(keep)  # the pending rows were not touched
    messages = consume_to_end(kafka_bootstrap, t1)
    got = sorted(header(m, "outbox-id") or b"" for m in messages)
    assert got == sorted(f"d-{i}".encode() for i in range(1, 301))
    # A replay resets attempts: the first re-send is attempt 1; the first failure time is kept.
    assert {header(m, "outbox-attempt") for m in messages} == {b"1"}
    assert {header(m, "outbox-first-failed-at") for m in messages} == {str(int((now - 60) * 1000)).encode()}
    assert [int(m.value().split(b":")[1]) for m in messages] == list(range(1, 301))
    # Each with the record timestamp it was stored with, read through JDBC as a long.
    assert [m.timestamp() for m in messages] == [(TIMESTAMP_CREATE_TIME, STAMP + i) for i in range(1, 301)]


def test_a_row_kafka_rejects_for_good_is_dead_lettered_not_retried(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, make_topic: Callable[..., str],
) -> None:
    url = f"jdbc:sqlite:{tmp_path / 'outbox.db'}"
    small = make_topic(partitions=1, config={"max.message.bytes": "4096"})
    with open_outbox(url) as store:
        store.enqueue([NewMessage(topic=small, value=b"a:1", key=b"a", msg_id="ok-1")])
        store.enqueue([NewMessage(topic=small, value=b"x" * 20000, key=b"big", msg_id="big")])
        store.enqueue([NewMessage(topic=small, value=b"a:2", key=b"a", msg_id="ok-2")])

    # Several attempts allowed: the size error must dead-letter at once anyway. A long linger
    # puts the three rows in one record batch, which Kafka rejects as a whole: the small rows
    # must not be dead-lettered with the big one.
    report = run_job(spark, opts(url, kafka_bootstrap, max_attempts=5, retry_delay=0,
                                 kafka_config={"linger.ms": "200"}))

    assert report.topics[small].dead == 1
    with open_outbox(url, create=False) as store:
        dead = store.list_dead()
        assert [d.msg_id for d in dead] == ["big"]
        assert dead[0].attempts == 1 and "MSG_SIZE_TOO_LARGE" in (dead[0].last_error or "")
        stats = store.stats(now=time.time() + 3600)
    assert stats.pending == 0 and report.topics[small].delivered == 2
    got = consume_to_end(kafka_bootstrap, small)
    assert [header(m, "outbox-id") for m in got] == [b"ok-1", b"ok-2"]  # in order
    # A later run does not pick the dead letter up again.
    assert run_job(spark, opts(url, kafka_bootstrap)).total.read == 0


def test_a_message_dead_lettered_inside_a_split_group_leaves_the_rest_delivered_once(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, make_topic: Callable[..., str],
    consume_all: Callable[..., list[Any]],
) -> None:
    """One message of a SQLite group that both send tasks share is refused for good: its task
    settles the failure at once (the group becomes one-message rows), the settle stage deletes
    the other messages delivered from the group by both tasks, and only the refused one is left,
    as a dead letter."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    small = make_topic(partitions=2, config={"max.message.bytes": "4096"})
    keys = 20
    stored = [
        NewMessage(small, b"x" * 20000 if i == 25 else f"k{i % keys}:{i // keys + 1}".encode(),
                   f"k{i % keys}".encode(), msg_id=f"s-{i}")
        for i in range(200)
    ]
    with open_outbox(url) as store:
        store.enqueue(stored)
        assert store.capabilities.grouped_rows
    with sqlite3.connect(tmp_path / "outbox.db") as c:
        assert c.execute("SELECT COUNT(*), MAX(n) FROM outbox").fetchone() == (1, 200)  # one group

    report = run_job(spark, opts(url, kafka_bootstrap, max_attempts=5, retry_delay=0))

    assert (report.total.read, report.total.delivered, report.total.dead, report.total.left) == (200, 199, 1, 0)
    with open_outbox(url, create=False) as store:
        assert [d.msg_id for d in store.list_dead()] == ["s-25"]
        assert store.stats(now=time.time() + 3600).pending == 0
    got = consume_all(small, 199, timeout=60)
    assert sorted(header(m, "outbox-id") for m in got) == sorted(f"s-{i}".encode() for i in range(200) if i != 25)
    for k in range(keys):
        seqs = [int(m.value().split(b":")[1]) for m in got if m.key() == f"k{k}".encode()]
        assert seqs == [s for s in range(1, 11) if (k, s) != (5, 2)]


def in_topic(bootstrap: str, topic: str) -> int:
    """How many records the topic's partitions hold (their high watermarks)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "watermarks"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions)
    finally:
        consumer.close()


def test_broker_killed_midway_loses_nothing(
    spark: Any, tmp_path: Path, chaos_cluster: KafkaCluster, make_topic: Callable[..., str],
    consume_all: Callable[..., list[Any]],
) -> None:
    bootstrap = chaos_cluster.bootstrap_servers
    topic = make_topic(partitions=3, replication_factor=3, config={"min.insync.replicas": "2"})
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    with open_outbox(url) as store:
        ids = fill(store, topic, N_ROWS)

    options = opts(url, bootstrap, mark_batch=1000, retry_delay=0, max_attempts=10)
    result: list[JobReport | BaseException] = []

    def job() -> None:
        try:
            result.append(run_job(spark, options))
        except BaseException as exc:  # noqa: BLE001 - the test checks what happened
            result.append(exc)

    runner = threading.Thread(target=job)
    runner.start()
    # Kill the broker leading the most partitions once sending is under way: a fifth of the
    # messages are in the topic (the outbox shows it later: its groups are settled at the end).
    deadline = time.monotonic() + 180
    while in_topic(bootstrap, topic) < N_ROWS * 0.2 and runner.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert runner.is_alive(), "the job finished before the broker could be killed: raise N_ROWS"
    chaos_cluster.kill_broker(0)
    runner.join(600)
    assert not runner.is_alive()
    runs = 1
    # The job either finished (idempotent producer, leaders moved) or left rows pending;
    # re-runs with the broker still down finish the rest.
    while pending(url) and runs < 5:
        run_job(spark, opts(url, bootstrap, include_not_due=True, max_attempts=10, retry_delay=0))
        runs += 1
    assert pending(url) == 0
    with open_outbox(url, create=False) as store:
        assert store.stats(now=time.time()).dead == 0
    messages = consume_all(topic, N_ROWS, timeout=120)
    check_consumed(messages, ids)
    # The broker's loss is no error of the job: the first run reported (and left any row it
    # could not send pending) rather than raised.
    [first] = result
    assert isinstance(first, JobReport), f"the first job raised {first!r}"
    print(f"runs={runs} first={first.to_dict()}")


def test_unreachable_outbox_or_cluster_fails_fast(tmp_path: Path, kafka_bootstrap: str) -> None:
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        preflight(JobOptions(outbox=str(tmp_path / "missing.db"), bootstrap_servers=kafka_bootstrap))
    url = f"sqlite:///{tmp_path / 'o.db'}"
    open_outbox(url).close()
    started = time.monotonic()
    with pytest.raises(KafkaUnavailableError, match="127.0.0.1:1"):
        preflight(JobOptions(outbox=url, bootstrap_servers="127.0.0.1:1", check_timeout=2))
    assert time.monotonic() - started < 30


def test_spark_submit_script_and_report(
    tmp_path: Path, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    """`spark-submit spark_drain/job.py` works as a plain script (no package context)."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    with open_outbox(url) as store:
        ids = fill(store, topic, 1000)
    report_path = tmp_path / "report.json"
    spark_submit = Path(sys.executable).parent / "spark-submit"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    env.pop("PYTHONPATH", None)  # job.py must find the checkout by itself (or an installed copy)
    out = subprocess.run(
        [str(spark_submit), "--master", "local[2]", "--jars", jdbc_jar("sqlite"),
         "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1",
         str(ROOT / "spark_drain" / "job.py"), "--outbox", url, "--bootstrap-servers", kafka_bootstrap,
         "--partitions", "2", "--report", str(report_path)],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TOTAL" in out.stdout and "1000" in out.stdout
    import json

    data = json.loads(report_path.read_text())
    assert data["total"]["delivered"] == 1000 and data["mode"] == "pending"
    assert pending(url) == 0
    check_consumed(consume_all(topic, 1000, timeout=30), ids)


def test_the_first_launch_keeps_the_driver_jvms_classes_and_the_next_maps_them(
    tmp_path: Path, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    """`python -m spark_drain` with a new cache: the first run's JVM writes its class archive as it
    exits and the run puts it in place; the second maps it. Both deliver, and neither prints the
    JVM's CDS warnings."""
    cache = tmp_path / "cache"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1", XDG_CACHE_HOME=str(cache))
    archives = cache / "kafka-outbox" / "spark-cds"
    stamps = []
    for run, run_topic in enumerate([topic, create_topic(kafka_bootstrap, f"{topic}-again", partitions=3)]):
        url = f"sqlite:///{tmp_path / f'outbox{run}.db'}"
        with open_outbox(url) as store:
            ids = fill(store, run_topic, 500)
        out = subprocess.run(
            [sys.executable, "-m", "spark_drain", "--master", "local[2]", "--jars", jdbc_jar("sqlite"),
             "--outbox", url, "--bootstrap-servers", kafka_bootstrap, "--partitions", "2"],
            capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert "TOTAL" in out.stdout and "[warning][cds]" not in out.stdout + out.stderr
        assert ("keeping Spark's classes" in out.stderr) == (run == 0)
        (archive,) = archives.iterdir()  # the archive, and no half-written file beside it
        assert archive.suffix == ".jsa" and archive.stat().st_size > 1_000_000
        stamps.append(archive.stat().st_mtime_ns)
        assert pending(url) == 0
        check_consumed(consume_all(run_topic, 500, timeout=30), ids)
    assert stamps[0] == stamps[1]  # the second run mapped it and wrote nothing


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "spark_drain", "--outbox", f"sqlite:///{tmp_path / 'nope.db'}",
         "--bootstrap-servers", "127.0.0.1:1"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "does not exist" in out.stderr


def test_headers_of_a_resend_match_the_sdk(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    first = 1_700_000_000.25
    with open_outbox(url) as store:
        store.enqueue([NewMessage(topic=topic, value=b"v", key=b"k", msg_id="id-1",
                                  headers=[("a", b"1"), ("a", None), ("outbox-attempt", b"1")],
                                  attempts=2, first_failed_at=first, last_error="X (1): boom", partition=2)])
    assert run_job(spark, opts(url, kafka_bootstrap)).total.delivered == 1
    (m,) = consume_all(topic, 1, timeout=15)
    assert m.partition() == 2
    assert decode_headers(None) == []
    hs = m.headers()
    assert hs[:2] == [("a", b"1"), ("a", None)] or hs[:2] == [("a", b"1"), ("a", b"")]
    assert header(m, "outbox-id") == b"id-1"
    assert header(m, "outbox-attempt") == b"3"
    assert [h for h, _ in hs].count("outbox-attempt") == 1
    assert header(m, "outbox-first-failed-at") == str(int(first * 1000)).encode()


def test_groups_are_exploded_on_the_executors_and_keys_held_elsewhere_wait(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    """A SQLite outbox whose due groups hold keys that wait behind a row and a group leased to a
    running sender: the job sends every other key's messages, in order, and leaves the waiting
    ones pending (their group split, the sent messages deleted)."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    until = time.time() + 600
    with open_outbox(url) as store:
        # Leased elsewhere: one row of key a, and a group (write-ahead) of key b.
        store.enqueue([NewMessage(topic, b"a:0", b"a")], lease_owner="elsewhere", lease_until=until)
        store.enqueue([NewMessage(topic, b"b:0", b"b") for _ in range(20)], lease_owner="elsewhere",
                      lease_until=until)
        keys = [b"a", b"b", b"c", b"d"]
        due = [NewMessage(topic, keys[i % 4] + b":%d" % (i // 4 + 1), keys[i % 4], msg_id=f"g-{i}")
               for i in range(400)]
        store.enqueue(due[:200])  # two groups of due messages
        store.enqueue(due[200:])
        assert store.capabilities.grouped_rows and store.stats(now=time.time()).pending == 421

    dry = run_job(spark, opts(url, kafka_bootstrap, dry_run=True))
    # The dry run says what the run does: 200 to send, 200 held back behind their key's lease.
    assert (dry.total.read, dry.held_back, dry.topics[topic].read) == (200, 200, 200)

    report = run_job(spark, opts(url, kafka_bootstrap))

    assert report.total.read == 200 and report.total.delivered == 200 and report.held_back == 200
    assert not report.ok  # held back: exit code 3, run again later
    messages = consume_all(topic, 200, timeout=60)
    assert sorted({m.key() for m in messages}) == [b"c", b"d"] and len(messages) == 200
    for key in (b"c", b"d"):
        seqs = [int(m.value().split(b":")[1]) for m in messages if m.key() == key]
        assert seqs == sorted(seqs) == list(range(1, 101))
    with open_outbox(url, create=False) as store:
        left = store.pending_keys()
        assert left == {(topic, b"a"), (topic, b"b")}
        assert store.stats(now=time.time()).pending == 221


def test_groups_split_over_the_send_tasks_are_deleted_whole(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    """The shuffle by key gives both send tasks a part of every SQLite group; the settle stage
    deletes each group as one row, so the job writes no row into the outbox (a group settled in
    part would first be rewritten as one row per message). Messages stored as the producer stores
    them, with the `outbox-id` header alone, arrive with it and the first re-send's attempt."""
    path = tmp_path / "outbox.db"
    url = f"sqlite:///{path}"
    n, keys = 3000, 50
    stored = [
        NewMessage(topic, f"k{i % keys}:{i // keys + 1}".encode(), f"k{i % keys}".encode(),
                   headers=[("outbox-id", f"w-{i}".encode())], msg_id=f"w-{i}")
        for i in range(n)
    ]
    with open_outbox(url) as store:
        for start in range(0, n, 500):
            store.enqueue(stored[start : start + 500])
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT COUNT(*) FROM outbox").fetchone() == (6,)  # six groups
        c.execute("CREATE TABLE written (id INTEGER)")
        c.execute("CREATE TRIGGER note_written AFTER INSERT ON outbox BEGIN INSERT INTO written VALUES (new.id); END")

    report = run_job(spark, opts(url, kafka_bootstrap))

    assert (report.total.read, report.total.delivered, report.total.left) == (n, n, 0)
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT COUNT(*) FROM written").fetchone() == (0,)
        assert c.execute("SELECT COUNT(*) FROM outbox").fetchone() == (0,)
    messages = consume_all(topic, n, timeout=60)
    assert len(messages) == n
    assert {tuple(m.headers()) for m in messages if m.value() == b"k7:3"} == {
        (("outbox-id", f"w-{2 * keys + 7}".encode()), ("outbox-attempt", b"1")),
    }
    assert sorted(header(m, "outbox-id") for m in messages) == sorted(f"w-{i}".encode() for i in range(n))
    for k in range(keys):
        seqs = [int(m.value().split(b":")[1]) for m in messages if m.key() == f"k{k}".encode()]
        assert seqs == list(range(1, n // keys + 1))


def test_standalone_cluster_drains_a_postgresql_outbox(
    spark_standalone: Any, fresh_postgres_url: str, kafka_bootstrap: str, topic: str,
    consume_all: Callable[..., list[Any]],
) -> None:
    """`python -m spark_drain --master spark://…`: executors in the workers' JVMs, each with its own
    Python workers (PYSPARK_PYTHON), read PostgreSQL by JDBC, send, and delete what Kafka acknowledged."""
    open_outbox(fresh_postgres_url).close()
    with open_outbox(fresh_postgres_url, create=False) as store:
        ids = fill(store, topic, N_ROWS)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    out = subprocess.run(
        [sys.executable, "-m", "spark_drain", "--master", spark_standalone.master_url,
         "--jars", jdbc_jar("postgresql"), "--outbox", fresh_postgres_url,
         "--bootstrap-servers", kafka_bootstrap, "--partitions", "2"],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    total = next(line.split() for line in out.stdout.splitlines() if line.startswith("TOTAL"))
    assert total[1:] == [str(N_ROWS), str(N_ROWS), "0", "0", "0"]
    assert pending(fresh_postgres_url) == 0
    messages = consume_all(topic, N_ROWS, timeout=120)
    assert len(messages) == N_ROWS
    check_consumed(messages, ids)


def python_without_kafka_outbox(tmp_path: Path) -> Path:
    """An interpreter with every dependency of this venv but not kafka-outbox itself, as a
    cluster node's Python is: `-S` skips the site module, so the editable install's `.pth` hook
    never runs, and site-packages comes back through PYTHONPATH (which runs no `.pth`)."""
    import sysconfig

    wrapper = tmp_path / "node-python"
    site_packages = sysconfig.get_paths()["purelib"]
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site_packages}" exec {sys.executable} -S "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def test_spark_submit_ships_the_bundle_and_the_jdbc_driver_to_a_standalone_cluster(
    spark_standalone: Any, fresh_postgres_url: str, kafka_bootstrap: str, topic: str,
    consume_all: Callable[..., list[Any]], tmp_path: Path,
) -> None:
    """`python -m spark_drain.bundle`, then `spark-submit --py-files <zip> --packages <JDBC driver>`
    on the standalone cluster, with driver and executors on a Python that has the dependencies but
    not kafka-outbox: every row is delivered in key order, and the outbox is empty."""
    from spark_drain.jars import JDBC_DRIVER_PACKAGES

    python = python_without_kafka_outbox(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    # spark-submit finds Spark's home with a Python of its own unless told, as on a cluster node.
    import pyspark

    env["SPARK_HOME"] = str(Path(pyspark.__file__).parent)
    # No JDBC driver on the driver's machine but what --packages brings (Ivy's cache is Spark's).
    env["XDG_CACHE_HOME"] = str(tmp_path / "empty-cache")
    # The node's Python really lacks kafka-outbox (else this test would prove nothing).
    bare = subprocess.run([str(python), "-c", "import confluent_kafka, pyarrow, psycopg; import outbox"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "No module named 'outbox'" in bare.stderr, bare.stderr

    bundle = subprocess.run([sys.executable, "-m", "spark_drain.bundle", str(tmp_path / "bundle")],
                            capture_output=True, text=True, check=True)
    assert "spark-submit" in bundle.stdout
    (archive,) = (tmp_path / "bundle").glob("kafka_outbox-*.zip")
    open_outbox(fresh_postgres_url).close()
    with open_outbox(fresh_postgres_url, create=False) as store:
        ids = fill(store, topic, 5000)
    spark_submit = Path(sys.executable).parent / "spark-submit"
    out = subprocess.run(
        [str(spark_submit), "--master", spark_standalone.master_url,
         "--py-files", str(archive), "--packages", JDBC_DRIVER_PACKAGES["postgresql"],
         "--conf", f"spark.pyspark.python={python}", "--conf", f"spark.pyspark.driver.python={python}",
         "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1",
         str(tmp_path / "bundle" / "spark_drain_job.py"), "--outbox", fresh_postgres_url,
         "--bootstrap-servers", kafka_bootstrap, "--partitions", "2"],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path,
    )
    # Spark's own log (Ivy's report above all) is long: the job's one-line error says why. Under
    # spark-submit the driver's stderr goes to stdout.
    assert out.returncode == 0, [line for line in (out.stdout + out.stderr).splitlines() if "rror" in line][-10:]
    total = next(line.split() for line in out.stdout.splitlines() if line.startswith("TOTAL"))
    assert total[1:] == ["5000", "5000", "0", "0", "0"]
    assert pending(fresh_postgres_url) == 0
    check_consumed(consume_all(topic, 5000, timeout=60), ids)


# An encrypted outbox (docs/encryption.md, "Spark"): the job opens what it reads with the keys it
# is given, seals what it writes back with the newest, and never lets a key's bytes out.


def new_key(tmp_path: Path, name: str) -> tuple[Key, Path, list[str]]:
    """A key, its file (hex text), and the spellings of its bytes that must never be printed."""
    secret = os.urandom(32)
    path = tmp_path / name
    path.write_text(secret.hex())
    return Key(secret), path, [secret.hex(), secret.hex().upper(), base64.b64encode(secret).decode()]


def enc_keys(path: Path) -> set[str | None]:
    with sqlite3.connect(path) as c:
        return {k for (k,) in c.execute("SELECT DISTINCT enc_key FROM outbox")}


def test_an_encrypted_outbox_drains_in_key_order_once_and_no_key_byte_leaks(
    tmp_path: Path, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]]
) -> None:
    """`spark-submit spark_drain/job.py --key-file` on local[2], the event log on: everything
    delivered in key order, once; the key's bytes are in no output and no event log."""
    path = tmp_path / "outbox.db"
    url = f"sqlite:///{path}"
    key, key_file, spelled = new_key(tmp_path, "outbox.key")
    n = 10_000
    with open_outbox(url, encryption=KeyRing([key])) as store:
        ids = fill(store, topic, n)
    assert enc_keys(path) == {key.id}
    events = tmp_path / "events"
    events.mkdir()
    spark_submit = Path(sys.executable).parent / "spark-submit"
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    env.pop(KEYS_ENV, None)

    def submit() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(spark_submit), "--master", "local[2]", "--jars", jdbc_jar("sqlite"),
             "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1",
             "--conf", "spark.eventLog.enabled=true", "--conf", f"spark.eventLog.dir=file://{events}",
             "--conf", "spark.eventLog.compress=false",  # read as text below
             str(ROOT / "spark_drain" / "job.py"), "--outbox", url, "--bootstrap-servers", kafka_bootstrap,
             "--partitions", "2", "--key-file", str(key_file)],
            capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
        )

    out = submit()
    assert out.returncode == 0, out.stderr[-3000:]
    total = next(line.split() for line in out.stdout.splitlines() if line.startswith("TOTAL"))
    assert total[1:] == [str(n), str(n), "0", "0", "0"]
    assert pending(url) == 0
    messages = consume_all(topic, n, timeout=60)
    assert len(messages) == n
    check_consumed(messages, ids)

    again = submit()  # nothing left: a re-run sends nothing
    assert again.returncode == 0, again.stderr[-3000:]
    assert topic_size(kafka_bootstrap, topic) == n

    logs = [p.read_text(errors="replace") for p in events.rglob("*") if p.is_file()]
    assert logs, "no Spark event log was written"
    # Given keys, the job has Spark encrypt its local files (the shuffle holds decrypted messages).
    assert any('"spark.io.encryption.enabled":"true"' in text for text in logs)
    assert "spark.io.encryption.enabled is off" not in out.stderr
    for text in [out.stdout, out.stderr, again.stdout, again.stderr, *logs]:
        for s in spelled:
            assert s not in text


def test_an_encrypted_dead_letter_replay_and_a_split_group_are_sealed_with_the_newest_key(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, make_topic: Callable[..., str],
    consume_all: Callable[..., list[Any]],
) -> None:
    """Rows sealed with an old key, the job given [new, old]: a group split by a refused message
    is rewritten on an executor, its dead letter sealed with the new key; a replay of the dead
    letters (sealed with either key) delivers the others and dead-letters the refused one again."""
    path = tmp_path / "outbox.db"
    url = f"sqlite:///{path}"
    old, _, _ = new_key(tmp_path, "old.key")
    new, _, _ = new_key(tmp_path, "new.key")
    small = make_topic(partitions=2, config={"max.message.bytes": "4096"})
    keys = 20
    stored = [
        NewMessage(small, b"x" * 20000 if i == 25 else f"k{i % keys}:{i // keys + 1}".encode(),
                   f"k{i % keys}".encode(), msg_id=f"s-{i}")
        for i in range(200)
    ]
    with open_outbox(url, encryption=KeyRing([old])) as store:
        store.enqueue(stored)
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT COUNT(*), MAX(n) FROM outbox").fetchone() == (1, 200)  # one group
    assert enc_keys(path) == {old.id}
    ring = KeyRing([new, old])

    report = run_job(spark, opts(url, kafka_bootstrap, max_attempts=5, retry_delay=0, keys=ring))

    assert (report.total.read, report.total.delivered, report.total.dead, report.total.left) == (200, 199, 1, 0)
    assert enc_keys(path) == {new.id}  # the dead letter, written back by an executor
    with sqlite3.connect(path) as c:
        (value,) = c.execute("SELECT value FROM outbox").fetchone()
    assert b"xxxx" not in value
    with open_outbox(url, create=False, encryption=ring) as store:
        dead = store.list_dead()
        assert [d.msg_id for d in dead] == ["s-25"] and dead[0].value == b"x" * 20000
    with open_outbox(url, create=False, encryption=KeyRing([old])) as store:
        store.add_dead([NewMessage(small, f"d:{i}".encode(), b"d", msg_id=f"d-{i}", attempts=3,
                                   last_error="_MSG_TIMED_OUT (-192): Local: Message timed out")
                        for i in range(1, 51)], failed_at=time.time() - 30)
    assert enc_keys(path) == {new.id, old.id}
    got = consume_all(small, 199, timeout=60)
    assert sorted(header(m, "outbox-id") or b"" for m in got) == sorted(
        f"s-{i}".encode() for i in range(200) if i != 25
    )

    replay = run_job(spark, opts(url, kafka_bootstrap, dead_letters=True, max_attempts=5, keys=ring))

    assert replay.replayed == 51
    assert (replay.total.delivered, replay.total.dead, replay.total.left) == (50, 1, 0)
    with open_outbox(url, create=False, encryption=ring) as store:
        assert [d.msg_id for d in store.list_dead()] == ["s-25"]
        assert store.stats(now=time.time() + 3600).pending == 0
    got = consume_to_end(kafka_bootstrap, small)
    assert len(got) == 249
    assert [m.value() for m in got if m.key() == b"d"] == [f"d:{i}".encode() for i in range(1, 51)]


def test_an_outbox_encrypted_with_a_key_not_given_is_refused_before_anything_is_sent(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, topic: str,
) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    key, _, _ = new_key(tmp_path, "outbox.key")
    other, _, _ = new_key(tmp_path, "other.key")
    with open_outbox(url, encryption=KeyRing([key])) as store:
        fill(store, topic, 100)

    for given in (None, KeyRing([other])):
        with pytest.raises(ConfigError) as exc:
            run_job(spark, opts(url, kafka_bootstrap, keys=given))
        assert key.id in str(exc.value) and "--key-file" in str(exc.value)
        assert other.id not in str(exc.value)

    assert pending(url) == 100  # every row still pending: none sent, none dead-lettered
    with open_outbox(url, create=False) as store:
        assert store.list_dead() == []
    assert in_topic(kafka_bootstrap, topic) == 0


def test_standalone_cluster_drains_an_encrypted_postgresql_outbox(
    spark_standalone: Any, fresh_postgres_url: str, kafka_bootstrap: str, topic: str,
    consume_all: Callable[..., list[Any]], tmp_path: Path,
) -> None:
    """`python -m spark_drain --master spark://…` with the keys in $OUTBOX_ENCRYPTION_KEYS: the
    executors in the workers' JVMs open the rows with the ring their tasks carry."""
    key, _, spelled = new_key(tmp_path, "outbox.key")
    open_outbox(fresh_postgres_url).close()
    with open_outbox(fresh_postgres_url, create=False, encryption=KeyRing([key])) as store:
        ids = fill(store, topic, N_ROWS)
        assert store.encrypted_key_ids() == [key.id]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    env[KEYS_ENV] = spelled[2]  # base64
    out = subprocess.run(
        [sys.executable, "-m", "spark_drain", "--master", spark_standalone.master_url,
         "--jars", jdbc_jar("postgresql"), "--outbox", fresh_postgres_url,
         "--bootstrap-servers", kafka_bootstrap, "--partitions", "2"],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    total = next(line.split() for line in out.stdout.splitlines() if line.startswith("TOTAL"))
    assert total[1:] == [str(N_ROWS), str(N_ROWS), "0", "0", "0"]
    assert pending(fresh_postgres_url) == 0
    messages = consume_all(topic, N_ROWS, timeout=120)
    assert len(messages) == N_ROWS
    check_consumed(messages, ids)
    for s in spelled:
        assert s not in out.stdout and s not in out.stderr


# Selecting and changing messages before they are sent (docs/spark.md, "Fix and redirect before
# sending"): --where, --set, --to-topic and --transform, on the executors, before the send stage.

TRANSFORMS = "tests.integration.spark_transforms"
TIMED_OUT = "_MSG_TIMED_OUT (-192): Local: Message timed out"
#: The incident's fix: "amount" was stored as text ("12.50"); consumers want whole cents (1250).
CENTS = (
    "value=to_json(named_struct('order', cast(get_json_object(cast(value as string), '$.order') as int), "
    "'amount', cast(cast(get_json_object(cast(value as string), '$.amount') as decimal(10,2)) * 100 as int)))"
)
ACME = "header['tenant'] = 'acme'"


def orders(topic: str, n: int, now: float) -> list[NewMessage]:
    """n dead letters of `topic` with a bad "amount", over 5 keys, tenants acme (2 of 3) and globex."""
    return [
        NewMessage(topic=topic, value=json.dumps({"order": i, "amount": f"{i}.50"}).encode(), key=f"c{i % 5}".encode(),
                   headers=[("tenant", b"globex" if i % 3 == 0 else b"acme"), ("outbox-id", f"o-{i}".encode())],
                   msg_id=f"o-{i}", attempts=3, first_failed_at=now - 60, last_error=TIMED_OUT, error_code=-192,
                   error_name="_MSG_TIMED_OUT", timestamp=STAMP + i)
        for i in range(1, n + 1)
    ]


def check_orders(messages: list[Any], numbers: list[int]) -> None:
    """The fixed orders `numbers` arrived, each with its outbox-id, tenant and timestamp, each key's in order."""
    got = {int(json.loads(m.value())["order"]): m for m in messages}
    assert sorted(got) == numbers and len(messages) == len(numbers)
    for i, m in got.items():
        assert json.loads(m.value()) == {"order": i, "amount": i * 100 + 50}
        assert header(m, "outbox-id") == f"o-{i}".encode()
        assert header(m, "tenant") == (b"globex" if i % 3 == 0 else b"acme")
        assert header(m, "outbox-attempt") == b"1"  # a replay resets attempts
        assert m.timestamp() == (TIMESTAMP_CREATE_TIME, STAMP + i)
        assert m.key() == f"c{i % 5}".encode()
    for k in range(5):
        seq = [int(json.loads(m.value())["order"]) for m in messages if m.key() == f"c{k}".encode()]
        assert seq == sorted(seq), f"key c{k} out of order: {seq}"


def test_dead_letters_of_a_topic_are_fixed_with_set_value_and_replayed(
    spark: Any, outbox_url: str, kafka_bootstrap: str, make_topic: Callable[..., str],
) -> None:
    """The incident: `orders` dead-lettered with a bad amount. `--dead-letters --topic orders --set
    value=...` replays them fixed; another topic's dead letter and the pending rows stay as they were."""
    topic, other = make_topic(), make_topic()
    now = time.time()
    with open_outbox(outbox_url, create=False) as store:
        keep = fill(store, topic, 10)
        store.add_dead(orders(topic, 120, now) + [
            NewMessage(topic=other, value=b"{}", key=b"c1", msg_id="other", attempts=3, last_error=TIMED_OUT,
                       error_code=-192, error_name="_MSG_TIMED_OUT")], failed_at=now - 30)

    report = run_job(spark, opts(outbox_url, kafka_bootstrap, dead_letters=True, topics=(topic,),
                                 sets=(("value", CENTS.partition("=")[2]),)))

    assert report.replayed == 120 and report.ok
    assert (report.total.read, report.total.delivered, report.skipped) == (120, 120, 0)
    check_orders(consume_to_end(kafka_bootstrap, topic), list(range(1, 121)))
    with open_outbox(outbox_url, create=False) as store:
        assert [d.msg_id for d in store.list_dead()] == ["other"]
        assert store.stats(now=time.time() + 10**6).pending == len(keep)


def test_changes_that_read_no_header_keep_every_stored_header_and_redirect_with_the_original_topic(
    spark: Any, outbox_url: str, kafka_bootstrap: str, topic: str, make_topic: Callable[..., str],
) -> None:
    """`--where` on the key, `--set value=` and `--to-topic` (no step reads headers, so they pass
    through as stored): the selected keys arrive at the other topic in order, changed, with their
    own headers and `outbox-original-topic`; the other keys stay pending, untouched."""
    target = make_topic()
    with open_outbox(outbox_url, create=False) as store:
        ids = fill(store, topic, 640)
    chosen = {b"k1", b"k2"}
    report = run_job(spark, opts(outbox_url, kafka_bootstrap, where="cast(key AS STRING) IN ('k1', 'k2')",
                                 sets=(("value", "concat(value, X'21')"),), to_topic=target))
    assert report.topics[target].delivered == 20 and report.skipped == 620
    got = consume_to_end(kafka_bootstrap, target)
    assert len(got) == 20 and {m.key() for m in got} == chosen
    for m in got:
        assert m.value().endswith(b"!") and header(m, "app") == b"x"
        assert header(m, "outbox-original-topic") == topic.encode()
        assert header(m, "outbox-id") in {i.encode() for i in ids}
    for k in chosen:
        seqs = [int(m.value()[:-1].split(b":")[1]) for m in got if m.key() == k]
        assert seqs == list(range(1, 11))
    assert in_topic(kafka_bootstrap, topic) == 0
    assert pending(outbox_url) == 620


def test_one_tenants_dead_letters_are_replayed_to_another_topic(
    spark: Any, outbox_url: str, kafka_bootstrap: str, make_topic: Callable[..., str],
) -> None:
    """`--where "header['tenant'] = 'acme'" --to-topic T --transform`: acme's dead letters go to T, fixed, with
    `outbox-original-topic`; the other tenant's stay dead as they were, nothing reaches the old topic."""
    topic = make_topic()
    target = make_topic()
    now = time.time()
    with open_outbox(outbox_url, create=False) as store:
        store.add_dead(orders(topic, 90, now), failed_at=now - 30)
    acme = [i for i in range(1, 91) if i % 3]
    # The fix by a Python transform this time (pandas), after --where and --to-topic.
    options = {"dead_letters": True, "where": ACME, "to_topic": target, "transform": f"{TRANSFORMS}:amounts_in_cents"}

    dry = run_job(spark, opts(outbox_url, kafka_bootstrap, dry_run=True, **options))
    assert dry.dry_run and {t: c.read for t, c in dry.topics.items()} == {target: len(acme)}
    assert dry.skipped == 90 - len(acme)

    report = run_job(spark, opts(outbox_url, kafka_bootstrap, **options))

    assert report.replayed == len(acme) and report.skipped == 90 - len(acme) and report.ok
    assert report.topics[target].delivered == len(acme)
    got = consume_to_end(kafka_bootstrap, target)
    check_orders(got, acme)
    assert {header(m, "outbox-original-topic") for m in got} == {topic.encode()}
    assert in_topic(kafka_bootstrap, topic) == 0
    with open_outbox(outbox_url, create=False) as store:
        dead = store.list_dead()
        assert sorted(d.msg_id for d in dead) == sorted(f"o-{i}" for i in range(1, 91) if i % 3 == 0)
        assert {(d.topic, d.attempts) for d in dead} == {(topic, 3)}
        assert all(b'"amount": "' in (d.value or b"") for d in dead)  # untouched
        assert store.stats(now=time.time() + 10**6).pending == 0


def test_a_transform_routes_changes_and_drops_pending_messages_in_key_order(
    spark: Any, outbox_url: str, kafka_bootstrap: str, topic: str, make_topic: Callable[..., str],
    consume_all: Callable[..., list[Any]],
) -> None:
    """`--transform`: odd keys to another topic, values changed, k0's fifth message dropped. The
    dropped message stays pending untouched and holds back k0's later ones, which a later drain
    sends in order; every other key arrives whole, in order, with its outbox-id."""
    odd = make_topic(name=f"{topic}-odd")
    n = 2000
    with open_outbox(outbox_url, create=False) as store:
        ids = fill(store, topic, n)
    k0 = [i for i in range(n) if i % N_KEYS == 0]  # k0's messages, seq 1.. in order

    held = len(k0) - 5  # k0:6 and after, behind the dropped k0:5
    dry = run_job(spark, opts(outbox_url, kafka_bootstrap, transform=f"{TRANSFORMS}:route_odd_keys", dry_run=True))
    # The dry run holds back what the run will: k0's messages after the dropped one.
    assert (dry.skipped, dry.held_back, dry.total.read) == (1, held, n - held - 1)
    assert dry.topics[odd].read == n // 2 and pending(outbox_url) == n

    report = run_job(spark, opts(outbox_url, kafka_bootstrap, transform=f"{TRANSFORMS}:route_odd_keys"))

    assert (report.skipped, report.held_back) == (1, held)
    assert report.total.delivered == report.total.read == n - held - 1 and not report.ok  # held back
    assert report.topics[odd].delivered == n // 2
    with open_outbox(outbox_url, create=False) as store:
        assert store.pending_keys() == {(topic, b"k0")}
        assert store.stats(now=time.time() + 10**6).pending == held + 1
    to_odd = consume_all(odd, n // 2, timeout=60)
    assert len(to_odd) == n // 2
    assert {header(m, "outbox-original-topic") for m in to_odd} == {topic.encode()}
    sent = consume_all(topic, n // 2 - held - 1, timeout=60)
    assert len(sent) == n // 2 - held - 1
    assert all(header(m, "outbox-original-topic") is None for m in sent)
    assert {m.value()[-1:] for m in sent + to_odd} == {b"!"}
    check_consumed([Unmarked(m) for m in sent + to_odd], [ids[i] for i in range(n) if i not in k0[4:]])

    again = run_job(spark, opts(outbox_url, kafka_bootstrap))  # no transform: k0's rest, as stored

    assert again.total.delivered == held + 1 and pending(outbox_url) == 0
    k0_got = [m.value() for m in consume_all(topic, n // 2, timeout=60) if m.key() == b"k0"]
    # The dropped message as it was; the ones held back behind it as the transform changed them.
    assert k0_got == [b"k0:%d!" % s for s in range(1, 5)] + [b"k0:5"] + [
        b"k0:%d!" % s for s in range(6, len(k0) + 1)]


class Unmarked:
    """A consumed message with the transform's trailing "!" taken off its value."""

    def __init__(self, m: Any) -> None:
        self.m = m

    def value(self) -> bytes:
        return self.m.value().rstrip(b"!")  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.m, name)


@pytest.mark.parametrize("dead_letters", [False, True], ids=["pending", "dead-letters"])
def test_a_failing_transform_sends_nothing_and_changes_no_row(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, topic: str, dead_letters: bool,
) -> None:
    """A transform that raises, or returns other ids or keys, stops the job before the send stage:
    the error names the message and the cause; nothing is in Kafka; every row is as it was."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    now = time.time()
    msgs = [NewMessage(topic=topic, value=b"poison" if i == 150 else b"k%d:%d" % (i % 4, i), key=b"k%d" % (i % 4),
                       msg_id=f"p-{i}", attempts=3 if dead_letters else 0,
                       last_error=TIMED_OUT if dead_letters else None)
            for i in range(300)]
    with open_outbox(url) as store:
        if dead_letters:
            store.add_dead(msgs, failed_at=now - 30)
            poisoned = next(d.id for d in store.list_dead() if d.msg_id == "p-150")
        else:
            store.enqueue(msgs[:100])
            store.enqueue(msgs[100:])
            poisoned = None

    def state() -> tuple[int, list[tuple[str, int]]]:
        with open_outbox(url, create=False) as store:
            return (store.stats(now=time.time() + 10**6).pending,
                    sorted((d.msg_id, d.attempts) for d in store.list_dead()))

    before = state()
    with pytest.raises(OutboxError) as exc:
        run_job(spark, opts(url, kafka_bootstrap, dead_letters=dead_letters, transform=f"{TRANSFORMS}:poison"))
    text = str(exc.value)
    assert "nothing was sent" in text and "ValueError: cannot read 'poison'" in text
    if poisoned is not None:
        assert f"message id {poisoned}:" in text
    else:
        assert "message id " in text
    for name, why in (("new_ids", "which it was not given"), ("new_keys", "changed the key")):
        with pytest.raises(OutboxError, match=why):
            run_job(spark, opts(url, kafka_bootstrap, dead_letters=dead_letters, transform=f"{TRANSFORMS}:{name}"))
    assert in_topic(kafka_bootstrap, topic) == 0
    assert state() == before


def test_a_changed_message_kafka_refuses_is_dead_lettered_as_changed(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, make_topic: Callable[..., str],
) -> None:
    """`--set value=` makes one message too large for the topic: the retry policy dead-letters it
    at once, as changed (a replay sends what the job meant to send); the others are delivered, in
    order, and deleted."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    small = make_topic(partitions=1, config={"max.message.bytes": "4096"})
    with open_outbox(url) as store:
        for v in (b"a:1", b"a:2", b"a:3", b"b:1"):
            store.enqueue([NewMessage(topic=small, value=v, key=v[:1], msg_id=v.decode())])
    grow = "CASE WHEN value = cast('a:2' as binary) THEN repeat('x', 20000) ELSE concat(cast(value as string), '!') END"

    report = run_job(spark, opts(url, kafka_bootstrap, max_attempts=5, retry_delay=0, sets=(("value", grow),)))

    assert (report.total.read, report.total.delivered, report.total.dead) == (4, 3, 1)
    with open_outbox(url, create=False) as store:
        dead = store.list_dead()
        assert [(d.msg_id, d.value, d.attempts) for d in dead] == [("a:2", b"x" * 20000, 1)]
        assert store.stats(now=time.time() + 3600).pending == 0
    got = [m.value() for m in consume_to_end(kafka_bootstrap, small)]
    assert sorted(got) == [b"a:1!", b"a:3!", b"b:1!"]
    assert [v for v in got if v.startswith(b"a")] == [b"a:1!", b"a:3!"]  # key a in order


#: Sends to a topic that does not exist fail (retriably) within 3 s instead of creating it.
NO_AUTO_CREATE = {"allow.auto.create.topics": "false", "message.timeout.ms": "3000"}


def test_changed_messages_not_delivered_stay_in_the_outbox_changed_and_a_plain_drain_sends_them(
    spark: Any, outbox_url: str, kafka_bootstrap: str, make_topic: Callable[..., str],
) -> None:
    """`--where`, `--set value=` and `--set topic=` to a topic that does not exist yet: the first
    message of key a fails (retriably), the two after it are held back, b:1 grows too large and is
    dead-lettered. Each is left in the outbox as changed (topic, value, `outbox-original-topic`);
    the unselected row is untouched. Once the topic exists, `outbox drain` sends the changed
    messages, key a in order."""
    small = make_topic(partitions=1, config={"max.message.bytes": "4096"})
    gone, later = f"{small}-gone", f"{small}-later"  # neither exists
    with open_outbox(outbox_url, create=False) as store:
        [unselected] = store.enqueue([NewMessage(small, b"u:1", b"u", headers=[("app", b"x")], msg_id="u:1")])
        store.enqueue([NewMessage(small, v.encode(), v[:1].encode(), msg_id=v) for v in ("b:1", "b:2", "c:1")])
        store.enqueue([NewMessage(gone, v.encode(), b"a", headers=[("app", b"x")], msg_id=v)
                       for v in ("a:1", "a:2", "a:3")])
    before = {r["id"]: r for r in stored_rows(outbox_url)}
    grow = "CASE WHEN value = cast('b:1' as binary) THEN repeat('x', 20000) ELSE concat(cast(value as string), '!') END"
    move = f"CASE WHEN topic = '{gone}' THEN '{later}' ELSE topic END"

    report = run_job(spark, opts(
        outbox_url, kafka_bootstrap, where="key <> cast('u' AS BINARY)", sets=(("value", grow), ("topic", move)),
        mark_batch=1, max_attempts=5, retry_delay=0, kafka_config=NO_AUTO_CREATE,
    ))

    t = report.total
    assert (t.delivered, t.failed, t.dead, t.left, report.skipped) == (2, 1, 1, 2, 1)
    with open_outbox(outbox_url, create=False) as store:
        [dead] = store.list_dead()
        assert (dead.msg_id, dead.topic, dead.value) == ("b:1", small, b"x" * 20000)
        left = sorted((m for m in store.messages() if m.status is Status.PENDING), key=lambda m: m.id)
        assert [m.msg_id for m in left] == ["u:1", "a:1", "a:2", "a:3"]
        assert left[0] == store.get(unselected) and left[0].value == b"u:1"
        for m in left[1:]:
            assert (m.topic, m.value, m.key, m.partition) == (later, m.msg_id.encode() + b"!", b"a", -1)
            names = dict(m.headers)
            assert names["app"] == b"x" and names["outbox-original-topic"] == gone.encode()
            assert names["outbox-changed"]
        assert [m.attempts for m in left[1:]] == [1, 0, 0]
    assert stored_rows(outbox_url)[0] == before[unselected]  # byte for byte

    make_topic(partitions=1, name=later)
    plain = url_for_cli(outbox_url)
    drain = subprocess.run([str(Path(sys.executable).parent / "outbox"), "drain", "--outbox", plain,
                            "-b", kafka_bootstrap, "--until-empty"], capture_output=True, text=True, timeout=120)
    assert drain.returncode == 0, drain.stderr[-2000:]
    got = consume_to_end(kafka_bootstrap, later)
    assert [m.value() for m in got] == [b"a:1!", b"a:2!", b"a:3!"]
    assert {header(m, "outbox-original-topic") for m in got} == {gone.encode()}
    assert sorted(m.value() for m in consume_to_end(kafka_bootstrap, small)) == [b"b:2!", b"c:1!", b"u:1"]
    assert pending(outbox_url) == 0


def url_for_cli(url: str) -> str:
    """The outbox URL as the `outbox` command takes it (the JDBC form as postgresql://)."""
    parsed = parse_url(url)
    if parsed.kind == "sqlite":
        return f"sqlite:///{parsed.path}"
    kw = parsed.psycopg_kwargs()
    return f"postgresql://{kw['user']}:{kw['password']}@{kw['host']}:{kw['port']}/{kw['dbname']}"


def test_a_rerun_sends_what_an_encrypted_outbox_kept_changed_without_changing_it_again(
    spark: Any, outbox_url: str, kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path,
) -> None:
    """A transform that appends "!", to a topic that does not exist yet: key a's first message
    fails and the others are held back, all kept sealed with the key, changed. Run again once the
    topic exists, the same job sends them as they were changed ("a:1!", never "a:1!!"), in order."""
    topic = f"{make_topic()}-later"
    key, _, _ = new_key(tmp_path, "outbox.key")
    ring = KeyRing([key])
    with open_outbox(outbox_url, create=False, encryption=ring) as store:
        store.enqueue([NewMessage(topic, f"a:{i}".encode(), b"a", msg_id=f"a:{i}") for i in (1, 2, 3)])
    options = {"transform": f"{TRANSFORMS}:exclaim", "keys": ring, "mark_batch": 1, "retry_delay": 0}

    first = run_job(spark, opts(outbox_url, kafka_bootstrap, kafka_config=NO_AUTO_CREATE, **options))

    assert (first.total.failed, first.total.left) == (1, 2)
    assert {r["enc_key"] for r in stored_rows(outbox_url)} == {key.id}
    assert all(b"a:" not in (r["value"] or b"") for r in stored_rows(outbox_url))  # sealed
    with open_outbox(outbox_url, create=False, encryption=ring) as store:
        assert [m.value for m in sorted(store.messages(), key=lambda m: m.id)] == [b"a:1!", b"a:2!", b"a:3!"]

    make_topic(partitions=1, name=topic)
    again = run_job(spark, opts(outbox_url, kafka_bootstrap, **options))

    assert again.total.delivered == 3 and pending(outbox_url) == 0
    got = consume_to_end(kafka_bootstrap, topic)
    assert [m.value() for m in got] == [b"a:1!", b"a:2!", b"a:3!"]
    assert [header(m, "outbox-id") for m in got] == [b"a:1", b"a:2", b"a:3"]


def test_changes_are_checked_before_anything_is_read(spark: Any, tmp_path: Path, kafka_bootstrap: str) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    open_outbox(url).close()
    with pytest.raises(ConfigError, match="cannot import module no_such_module"):
        opts(url, kafka_bootstrap, transform="no_such_module:f")
    with pytest.raises(ConfigError, match=f"module {TRANSFORMS} has no missing"):
        opts(url, kafka_bootstrap, transform=f"{TRANSFORMS}:missing")
    with pytest.raises(ConfigError, match="cannot set column 'key'"):
        opts(url, kafka_bootstrap, sets=(("key", "value"),))
    with pytest.raises(ConfigError, match="both set the topic"):
        opts(url, kafka_bootstrap, sets=(("topic", "'x'"),), to_topic="y")
    for kw, named in (
        ({"where": "no_such_column = 1"}, "--where 'no_such_column = 1'.*no_such_column"),
        ({"where": "value"}, "not a condition"),
        ({"sets": (("value", "1 +"),)}, r"--set value='1 \+'"),
        ({"sets": (("value", "42"),)}, "is int, not a string or binary"),
    ):
        with pytest.raises(ConfigError, match=named):
            run_job(spark, opts(url, kafka_bootstrap, **kw))


def test_cli_dry_run_counts_after_where_and_refuses_bad_changes_in_one_line(
    tmp_path: Path, kafka_bootstrap: str, topic: str,
) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    now = time.time()
    with open_outbox(url) as store:
        store.add_dead(orders(topic, 30, now), failed_at=now - 30)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    base = [sys.executable, "-m", "spark_drain", "--outbox", url, "--bootstrap-servers", kafka_bootstrap]

    for bad, named in ((["--set", "key=x"], "cannot set column 'key'"),
                       (["--transform", "no_such_module:f"], "cannot import module no_such_module")):
        out = subprocess.run(base + bad, capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
        assert out.returncode == 2 and named in out.stderr, out.stderr
        assert "Traceback" not in out.stderr

    out = subprocess.run(
        base + ["--master", "local[2]", "--jars", jdbc_jar("sqlite"), "--dead-letters", "--dry-run",
                "--where", ACME, "--set", CENTS, "--to-topic", "orders-acme"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert next(line.split() for line in out.stdout.splitlines() if line.startswith("orders-acme")) == [
        "orders-acme", "20"]
    assert "10 not selected" in out.stdout
    with open_outbox(url, create=False) as store:
        assert len(store.list_dead()) == 30


# Archives (docs/spark.md, "Archive"): --export to Parquet, --purge-after-export, --from-parquet.

#: The table's columns an archive keeps, in the archive's names ("partition" is quoted in SQL).
ARCHIVED = ("id", "msg_id", "topic", "key", "value", "headers", "partition", "status", "attempts", "created_at",
            "first_failed_at", "last_failed_at", "last_error", "error_code", "error_name", "timestamp", "enc_key")


def stored_rows(url: str) -> list[dict[str, Any]]:
    """Every row of the outbox table as the database holds it (sealed bytes stay sealed), in id order."""
    parsed = parse_url(url)
    with open_outbox(url, create=False) as store:
        table = store.bulk_read().table
    sql = f"SELECT {', '.join(chr(34) + c + chr(34) for c in ARCHIVED)} FROM {table} ORDER BY id"
    if parsed.kind == "sqlite":
        with sqlite3.connect(parsed.path) as c:
            rows = c.execute(sql).fetchall()
    else:
        import psycopg

        with psycopg.connect(**parsed.psycopg_kwargs()) as pg:  # type: ignore[arg-type]
            rows = pg.execute(sql).fetchall()
    return [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in zip(ARCHIVED, r, strict=True)} for r in rows]


def audit(url: str) -> list[Any]:
    with open_outbox(url, create=False) as store:
        return store.audit_log(limit=1000)


def read_archive(path: Path) -> list[dict[str, Any]]:
    """An archive's rows read back with pyarrow (topic and day from the Hive-style directories), in id order."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    parts = ds.partitioning(pa.schema([("topic", pa.string()), ("day", pa.string())]), flavor="hive")
    table = ds.dataset(str(path), format="parquet", partitioning=parts).to_table()
    return sorted(table.to_pylist(), key=lambda r: r["id"])


def utc_day(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d")


def letters(topic: str, n: int, now: float, *, start: int = 1) -> list[NewMessage]:
    """Dead letters of `topic`, tenants acme (2 of 3) and globex; some without a key, some with outbox-id stored."""
    def headers(i: int) -> list[tuple[str, bytes | None]]:
        tenant: list[tuple[str, bytes | None]] = [("tenant", b"globex" if i % 3 == 0 else b"acme")]
        return tenant + ([("outbox-id", f"{topic}-{i}".encode())] if i % 2 else [])

    return [
        NewMessage(topic=topic, value=f"{topic}:{i}".encode(), key=None if i % 7 == 0 else f"c{i % 5}".encode(),
                   headers=headers(i),
                   msg_id=f"{topic}-{i}", attempts=3, first_failed_at=now - 6 * 86400, last_error=TIMED_OUT,
                   error_code=-192, error_name="_MSG_TIMED_OUT", timestamp=STAMP + i, partition=i % 2 if i % 4 else -1)
        for i in range(start, start + n)
    ]


def test_dead_letters_are_archived_by_topic_and_day_as_stored_and_purged_only_when_asked(
    spark: Any, outbox_url: str, tmp_path: Path,
) -> None:
    """`--export` of dead letters: one Parquet row per dead letter, under topic=/day= of its last
    failure, every column as the table holds it; the outbox is left exactly as it was. Then
    `--purge-after-export` of one topic's acme letters deletes exactly those, with an audit entry."""
    now = time.time()
    day_a, day_b = now - 3 * 86400, now - 86400
    with open_outbox(outbox_url, create=False) as store:
        fill(store, "orders", 30)  # pending: not part of a dead-letter export
        store.add_dead(letters("orders", 20, now), failed_at=day_a)
        store.add_dead(letters("orders", 20, now, start=21) + letters("payments", 10, now), failed_at=day_b)
    before, logged = stored_rows(outbox_url), audit(outbox_url)
    dead = [r for r in before if r["status"] == Status.DEAD]
    assert len(dead) == 50
    archive = tmp_path / "archive"

    report = run_job(spark, opts(outbox_url, "", dead_letters=True, export=str(archive)))

    assert report.mode == "export" and report.ok and report.purged == 0
    assert {t: c.read for t, c in report.topics.items()} == {"orders": 40, "payments": 10}
    assert stored_rows(outbox_url) == before and audit(outbox_url) == logged  # nothing changed
    assert {(p.parent.name, p.name) for p in archive.glob("topic=*/day=*")} == {
        ("topic=orders", f"day={utc_day(day_a)}"), ("topic=orders", f"day={utc_day(day_b)}"),
        ("topic=payments", f"day={utc_day(day_b)}"),
    }
    got = read_archive(archive)
    assert [{k: g[k] for k in (*ARCHIVED, "day")} for g in got] == [
        r | {"status": "dead", "day": utc_day(r["last_failed_at"])} for r in dead
    ]
    assert {g["enc_key"] for g in got} == {None}

    acme = [r for r in dead if r["topic"] == "orders" and int(r["msg_id"].split("-")[1]) % 3]
    purged_to = tmp_path / "acme"

    report = run_job(spark, opts(outbox_url, "", dead_letters=True, topics=("orders",), where=ACME,
                                 export=str(purged_to), purge_after_export=True))

    assert report.purged == report.total.read == len(acme)
    assert [g["id"] for g in read_archive(purged_to)] == [r["id"] for r in acme]
    gone = {r["id"] for r in acme}
    assert stored_rows(outbox_url) == [r for r in before if r["id"] not in gone]
    entries = [e for e in audit(outbox_url) if e not in logged]
    assert entries and {(e.action, e.who.split(":")[0]) for e in entries} == {("purge", "spark_drain")}
    assert sum(e.count for e in entries) == len(acme)
    named = json.loads(entries[0].filter)
    assert named["export"] == str(purged_to) and named["where"] == ACME and named["topics"] == ["orders"]


def test_an_archive_is_replayed_once_in_key_order_with_its_ids_and_timestamps(
    spark: Any, outbox_url: str, kafka_bootstrap: str, make_topic: Callable[..., str],
    consume_all: Callable[..., list[Any]], tmp_path: Path,
) -> None:
    """`--export` of pending rows (group rows exploded), then `--from-parquet`: every message
    once, each key in order, with its outbox-id and record timestamp; the outbox is not touched.
    `--where` and `--to-topic` work on an archive too."""
    topic, other = make_topic(), make_topic()
    n = 2000
    with open_outbox(outbox_url, create=False) as store:
        ids = fill(store, topic, n, stamped=True)
    archive = tmp_path / "archive"
    exported = run_job(spark, opts(outbox_url, "", export=str(archive)))
    assert exported.total.read == n and pending(outbox_url) == n
    assert [r["msg_id"] for r in read_archive(archive)] == ids

    report = run_job(spark, opts("", kafka_bootstrap, from_parquet=str(archive)))

    assert report.mode == "archive" and report.ok
    assert (report.total.read, report.total.delivered, report.total.failed, report.total.left) == (n, n, 0, 0)
    messages = consume_all(topic, n, timeout=120)
    assert len(messages) == n and in_topic(kafka_bootstrap, topic) == n  # once
    check_consumed(messages, ids)
    stamps = {header(m, "outbox-id"): m.timestamp() for m in messages}
    assert stamps == {m.encode(): (TIMESTAMP_CREATE_TIME, STAMP + i) for i, m in enumerate(ids)}
    assert {header(m, "outbox-attempt") for m in messages} == {b"1"}
    assert pending(outbox_url) == n  # an archive's replay settles nothing

    k1 = [i for i in range(n) if i % N_KEYS == 1]
    again = run_job(spark, opts("", kafka_bootstrap, from_parquet=str(archive), where="key = cast('k1' as binary)",
                                to_topic=other))

    assert again.ok and again.skipped == n - len(k1) and again.topics[other].delivered == len(k1)
    got = consume_all(other, len(k1), timeout=60)
    assert [m.value() for m in got] == [f"k1:{s}".encode() for s in range(1, len(k1) + 1)]
    assert [header(m, "outbox-id") for m in got] == [ids[i].encode() for i in k1]
    assert {header(m, "outbox-original-topic") for m in got} == {topic.encode()}


def test_an_encrypted_outbox_is_archived_sealed_and_replayed_only_with_its_key(
    spark: Any, tmp_path: Path, kafka_bootstrap: str, make_topic: Callable[..., str],
    consume_all: Callable[..., list[Any]],
) -> None:
    """An encrypted outbox's pending group and dead letters exported: no file holds a byte of
    plaintext, every row names its key; the replay needs the key, and with it delivers all in order."""
    path = tmp_path / "outbox.db"
    url = f"sqlite:///{path}"
    key, _, _ = new_key(tmp_path, "outbox.key")
    ring = KeyRing([key])
    marker = b"PLAINTEXT-MARKER-7f3a"
    topic = make_topic()
    now = time.time()

    def msg(k: int, seq: int, **kw: Any) -> NewMessage:
        secret: list[tuple[str, bytes | None]] = [("secret", marker)]
        return NewMessage(topic=topic, value=b"k%d:%d:" % (k, seq) + marker, key=b"k%d" % k,
                          headers=secret, msg_id=f"e-{k}-{seq}", **kw)

    with open_outbox(url, encryption=ring) as store:
        store.add_dead([msg(k, s, attempts=3, last_error=TIMED_OUT) for s in range(1, 6) for k in range(4)],
                       failed_at=now - 30)
        store.enqueue([msg(k, s) for s in range(6, 56) for k in range(4)])  # one group of 200
    assert enc_keys(path) == {key.id}
    pending_to, dead_to = tmp_path / "pending", tmp_path / "dead"

    assert run_job(spark, opts(url, "", export=str(pending_to), keys=ring)).total.read == 200
    purged = run_job(spark, opts(url, "", dead_letters=True, export=str(dead_to), purge_after_export=True, keys=ring))
    assert purged.purged == 20

    files = [p for p in [*pending_to.rglob("*"), *dead_to.rglob("*")] if p.is_file()]
    assert len([p for p in files if p.suffix == ".parquet"]) >= 2
    for p in files:
        assert marker not in p.read_bytes(), p
    assert {r["enc_key"] for r in read_archive(pending_to) + read_archive(dead_to)} == {key.id}
    with open_outbox(url, create=False, encryption=ring) as store:
        assert store.list_dead() == [] and store.stats(now=time.time() + 10**6).pending == 200

    with pytest.raises(ConfigError, match=f"encrypted with key\\(s\\) {key.id}"):
        run_job(spark, opts("", kafka_bootstrap, from_parquet=str(dead_to)))
    assert in_topic(kafka_bootstrap, topic) == 0

    for archive in (dead_to, pending_to):
        report = run_job(spark, opts("", kafka_bootstrap, from_parquet=str(archive), keys=ring))
        assert report.ok
    got = consume_all(topic, 220, timeout=60)
    assert len(got) == 220
    assert {header(m, "secret") for m in got} == {marker}
    for k in range(4):
        assert [m.value() for m in got if m.key() == b"k%d" % k] == [b"k%d:%d:" % (k, s) + marker for s in range(1, 56)]


def test_cli_archives_and_purges_dead_letters_and_a_replay_says_how_many_were_not_delivered(
    tmp_path: Path, kafka_bootstrap: str, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]],
) -> None:
    """`python -m spark_drain --export --dead-letters --purge-after-export`, then `--from-parquet`
    into a topic that refuses one message for good: exit 1, one line saying how many were not
    delivered, the others delivered in order."""
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    small = make_topic(partitions=1, config={"max.message.bytes": "4096"})
    with open_outbox(url) as store:
        store.add_dead([NewMessage(topic=small, value=v, key=k, msg_id=f"x-{i}", attempts=3, last_error=TIMED_OUT)
                        for i, (k, v) in enumerate([(b"a", b"a:1"), (b"big", b"x" * 20000), (b"a", b"a:2"),
                                                    (b"b", b"b:1")])], failed_at=time.time() - 30)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    base = [sys.executable, "-m", "spark_drain", "--master", "local[2]", "--partitions", "2"]
    archive = tmp_path / "archive"

    out = subprocess.run(
        base + ["--outbox", url, "--jars", jdbc_jar("sqlite"), "--dead-letters", "--export", str(archive),
                "--purge-after-export"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert next(line.split() for line in out.stdout.splitlines() if line.startswith("TOTAL")) == ["TOTAL", "4"]
    assert "4 dead letters purged" in out.stdout
    with open_outbox(url, create=False) as store:
        assert store.list_dead() == [] and [e.action for e in store.audit_log()] == ["purge"]

    out = subprocess.run(
        base + ["--from-parquet", str(archive), "-b", kafka_bootstrap, "--report", str(tmp_path / "r.json")],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "spark_drain: error: 1 of 4 messages of the archive were not delivered (1 failed" in out.stderr
    total = json.loads((tmp_path / "r.json").read_text())["total"]
    assert (total["read"], total["delivered"], total["failed"]) == (4, 3, 1)
    got = [m.value() for m in consume_all(small, 3, timeout=15)]
    assert sorted(got) == [b"a:1", b"a:2", b"b:1"]
    assert [v for v in got if v.startswith(b"a")] == [b"a:1", b"a:2"]  # key a in order
