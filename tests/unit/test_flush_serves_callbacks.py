"""flush() returns once every callback librdkafka had queued has run, as confluent_kafka's does.

librdkafka takes a batch of events off its queue before it calls the first one, so `len()` is 0
while their callbacks are still to run on the delivery thread. A real librdkafka producer, no
broker: its first log line is queued at construction.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from outbox import ResilientProducer


class SlowHandler(logging.Handler):
    """Writes a record only after a pause, and says when the delivery thread is inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.written: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.threadName == "outbox-delivery":
            self.entered.set()
            time.sleep(0.3)  # the callback is still running when the application calls flush()
        self.written.append(f"{record.threadName} {record.getMessage()}")


def test_flush_returns_after_the_log_lines_librdkafka_had_queued_are_written(tmp_path: Path) -> None:
    handler = SlowHandler()
    logger = logging.getLogger("test-flush-serves-callbacks")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.addHandler(handler)
    producer = ResilientProducer(
        {"bootstrap.servers": "nonexistent-host.invalid:9092", "logger": logger, "debug": "msg"},
        outbox=f"sqlite:///{tmp_path}/outbox.db",
    )
    try:
        assert handler.entered.wait(10), "the delivery thread never served the producer's first log line"
        assert producer.flush() == 0
        served = [line for line in handler.written if line.startswith("outbox-delivery ")]
        assert any("INIT" in line for line in served), handler.written
    finally:
        producer.close(1)
        logger.removeHandler(handler)
