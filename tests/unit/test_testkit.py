"""outbox.testkit and the memory outbox as users' unit tests use them: no broker, no file."""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, KafkaError

from outbox.errors import ConfigError
from outbox.records import DeadLetterFilter, NewMessage
from outbox.stores import MemoryOutbox, open_outbox
from outbox.stores.base import Failure, Settlement
from outbox.stores.memory import forget_memory
from outbox.testkit import Sent, TestMessage, TestProducer


def test_produce_records_the_message_as_kafka_would_get_it() -> None:
    p = TestProducer()
    msg_id = p.produce("orders", "v1", key=b"k", timestamp=1_700_000_000_000, headers={"h": "x"})
    p.produce("audit", b"a")
    [sent] = p.messages("orders")
    assert sent == Sent("orders", b"v1", b"k", -1, 1_700_000_000_000, [("h", b"x"), ("outbox-id", msg_id.encode())])
    assert [m.topic for m in p.sent] == ["orders", "audit"] and p.sent[1].timestamp > 0


def test_callbacks_run_at_poll_in_produce_order_with_offsets_per_topic() -> None:
    p = TestProducer(id_header=None)
    seen: list[tuple[object, str, int, bytes]] = []
    for i in range(3):
        p.produce("t", b"%d" % i, on_delivery=lambda err, m: seen.append((err, m.topic(), m.offset(), m.value())))
    p.produce("u", b"x", callback=lambda err, m: seen.append((err, m.topic(), m.offset(), m.value())))
    assert seen == [] and len(p) == 4
    assert p.poll() == 4 and len(p) == 0
    assert seen == [(None, "t", 0, b"0"), (None, "t", 1, b"1"), (None, "t", 2, b"2"), (None, "u", 0, b"x")]
    assert p.sent[0].headers == []


def test_fail_reports_the_error_to_the_callback() -> None:
    too_large = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    p = TestProducer(fail=lambda m: too_large if len(m.value or b"") > 3 else None)
    errors: list[KafkaError | None] = []
    p.produce("t", b"small", on_delivery=lambda err, m: errors.append(err))
    p.produce("t", b"ok", on_delivery=lambda err, m: errors.append(err))
    assert p.flush() == 0
    assert [e.code() if e else None for e in errors] == [KafkaError.MSG_SIZE_TOO_LARGE, None]


def test_close_runs_the_waiting_callbacks_and_is_true_as_a_clean_close() -> None:
    p = TestProducer()
    seen: list[bytes] = []
    p.produce("t", b"v", on_delivery=lambda err, m: seen.append(m.value()))
    assert p.close() is True
    assert seen == [b"v"] and len(p) == 0


def test_bad_arguments_are_refused_as_by_the_real_producer() -> None:
    p = TestProducer()
    with pytest.raises(TypeError, match="value must be bytes, str or None"):
        p.produce("t", 42)
    with pytest.raises(ConfigError, match="timestamp"):
        p.produce("t", b"v", timestamp=-1)
    with pytest.raises(ConfigError, match="partition"):
        p.produce("t", b"v", partition=-2)
    assert p.sent == []


def test_serializers_apply_before_recording() -> None:
    p = TestProducer(value_serializer=lambda v: repr(v).encode(), key_serializer=lambda k: str(k).encode())
    p.produce("t", {"a": 1}, key=7)
    assert (p.sent[0].value, p.sent[0].key) == (b"{'a': 1}", b"7")


def test_test_message_reads_like_a_confluent_message() -> None:
    m = TestMessage("t", b"v", b"k", headers=[("h", b"1")], partition=2, offset=9, timestamp=5)
    got = (m.topic(), m.value(), m.key(), m.headers(), m.partition(), m.offset())
    assert got == ("t", b"v", b"k", [("h", b"1")], 2, 9)
    assert m.timestamp() == (TIMESTAMP_CREATE_TIME, 5) and m.error() is None and len(m) == 1
    m.set_value({"decoded": True})
    assert m.value() == {"decoded": True}


def test_memory_urls_name_one_store_per_process() -> None:
    a = open_outbox("memory://unit-orders")
    try:
        assert isinstance(a, MemoryOutbox) and open_outbox("memory://unit-orders") is a
        assert open_outbox("memory://") is not open_outbox("memory://")
        [i] = a.enqueue([NewMessage("t", b"v")])
        a.close()  # the messages stay readable after close
        assert open_outbox("memory://unit-orders").get(i).value == b"v"
        assert not a.capabilities.durable and not a.capabilities.shared
    finally:
        forget_memory("unit-orders")
    assert open_outbox("memory://unit-orders").messages() == []
    forget_memory("unit-orders")


def test_memory_outbox_is_safe_to_share_between_threads() -> None:
    store = MemoryOutbox()
    claimed: list[int] = []
    lock = threading.Lock()

    def write() -> None:
        for _ in range(50):
            store.enqueue([NewMessage("t", b"v", key=b"k%d" % (i % 5)) for i in range(10)])

    def drain(owner: str) -> None:
        for _ in range(200):
            got = store.claim(owner, 20, 60, now=1e12)
            with lock:
                claimed.extend(m.id for m in got)
            store.apply(Settlement(delivered=[m.id for m in got]), now=1e12)

    threads = [threading.Thread(target=write) for _ in range(2)] + [
        threading.Thread(target=drain, args=(f"w{i}",)) for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while got := store.claim("last", 1000, 60, now=1e12):
        claimed += [m.id for m in got]
        store.apply(Settlement(delivered=[m.id for m in got]), now=1e12)
    assert sorted(claimed) == list(range(1, 1001)) and len(set(claimed)) == 1000
    assert store.stats(now=1e12).pending == 0


def test_memory_outbox_dead_letters_for_a_users_test() -> None:
    store = MemoryOutbox()
    [i] = store.enqueue([NewMessage("orders", b"v", key=b"k")])
    store.claim("w", 1, 60, now=1e12)
    too_large = Failure(i, "MSG_SIZE_TOO_LARGE (10): big", None, 1e12, 10, "MSG_SIZE_TOO_LARGE")
    store.apply(Settlement(failures=[too_large]), now=1e12)
    [dead] = store.list_dead(DeadLetterFilter(error="MSG_SIZE_TOO_LARGE"))
    assert (dead.id, dead.attempts, dead.last_failed_at) == (i, 1, 1e12)
    assert store.replay_dead(now=1e12, to_topic="orders.retry") == 1
    assert store.pending("orders.retry")[0].id == i


def test_a_producer_over_a_memory_outbox_refuses_transaction_by_its_capabilities() -> None:
    from outbox import ResilientProducer

    store = MemoryOutbox()
    producer = ResilientProducer({"bootstrap.servers": "127.0.0.1:1"}, outbox=store, drain_workers=0)
    try:
        with pytest.raises(ConfigError, match="transaction= needs an outbox that can enqueue in the application's"):
            producer.produce("t", b"v", transaction=object())
        assert store.messages() == []
    finally:
        producer.close(1)
