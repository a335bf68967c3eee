"""`ResilientProducer.stats()` of a producer whose broker never answers: no Kafka needed."""

from __future__ import annotations

from pathlib import Path

from outbox import ResilientProducer, SQLiteOutbox

from ..waiting import wait_until


def test_the_delivery_counts_stay_zero_after_close_while_librdkafka_keeps_logging(tmp_path: Path) -> None:
    """After close() nothing serves librdkafka's queue, where it keeps putting a log line per failed
    connection: those are not messages, and no count may read them as messages still held."""
    path = str(tmp_path / "o.db")
    p = ResilientProducer({"bootstrap.servers": "127.0.0.1:1"}, outbox=path, drain_workers=0)
    ids = [p.produce("orders", b"v%d" % i, key=b"k%d" % (i % 3)) for i in range(10)]
    before = p.stats()
    assert (before["delivered"], before["delivered_first_try"]) == (0, 0)
    assert p.close(30.0) is True
    # The case under test: librdkafka queued an event that no poll serves any more.
    wait_until(lambda: len(p._link.kafka) > 0, 30, "librdkafka to queue a log line after close()")

    after = p.stats()

    assert (after["delivered"], after["delivered_first_try"], after["in_memory"]) == (0, 0, 0)
    assert after["produced"] == after["outboxed"] == 10
    store = SQLiteOutbox(path)
    try:
        assert [m.msg_id for m in store.messages()] == ids  # every message kept, none delivered
    finally:
        store.close()
