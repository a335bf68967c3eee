"""No drain worker dies silently: the application's callbacks cannot end one, a failed one
restarts, and settings its producer cannot use are refused by the constructor."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from outbox import ConfigError, NewMessage, ResilientProducer, SQLiteOutbox

from ..waiting import wait_until
from .delivery import read_topic

ROWS = 3000


def _stored(path: Path, topic: str) -> list[str]:
    """ROWS rows left in the outbox by an earlier process; returns their ids."""
    ids = [f"m{i}" for i in range(ROWS)]
    with SQLiteOutbox(str(path)) as store:
        store.enqueue(
            [NewMessage(topic, b"v%d" % i, None, [("outbox-id", m.encode())], -1, m) for i, m in enumerate(ids)]
        )
    return ids


def _drained(p: ResilientProducer) -> bool:
    return p.stats()["pending"] == 0


def test_a_raising_stats_cb_is_counted_and_the_drain_still_delivers(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    path = tmp_path / "o.db"
    ids = _stored(path, topic)
    calls: list[str] = []

    def stats_cb(stats_json: str) -> None:
        calls.append(threading.current_thread().name)
        raise RuntimeError("the application's stats_cb has a bug")

    config = {"bootstrap.servers": kafka_bootstrap, "statistics.interval.ms": 100, "stats_cb": stats_cb}
    with ResilientProducer(config, outbox=f"sqlite:///{path}", drain_poll_interval=0.2, drain_batch_size=500) as p:
        wait_until(lambda: _drained(p), 90, "the stored rows are delivered")
        wait_until(lambda: any(t.startswith("outbox-drain-") for t in calls), 30, "a drain worker's stats_cb ran")
        st = p.stats()
    got = read_topic(kafka_bootstrap, topic, ROWS)
    assert got.unique == ROWS and set(got.by_id) == set(ids)
    assert st["delivered_from_outbox"] == ROWS
    assert st["callback_errors"] > 0
    assert st["drain_restarts"] == 0, "a callback must not end a worker"


class FailingClaims(SQLiteOutbox):
    """The real store, except that its first `failures` claims fail with an error that is not a
    StoreError (a bug): the worker that meets one ends, and must be started again."""

    def __init__(self, path: str, failures: int) -> None:
        super().__init__(path)
        self._left = failures
        self._fail_lock = threading.Lock()

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        with self._fail_lock:
            fail = self._left > 0
            self._left -= fail
        if fail:
            raise RuntimeError("a bug in the claim")
        return super().claim(*args, **kwargs)


def test_a_drain_worker_that_fails_is_restarted_counted_and_delivers(
    kafka_bootstrap: str, topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "o.db"
    ids = _stored(path, topic)
    store = FailingClaims(str(path), 3)
    with ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap}, outbox=store,
        drain_poll_interval=0.2, drain_batch_size=500,
    ) as p:
        wait_until(lambda: _drained(p), 120, "the stored rows are delivered")
        st = p.stats()
    store.close()
    got = read_topic(kafka_bootstrap, topic, ROWS)
    assert got.unique == ROWS and set(got.by_id) == set(ids)
    assert st["drain_restarts"] == 3
    assert sum("outbox drain worker restarts in" in r.getMessage() for r in caplog.records) == 3


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"retries": 0}, "retries=0"),
        ({"acks": 1, "enable.idempotence": True}, "acks=1"),
        ({"max.in.flight.requests.per.connection": 10}, "max.in.flight.requests.per.connection=10"),
    ],
)
def test_a_setting_the_re_senders_cannot_use_fails_the_constructor_naming_it(
    kafka_bootstrap: str, tmp_path: Path, setting: dict[str, Any], named: str
) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(ConfigError, match=rf"drain workers' producers cannot use: {named} "):
        ResilientProducer({"bootstrap.servers": kafka_bootstrap, **setting}, outbox=f"sqlite:///{db}")
    assert not db.exists()
    # Without drain workers in this process, the same settings are the application's to choose.
    if "max.in.flight.requests.per.connection" in setting:
        with ResilientProducer(
            {"bootstrap.servers": kafka_bootstrap, **setting}, outbox=f"sqlite:///{db}", drain_workers=0
        ) as p:
            assert p.stats()["drain_restarts"] == 0


def test_the_drain_process_counts_callback_errors_of_its_workers(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    path = tmp_path / "o.db"
    _stored(path, topic)
    config = {"bootstrap.servers": kafka_bootstrap, "statistics.interval.ms": 100, "stats_cb": raising_stats_cb}
    with ResilientProducer(
        config, outbox=f"sqlite:///{path}", drain_in="process", drain_poll_interval=0.2, drain_batch_size=500
    ) as p:
        wait_until(lambda: _drained(p), 90, "the stored rows are delivered")
        wait_until(lambda: p.stats()["callback_errors"] > 0, 30, "the drain process reports its callback errors")
        st = p.stats()
    assert read_topic(kafka_bootstrap, topic, ROWS).unique == ROWS
    assert st["drain_restarts"] == 0


def raising_stats_cb(stats_json: str) -> None:
    """Module level: the drain process's settings are pickled."""
    raise RuntimeError("the application's stats_cb has a bug")
