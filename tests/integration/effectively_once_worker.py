"""One consumer process for tests/integration/test_effectively_once.py (killed with SIGKILL mid-stream).

Run as a script: ``python effectively_once_worker.py <bootstrap> <topic> <group> <sqlite path> <skips path>``.
ResilientConsumer(dedup=True) with a transactional handler that inserts one row per message into
its own table ``effects`` of the consumer's SQLite store. Offsets are committed every 5 s, so a
kill leaves seconds of handled messages to be read again. Every half second it rewrites
``<skips path>`` with its count of skipped copies. Runs until SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import sys
import time

from confluent_kafka import Message

from outbox import ResilientConsumer, RetryTopics


def main(bootstrap: str, topic: str, group: str, path: str, skips: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE IF NOT EXISTS effects (v TEXT NOT NULL)")  # no key: a second insert would show

    def handle(msg: Message, tx: sqlite3.Connection) -> None:
        tx.execute("INSERT INTO effects VALUES (?)", ((msg.value() or b"").decode(),))

    config = {
        "bootstrap.servers": bootstrap, "group.id": group, "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500, "max.poll.interval.ms": 30000, "auto.commit.interval.ms": 5000,
    }
    with ResilientConsumer(
        config, topics=[topic], handler=handle, outbox=f"sqlite:///{path}", dedup=True,
        strategy=RetryTopics(delays=[1]), batch_size=50,
    ) as consumer:
        stopping: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
        reported = 0.0
        while not stopping:
            consumer.poll_once()
            if time.monotonic() - reported >= 0.5:
                reported = time.monotonic()
                with open(skips + ".tmp", "w") as f:
                    f.write(str(consumer.stats()["duplicates_skipped"]))
                os.replace(skips + ".tmp", skips)


if __name__ == "__main__":
    main(*sys.argv[1:])
