"""ResilientProducer's checks of its settings (no Kafka needed: they are checked
before anything is opened or started), and the confluent_kafka.Producer API that works
without a broker."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox import ConfigError, ProducerClosedError, ResilientProducer
from outbox.producer.settings import _is_true
from outbox.stores import SQLiteOutbox


@pytest.mark.parametrize("setting", [True, False])
def test_only_error_setting_is_a_bool(setting: bool) -> None:
    assert _is_true(setting) is setting


# confluent_kafka itself takes only a bool for this key ("Expected ... to be bool type").
@pytest.mark.parametrize("setting", ["true", "maybe", 1, None])
def test_an_unreadable_only_error_setting_is_a_clear_error_and_opens_nothing(setting: object, tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(ConfigError, match=r"delivery.report.only.error must be True or False, got "):
        ResilientProducer(
            {"bootstrap.servers": "127.0.0.1:1", "delivery.report.only.error": setting}, outbox=f"sqlite:///{db}"
        )
    assert not db.exists()


@pytest.mark.parametrize("timeout", [-0.1, float("nan")])
def test_a_negative_queue_full_timeout_is_a_clear_error_and_opens_nothing(timeout: float, tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(ConfigError, match=r"queue_full_timeout must be >= 0 seconds, got "):
        ResilientProducer({"bootstrap.servers": "127.0.0.1:1"}, outbox=f"sqlite:///{db}", queue_full_timeout=timeout)
    assert not db.exists()


# -- confluent_kafka.Producer's constructor forms and API, without a broker ----------------------
# No bootstrap.servers: librdkafka holds every message in its queue (no broker, no error), so
# purge() is what reports them; nothing here waits for a timeout.


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'o.db'}"


@pytest.fixture
def producer(url: str) -> Iterator[ResilientProducer]:
    p = ResilientProducer({"message.timeout.ms": 600000}, outbox=url, drain_workers=0)
    yield p
    p.close(5)


Reports = list[tuple[str, int | None]]


def _recorder(name: str, into: Reports) -> Callable[[KafkaError | None, object], None]:
    def cb(err: KafkaError | None, msg: object) -> None:
        into.append((name, None if err is None else err.code()))

    return cb


def test_no_config_is_confluents_type_error() -> None:
    with pytest.raises(TypeError, match="expected configuration dict"):
        ResilientProducer()


def test_a_transactional_id_is_refused_with_the_alternative_and_opens_nothing(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(ConfigError, match=r"cannot hold part of a Kafka transaction.*transaction=conn"):
        ResilientProducer({"transactional.id": "t"}, outbox=f"sqlite:///{db}")
    assert not db.exists()


def test_dotted_keyword_settings_reach_librdkafka_before_anything_is_opened(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(KafkaException, match="No such configuration property"):
        ResilientProducer(**{"no.such.setting": 1}, outbox=f"sqlite:///{db}")  # type: ignore[arg-type]
    assert not db.exists()


@pytest.mark.parametrize(("timestamp", "error"), [("1", TypeError), (1.5, TypeError), (2**63, OverflowError)])
def test_a_bad_timestamp_is_refused_and_nothing_is_produced(
    producer: ResilientProducer, timestamp: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="timestamp"):
        producer.produce("t", b"v", timestamp=timestamp)  # type: ignore[arg-type]
    assert producer.stats()["produced"] == 0
    assert len(producer) == 0


def test_purge_reports_each_message_with_its_callback_and_stores_none(url: str) -> None:
    reports: Reports = []
    p = ResilientProducer(
        {"message.timeout.ms": 600000, "on_delivery": _recorder("default", reports)}, outbox=url, drain_workers=0
    )
    try:
        p.produce("t", b"1")  # the config's default callback
        p.produce("t", b"2", None, -1, _recorder("positional", reports))
        p.produce("t", b"3", on_delivery=_recorder("on_delivery", reports), callback=_recorder("callback", reports))
        assert len(p) == 3
        p.purge(in_queue=False)
        assert reports == []
        p.purge()
        assert sorted(reports) == sorted(
            [("default", KafkaError._PURGE_QUEUE), ("positional", KafkaError._PURGE_QUEUE),
             ("callback", KafkaError._PURGE_QUEUE)]
        )
        assert p.flush(5) == 0
        assert p.poll(0) == 3  # the three reports, served on the delivery thread
        stats = p.stats()
        assert (stats["outboxed"], stats["pending"]) == (0, 0)
    finally:
        assert p.close(5) is True


def test_a_callback_exception_is_raised_by_poll_and_flush_and_counted(producer: ResilientProducer) -> None:
    def boom(err: KafkaError | None, msg: object) -> None:
        raise ValueError(f"callback saw {err.code() if err else None}")

    producer.produce("t", b"1", callback=boom)
    producer.produce("t", b"2", callback=boom)
    producer.purge()
    with pytest.raises(ValueError, match=f"callback saw {KafkaError._PURGE_QUEUE}"):
        producer.poll(5)
    with pytest.raises(ValueError, match=f"callback saw {KafkaError._PURGE_QUEUE}"):
        producer.flush(5)
    assert producer.flush(5) == 0
    assert producer.stats()["callback_errors"] == 2


def test_an_error_cb_exception_is_raised_by_poll(url: str) -> None:
    def error_cb(err: KafkaError) -> None:
        raise RuntimeError(f"error_cb saw {err.name()}")

    p = ResilientProducer({"bootstrap.servers": "127.0.0.1:1", "error_cb": error_cb}, outbox=url, drain_workers=0)
    try:
        with pytest.raises(RuntimeError, match="error_cb saw _"):
            while True:
                p.poll(1)
        assert p.stats()["callback_errors"] >= 1
    finally:
        p.close(5)


def test_poll_counts_the_applications_callbacks(url: str) -> None:
    seen: list[str] = []
    p = ResilientProducer(
        {"statistics.interval.ms": 100, "stats_cb": seen.append}, outbox=url, drain_workers=0
    )
    try:
        served = p.poll()  # blocks until one runs
        assert served >= 1
        assert len(seen) >= served
    finally:
        p.close(5)


def test_produce_batch_checks_all_first_and_marks_what_produce_refused(producer: ResilientProducer) -> None:
    with pytest.raises(TypeError, match="messages must be a list"):
        producer.produce_batch("t", ({"value": b"x"},))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Message value at index 1 must be bytes or str"):
        producer.produce_batch("t", [{"value": b"ok"}, {"value": 1}])
    assert producer.stats()["produced"] == 0
    reports: Reports = []
    batch = [
        {"value": b"a", "headers": [("h", b"1")], "timestamp": 1_700_000_000_000},
        {"value": b"b", "partition": -2},
        {"value": b"c", "callback": _recorder("own", reports)},
    ]
    assert producer.produce_batch("t", batch, on_delivery=_recorder("batch", reports)) == 2
    assert "_error" not in batch[0] and "_error" not in batch[2]
    err = batch[1]["_error"]
    assert isinstance(err, KafkaError) and err.code() == KafkaError._INVALID_ARG
    producer.purge()
    assert sorted(reports) == [("batch", KafkaError._PURGE_QUEUE), ("own", KafkaError._PURGE_QUEUE)]


def test_a_closed_producer_raises_confluents_runtime_error(url: str) -> None:
    p = ResilientProducer({}, outbox=url, drain_workers=0)
    assert bool(p) and len(p) == 0
    assert p.close(5) is True
    assert p.stats()["unsaved_at_close"] == 0
    assert p.close(5) is True  # closing again: confluent_kafka's answer, True
    calls: list[Callable[[], object]] = [
        lambda: p.produce("t", b"v"), lambda: p.poll(0), lambda: p.flush(0), lambda: p.purge(),
        lambda: p.produce_batch("t", [{"value": b"v"}]), lambda: p.list_topics(timeout=0.1),
        lambda: p.init_transactions(0.1), lambda: p.begin_transaction(), lambda: p.commit_transaction(0.1),
        lambda: p.abort_transaction(0.1), lambda: p.set_sasl_credentials("u", "p"),
    ]
    for call in calls:
        with pytest.raises(ProducerClosedError, match="^Producer has been closed$") as info:
            call()
        assert isinstance(info.value, RuntimeError)
    assert len(p) == 0 and bool(p)


def test_close_is_true_once_every_message_is_stored_and_says_so_again(url: str) -> None:
    """No broker: the messages wait in librdkafka's queue until close() purges them into the
    outbox. Each is stored, so close() is True, as confluent_kafka's, and so is a second call."""
    p = ResilientProducer({"message.timeout.ms": 600000}, outbox=url, drain_workers=0)
    ids = [p.produce("t", b"v%d" % i) for i in range(3)]
    assert p.stats()["unsaved_at_close"] is None  # not closed yet
    assert p.close(10) is True  # half of it waits for a delivery that cannot come
    assert p.stats()["unsaved_at_close"] == 0
    assert p.close(10) is True
    with SQLiteOutbox(url.removeprefix("sqlite:///")) as store:
        assert [m.msg_id for m in store.messages()] == ids


