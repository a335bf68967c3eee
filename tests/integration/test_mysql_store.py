"""The MySQL store on a real MariaDB server (the test bed's): produce(..., transaction=...) with a
PyMySQL connection and a SQLAlchemy Session, delivered through real Kafka; claimers racing on one
table; refusals and errors that name the problem and never the password. The contract itself is
`tests/integration/test_store_contract.py::TestMySQLStore`."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pymysql
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import ID_HEADER, ConfigError, open_outbox
from outbox.errors import StoreError
from outbox.records import NewMessage
from outbox.stores.location import StoreURL
from outbox.stores.mysql import MySQLOutbox
from outbox.stores.urls import parse_url

from .delivery import keyed_value, read_topic
from .test_transactions import delivered_ids, producer

WORKER = Path(__file__).with_name("fleet_worker.py")


def connect(u: StoreURL, **kw: Any) -> pymysql.connections.Connection[Any]:
    return pymysql.connect(
        host=u.host, port=u.port, user=u.user or "", password=u.password or "", database=u.database, **kw
    )


@pytest.fixture
def url(fresh_mysql_url: str) -> StoreURL:
    return parse_url(fresh_mysql_url)


def test_a_pymysql_transaction_holds_the_message_exactly_when_it_commits(
    url: StoreURL, kafka_bootstrap: str, topic: str
) -> None:
    with producer(kafka_bootstrap, _plain(url)) as p:
        app = connect(url, autocommit=False)
        with app.cursor() as cur:
            cur.execute("CREATE TABLE orders (id VARCHAR(16) PRIMARY KEY) ENGINE=InnoDB")
            cur.execute("INSERT INTO orders VALUES ('o-1')")
        rolled_back = p.produce(topic, b"o-1", key=b"k", transaction=app)
        assert p.store.stats(now=time.time()).pending == 0  # not committed: not seen by the store
        app.rollback()
        with app.cursor() as cur:
            cur.execute("INSERT INTO orders VALUES ('o-2')")
        committed = p.produce(topic, b"o-2", key=b"k", transaction=app)
        app.commit()
        got = delivered_ids(kafka_bootstrap, topic, p, 1)
        assert p.store.stats(now=time.time()).pending == 0
    assert got == [committed] and rolled_back not in got
    with app.cursor() as cur:
        cur.execute("SELECT id FROM orders")
        assert cur.fetchall() == (("o-2",),)
    app.close()


def test_a_sqlalchemy_session_on_pymysql(url: StoreURL, kafka_bootstrap: str, topic: str) -> None:
    engine = sa.create_engine(
        sa.URL.create(
            "mysql+pymysql",
            username=url.user,
            password=url.password,
            host=url.host,
            port=url.port,
            database=url.database,
        )
    )
    with producer(kafka_bootstrap, _plain(url)) as p:
        with engine.begin() as c:
            c.execute(sa.text("CREATE TABLE orders (id VARCHAR(16) PRIMARY KEY) ENGINE=InnoDB"))
        with Session(engine) as s:
            s.execute(sa.text("INSERT INTO orders VALUES ('s-1')"))
            rolled_back = p.produce(topic, b"s-1", transaction=s)
            s.rollback()
        with Session(engine) as s, s.begin():
            s.execute(sa.text("INSERT INTO orders VALUES ('s-2')"))
            committed = p.produce(topic, b"s-2", transaction=s)
        got = delivered_ids(kafka_bootstrap, topic, p, 1)
    assert got == [committed] and rolled_back not in got
    engine.dispose()


def test_refusals_name_the_problem(url: StoreURL, mysql_server: str) -> None:
    with open_outbox(_plain(url)) as store:
        auto = connect(url, autocommit=True)
        with pytest.raises(ConfigError, match="autocommit mode"):
            store.enqueue_in_transaction(auto, [NewMessage(topic="t", value=b"x")])
        other = connect(parse_url(mysql_server), autocommit=False)
        with pytest.raises(ConfigError, match="to database 'mysql', but the outbox is in MySQL outbox"):
            store.enqueue_in_transaction(other, [NewMessage(topic="t", value=b"x")])
        with pytest.raises(ConfigError, match="must be a PyMySQL connection"):
            store.enqueue_in_transaction(object(), [NewMessage(topic="t", value=b"x")])
        auto.close()
        other.close()
        assert store.stats(now=time.time()).pending == 0
    with pytest.raises(StoreError, match="no outbox table 'nothing_here'"):
        MySQLOutbox(parse_url(_plain(url) + "?table=nothing_here"), create=False)


def test_a_wrong_password_is_named_and_never_shown(url: StoreURL) -> None:
    secret = "s3cr3t-pw-never-shown"
    wrong = f"mysql://{url.user}:{secret}@{url.host}:{url.port}/{url.database}"
    with pytest.raises(StoreError) as info:
        open_outbox(wrong)
    text = str(info.value)
    assert f"MySQL outbox {url.host}:{url.port}/{url.database}: authentication failed for user" in text
    assert secret not in text and secret not in repr(info.value) and "\n" not in text
    with pytest.raises(ConfigError, match="MySQL outbox URL needs a database name") as bad:
        parse_url(f"mysql://app:{secret}@db.example/")
    assert secret not in str(bad.value)


def test_claimers_on_one_table_take_each_message_once_and_each_key_in_order(url: StoreURL) -> None:
    """Four claimers, each its own store (its own connections), on one table of 2,000 messages over
    20 keys; each settles what it claimed at once. SKIP LOCKED keeps them off each other's rows, and
    the per-key rule keeps a key's messages in id order across them."""
    keys = [b"k%d" % i for i in range(20)]
    with open_outbox(_plain(url)) as seed:
        ids = seed.enqueue([NewMessage(topic="t", value=b"%d" % i, key=keys[i % 20]) for i in range(2000)])
    delivered: list[tuple[bytes, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claimer(name: str) -> None:
        try:
            with open_outbox(_plain(url)) as store:
                idle = 0
                while idle < 20:
                    got = store.claim(name, 50, 60, now=time.time())
                    if not got:
                        idle += 1
                        time.sleep(0.02)
                        continue
                    idle = 0
                    with lock:  # recorded before the rows are gone: a later claim of the key follows it
                        delivered.extend((m.key or b"", m.id) for m in got)
                    store.mark_delivered([m.id for m in got])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(f"c{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(i for _, i in delivered) == ids  # every message once
    for key in keys:
        mine = [i for k, i in delivered if k == key]
        assert mine == sorted(mine), f"key {key!r} left out of order"


def test_a_pooled_connection_closed_underneath_fails_one_call_by_name_and_is_replaced(url: StoreURL) -> None:
    with MySQLOutbox(url, pool_size=1) as store:
        [i] = store.enqueue([NewMessage(topic="t", value=b"kept")])
        conn = store._pool.get_nowait()
        conn.close()  # as a server gone away leaves it
        store._pool.put(conn)
        with pytest.raises(StoreError, match=r"MySQL outbox .*: the connection to the MySQL server is closed"):
            store.get(i)
        assert store.get(i).value == b"kept"  # on a new connection


def test_the_command_line_reads_and_replays_a_mysql_outbox(url: StoreURL) -> None:
    from click.testing import CliRunner
    from outbox_cli.main import cli

    with open_outbox(_plain(url)) as store:
        store.enqueue([NewMessage(topic="t", value=b"p", key=b"k")])
        dead = NewMessage(topic="t", value=b"d", error_code=10, error_name="MSG_SIZE_TOO_LARGE")
        store.add_dead([dead], failed_at=1.0)
    runner = CliRunner()
    status = runner.invoke(cli, ["status", "--outbox", _plain(url), "--json"])
    assert status.exit_code == 0, status.output
    doc = json.loads(status.output)
    assert (doc["outbox"], doc["pending"], doc["dead"], doc["file_bytes"]) == (url.redacted(), 1, 1, None)
    assert f":{url.password}@" not in status.output
    replay = runner.invoke(cli, ["dlq", "replay", "--outbox", _plain(url), "--json"])
    assert replay.exit_code == 0, replay.output
    with open_outbox(_plain(url)) as store:
        assert (store.stats(now=time.time()).pending, store.count_dead()) == (2, 0)
        store.add_dead([dead], failed_at=1.0)
    purge = runner.invoke(cli, ["dlq", "purge", "--outbox", _plain(url), "--yes", "--json"])
    assert purge.exit_code == 0, purge.output
    with open_outbox(_plain(url)) as store:
        assert store.count_dead() == 0
        assert [(e.action, e.count) for e in store.audit_log()] == [("purge", 1)]


def _plain(url: StoreURL) -> str:
    """The URL with its password, as an application gives it."""
    return f"mysql://{url.user}:{url.password}@{url.host}:{url.port}/{url.database}"


def test_two_drainer_processes_on_one_mysql_outbox_send_each_message_once_and_each_key_in_order(
    url: StoreURL, kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    """Two drainer processes (`fleet_worker.py`) share 10,000 pending messages over 100 keys on one
    MariaDB outbox, each run of 1,000 messages of one quarter of the keys (as four producers, each
    writing its own customers: a claim of one run holds back no other run's keys, so the drainers
    need not take turns). The outbox-ids Kafka acknowledged to each are disjoint and together
    every message; the topic holds each message, and each key's in enqueue order."""
    total, n_keys = 10_000, 100
    topic = make_topic(partitions=6)
    rng = random.Random(7)
    seq = [0] * n_keys
    ids: list[str] = []
    with open_outbox(_plain(url)) as store:
        for start in range(0, total, 5000):
            batch = []
            for i in range(start, start + 5000):
                k = (i // 1000 % 4) * (n_keys // 4) + rng.randrange(n_keys // 4)
                key, value = keyed_value(k, seq[k])
                seq[k] += 1
                ids.append(f"fleet-{i}")
                batch.append(NewMessage(topic, value, key, [(ID_HEADER, ids[-1].encode())], -1, ids[-1]))
            store.enqueue(batch)
        reports = [tmp_path / f"worker-{n}.json" for n in range(2)]
        logs = [tmp_path / f"worker-{n}.log" for n in range(2)]
        procs = []
        for report, log in zip(reports, logs, strict=True):
            with open(log, "wb") as err:
                argv = [sys.executable, str(WORKER), _plain(url), kafka_bootstrap, str(report)]
                procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err))
        for p, log in zip(procs, logs, strict=True):
            assert p.wait(300) == 0, f"drainer exited with {p.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
        stats = store.stats(now=time.time())
    assert (stats.pending, stats.dead) == (0, 0)
    acked = [set(json.loads(r.read_text())["acked"]) for r in reports]
    print(f"\nfleet: {total} messages, {n_keys} keys; delivered per drainer {[len(a) for a in acked]}")
    assert not acked[0] & acked[1], "a message was sent by both drainers"
    assert acked[0] | acked[1] == set(ids) and all(acked), "every message sent, by both drainers"
    got = read_topic(kafka_bootstrap, topic, total, timeout=120)
    assert got.unique == total and set(got.by_id) == set(ids)
    assert got.order_violations() == []
