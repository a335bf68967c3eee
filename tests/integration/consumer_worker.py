"""One ResilientConsumer process for the kill -9 and rebalance tests (tests/integration/test_consumer.py).

Run as a script: ``python consumer_worker.py <bootstrap> <topic> <group> <outbox path> <log path> <delays>
[<group settings> [in-place:<max attempts>:<delay>]]``, the group settings a JSON object
(`tests.group_protocols.group_settings`; the classic protocol's range assignor by default).
Messages whose value starts with ``fail`` fail on the main topic and every tier but the last,
and succeed on the last tier; every other message succeeds at once. Each successful handling appends
``<value> <topic> <epoch s>`` to the log file (one write per line, so a kill -9 loses no line the
handler finished). With ``in-place:N:D`` the strategy is RetryInPlace(RetryPolicy(max_attempts=N,
initial_delay=D)), ``fail`` messages always fail, and each failed attempt first appends
``<value> try <epoch s>``. Runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from confluent_kafka import Message

from outbox import ResilientConsumer, RetryInPlace, RetryPolicy, RetryTopics
from outbox.consumer import Strategy


def main(
    bootstrap: str, topic: str, group: str, outbox_path: str, log_path: str, delays: str, settings: str = "",
    mode: str = "",
) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    out = open(log_path, "a", buffering=1)  # noqa: SIM115 - kept open for the process's life
    last_tier = f".retry-{len(delays.split(','))}"

    strategy: Strategy = RetryTopics(delays=[float(d) for d in delays.split(",")])
    if mode.startswith("in-place:"):
        _, n, d = mode.split(":")
        strategy = RetryInPlace(RetryPolicy(max_attempts=int(n), initial_delay=float(d)))
        last_tier = "never"

    def handle(msg: Message) -> None:
        value = (msg.value() or b"").decode()
        t = msg.topic() or ""
        if value.startswith("fail") and last_tier == "never":
            out.write(f"{value} try {time.time():.3f}\n")
            raise TimeoutError(f"downstream timed out for {value}")
        if value.startswith("fail") and not t.endswith(last_tier):
            raise TimeoutError(f"downstream timed out for {value}")
        out.write(f"{value} {t} {time.time():.3f}\n")

    group_settings = json.loads(settings) if settings else {
        "session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "max.poll.interval.ms": 10000,
        "partition.assignment.strategy": "range",
    }
    config = {"bootstrap.servers": bootstrap, "group.id": group, **group_settings}
    with ResilientConsumer(
        config,
        topics=[topic],
        handler=handle,
        strategy=strategy,
        outbox=f"sqlite:///{outbox_path}",
        producer_config={"message.timeout.ms": 5000},
    ) as consumer:
        print("ready", flush=True)
        consumer.run()


if __name__ == "__main__":
    main(*sys.argv[1:9])