def test_close_is_false_and_counts_the_messages_it_could_neither_deliver_nor_store(tmp_path: Path) -> None:
    """No broker, and another connection holds the SQLite outbox's write lock for the whole of
    close(): the purged messages cannot be committed. close() says False, stats() counts them,
    and a second close() gives the same answer."""
    db = tmp_path / "o.db"
    store = SQLiteOutbox(str(db), busy_timeout=0.2)
    try:
        p = ResilientProducer({"message.timeout.ms": 600000}, outbox=store, drain_workers=0)
        for i in range(3):
            p.produce("t", b"v%d" % i)
        locker = sqlite3.connect(db, isolation_level=None)
        try:
            locker.execute("BEGIN IMMEDIATE")  # another writer, for as long as close() runs
            assert p.close(2) is False
            assert p.close(2) is False
        finally:
            locker.close()  # its transaction is rolled back
        assert p.stats()["unsaved_at_close"] == 3
    finally:
        store.close()


def test_transaction_methods_answer_as_for_a_producer_without_transactional_id(producer: ResilientProducer) -> None:
    with pytest.raises(KafkaException) as info:
        producer.begin_transaction()
    assert info.value.args[0].code() == KafkaError._NOT_CONFIGURED


def test_set_sasl_credentials_checks_its_arguments_as_confluent_does(producer: ResilientProducer) -> None:
    producer.set_sasl_credentials("user", "secret")
    with pytest.raises(TypeError):
        producer.set_sasl_credentials(None, "secret")  # type: ignore[arg-type]
