"""A drain worker never dies of a store failure: PostgreSQL drops its connections mid-drain
("terminating connection due to administrator command"), the worker logs it once, backs off,
retries, the application hears of it, and every message still reaches Kafka."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox import ResilientProducer
from outbox.errors import StoreError
from outbox.records import NewMessage
from outbox.stores.postgres import PostgresOutbox

ROWS = 6000


def _terminate_other_backends(url: str) -> int:
    """pg_terminate_backend on every other connection to this test's own database."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
        return int(row[0]) if row else 0


def test_drain_survives_postgres_dropping_its_connections(
    fresh_postgres_url: str, kafka_bootstrap: str, topic: str, consume_all: Callable[..., list[Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[StoreError] = []
    store = PostgresOutbox(fresh_postgres_url, pool_size=4)
    ids = [f"pg-restart-{i:05d}" for i in range(ROWS)]
    store.enqueue(
        [NewMessage(topic, f"v{i}".encode(), f"k{i % 50}".encode(), [("outbox-id", m.encode())], -1, m)
         for i, m in enumerate(ids)]
    )
    rp = ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap}, outbox=store, drain_workers=2, drain_batch_size=200,
        on_store_error=seen.append,
    )
    try:
        terminated = 0
        for _ in range(4):  # while the workers claim and settle, drop their connections
            time.sleep(0.4)
            terminated += _terminate_other_backends(fresh_postgres_url)
        assert terminated > 0
        deadline = time.monotonic() + 120
        st = rp.stats()
        while time.monotonic() < deadline:
            # Drained, and recovered: a worker whose pooled connection was terminated meets it at
            # its next store call, possibly after the last row went out, and the count is raised
            # just before `on_store_error` is called, so both are read once they agree.
            st = rp.stats()
            if st["pending"] == 0 and st["store_failing_since"] is None and len(seen) == st["store_errors"]:
                break
            time.sleep(0.5)
        assert st["pending"] == 0, st
        assert st["store_errors"] >= 1 and len(seen) == st["store_errors"]
        assert all("PostgreSQL outbox" in str(e) for e in seen)
        assert st["store_failing_since"] is None  # recovered
        drain_threads = [t for t in threading.enumerate() if t.name.startswith("outbox-drain-")]
        assert len(drain_threads) == 2 and all(t.is_alive() for t in drain_threads)
        errors_logged = [r for r in caplog.records if "store failed, retrying" in r.getMessage()]
        assert 1 <= len(errors_logged) <= st["store_errors"]
    finally:
        rp.close(30)
        store.close()
    got = consume_all(topic, ROWS, timeout=60)
    delivered = {dict(m.headers())["outbox-id"].decode() for m in got}
    assert delivered == set(ids)  # every message, duplicates allowed (at-least-once)


def test_a_store_failure_in_a_delivered_listener_does_not_kill_a_drain_worker(
    kafka_bootstrap: str, topic: str, tmp_path: Any, consume_all: Callable[..., list[Any]]
) -> None:
    """The producer's listener of delivered batches reads the store (which keys are free again):
    a store failure there, after the batch was settled, must not end the worker."""
    from outbox import Drainer, Listener
    from outbox.stores.sqlite import SQLiteOutbox

    store = SQLiteOutbox(str(tmp_path / "o.db"))
    ids = [f"hook-{i}" for i in range(2000)]
    store.enqueue([NewMessage(topic, b"v", None, [("outbox-id", m.encode())], -1, m) for m in ids])
    calls: list[int] = []

    class FailsOnce(Listener):
        def delivered(self, rows: Any) -> None:
            calls.append(len(rows))
            if len(calls) == 1:
                raise StoreError("outbox o.db: disk I/O error")

    drainer = Drainer(store, {"bootstrap.servers": kafka_bootstrap}, batch_size=200, poll_interval=0.1)
    drainer.subscribe(FailsOnce())
    drainer.start()
    try:
        deadline = time.monotonic() + 60
        while store.stats(now=time.time()).pending and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.stats(now=time.time()).pending == 0, f"the worker stopped after {len(calls)} batch(es)"
        assert all(t.is_alive() for t in threading.enumerate() if t.name.startswith("outbox-drain-"))
    finally:
        drainer.stop(30)
        store.close()
    assert sum(calls) == len(ids)
    assert drainer.callback_errors.count == 1  # the listener's raise: counted, logged, survived
    got = consume_all(topic, len(ids), timeout=60)
    assert {dict(m.headers())["outbox-id"].decode() for m in got} == set(ids)
