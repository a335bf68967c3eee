"""One consumer process of a consumer fault schedule (tests/chaos/consumer_runner.py), killed with
SIGKILL part-way and started again in the same group.

Run as a script: ``python consumer_worker.py <bootstrap> <topic> <group> <sqlite path> <stats path>
<batch size> [<group settings>]``, the group settings a JSON object (`tests.group_protocols`; the
classic protocol's by default). A `ResilientConsumer(ordering="key", dedup=True)` whose handler ``handler(msg, tx)``
records each effect as a row of its own table ``effects`` in the consumer's SQLite store, through
`tx`: in the transaction that marks the message handled (docs/effectively-once.md). A message's
value is ``<key>:<seq>:<fails>``: its handler raises while the message has had fewer than `fails`
attempts, so it goes through that many retry tiers (fewer than there are: none is dead-lettered).
Offsets are committed every 5 s, so a kill leaves handled messages to be read again. Every half
second it rewrites ``<stats path>`` with its `stats()`. Runs until SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import sys
import time

from confluent_kafka import Message

from outbox import ResilientConsumer, RetryTopics
from outbox.consumer.headers import find_text, headers_of
from outbox.consumer.inbox import InboxCommitFailed

#: Retry tiers' delays (seconds); a message fails at most len(DELAYS) - 1 times.
DELAYS = [0.5, 1.0, 2.0]
STATS = ("handled", "failed", "retried", "parked", "skipped", "dead", "duplicates_skipped", "assigned", "revoked")


class Downstream(Exception):
    """The handler's planned failure."""


def attempts_before(msg: Message) -> int:
    """Handling attempts the message had before this one (`outbox-consumer-attempt`, absent on the main topic)."""
    return int(find_text(headers_of(msg), "outbox-consumer-attempt") or 0)


def outbox_id(msg: Message) -> str:
    msg_id = find_text(headers_of(msg), "outbox-id")
    if msg_id is None:
        raise ValueError(f"a message without outbox-id: {msg.value()!r}")
    return msg_id


def main(
    bootstrap: str, topic: str, group: str, path: str, stats_path: str, batch_size: str, settings: str = ""
) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    with sqlite3.connect(path) as c:
        # No unique constraint: an effect applied twice shows as a second row.
        c.execute(
            "CREATE TABLE IF NOT EXISTS effects (n INTEGER PRIMARY KEY, msg_id TEXT NOT NULL, value TEXT NOT NULL, "
            "topic TEXT NOT NULL, pid INTEGER NOT NULL)"
        )

    def handle(msg: Message, tx: sqlite3.Connection) -> None:
        value = (msg.value() or b"").decode()
        if attempts_before(msg) < int(value.rsplit(":", 1)[1]):
            raise Downstream(f"{value} fails this attempt")
        tx.execute(
            "INSERT INTO effects (msg_id, value, topic, pid) VALUES (?, ?, ?, ?)",
            (outbox_id(msg), value, msg.topic(), os.getpid()),
        )

    group_settings = json.loads(settings) if settings else {
        "session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "max.poll.interval.ms": 30000,
    }
    config = {"bootstrap.servers": bootstrap, "group.id": group, **group_settings, "auto.commit.interval.ms": 5000}
    with ResilientConsumer(
        config, topics=[topic], handler=handle, outbox=f"sqlite:///{path}", dedup=True, ordering="key",
        strategy=RetryTopics(delays=DELAYS), batch_size=int(batch_size),
    ) as consumer:
        stopping: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
        reported = 0.0
        while not stopping:
            try:
                consumer.poll_once()
            except InboxCommitFailed as exc:  # the batch is read again (docs/effectively-once.md)
                logging.warning("%s", exc)
            if time.monotonic() - reported >= 0.5:
                reported = time.monotonic()
                write_stats(consumer, stats_path)
        write_stats(consumer, stats_path)


def write_stats(consumer: ResilientConsumer, path: str) -> None:
    stats = consumer.stats()
    with open(path + ".tmp", "w") as f:
        json.dump({k: stats[k] for k in STATS}, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(*sys.argv[1:8])
