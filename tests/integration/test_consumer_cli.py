"""`outbox dlq replay-topic` and `outbox dlq replay` of consumer dead letters, against the real cluster."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result
from confluent_kafka import Message, Producer
from outbox_cli.main import cli

from outbox import ResilientConsumer, RetryTopics
from outbox.consumer import headers as H
from outbox.testing.cluster import create_topic

from ..group_protocols import group_settings


def run(*args: str) -> Result:
    return CliRunner().invoke(
        cli, list(args), env={"OUTBOX_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""}, catch_exceptions=False
    )


def test_replay_topic_republishes_into_the_groups_first_tier_once(
    kafka_bootstrap: str, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]], group_protocol: str
) -> None:
    main = make_topic(partitions=2)
    # The group's own settings, as a user copies them from the consumer's config: the CLI's
    # clients take what they need of them on either protocol.
    x = [arg for k, v in group_settings(group_protocol).items() for arg in ("-X", f"{k}={v}")]
    group = f"g{uuid.uuid4().hex[:6]}"
    dlq = create_topic(kafka_bootstrap, f"{main}.{group}.dlq", 2, None, None)
    tier = create_topic(kafka_bootstrap, f"{main}.{group}.retry-1", 2, None, None)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(10):
        p.produce(dlq, b"v%d" % i, key=b"k%d" % i, headers=[
            ("app", b"a"), (H.ORIGINAL_TOPIC, main.encode()), (H.GROUP, group.encode()),
            (H.ORIGINAL_OFFSET, str(i).encode()), (H.DUE_AT, b"1"), (H.ATTEMPT, b"3"),
        ])
    assert p.flush(10) == 0

    r = run("dlq", "replay-topic", dlq, "-b", kafka_bootstrap, *x, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"dlq_topic": dlq, "replayed": 10, "by_topic": {tier: 10}}
    got = consume_all(tier, 10)
    assert sorted(m.value() for m in got) == sorted(b"v%d" % i for i in range(10))
    for m in got:
        names = [h for h, _ in m.headers()]
        assert H.DUE_AT not in names  # due at once
        assert names == ["app", H.ORIGINAL_TOPIC, H.GROUP, H.ORIGINAL_OFFSET, H.ATTEMPT]
    # Progress is remembered: a second run replays only what came later.
    r = run("dlq", "replay-topic", dlq, "-b", kafka_bootstrap, *x)
    assert r.output.strip() == f"Nothing to replay in {dlq}."
    p.produce(dlq, b"late", headers=[(H.ORIGINAL_TOPIC, main.encode()), (H.GROUP, group.encode())])
    p.produce(dlq, b"foreign")  # no consumer headers
    assert p.flush(10) == 0
    r = run("dlq", "replay-topic", dlq, "-b", kafka_bootstrap, *x)
    assert r.exit_code == 2
    assert "has no outbox-group / outbox-original-topic headers: give the topic to send it to" in r.stderr
    r = run("dlq", "replay-topic", dlq, "-b", kafka_bootstrap, *x, "--to-topic", tier)
    assert r.output.strip() == f"Replayed 2 message(s) from {dlq}: 2 to {tier}."
    values = sorted(m.value() for m in consume_all(tier, 12))
    assert values == sorted([b"late", b"foreign"] + [b"v%d" % i for i in range(10)])
    r = run("dlq", "replay-topic", "no-such-dlq-" + uuid.uuid4().hex[:6], "-b", kafka_bootstrap, *x)
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_store_dead_letter_replay_reenters_the_ladder_at_the_first_tier(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    """A consumer dead letter in the store, replayed with the CLI and drained, is handled from retry-1."""
    topic = make_topic(partitions=1)
    group = f"g{uuid.uuid4().hex[:6]}"
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, b"order-1", key=b"k")
    assert p.flush(10) == 0
    healthy = False
    handled: list[tuple[str, bytes]] = []

    def handle(msg: Message) -> None:
        if not healthy:
            raise TimeoutError("downstream down")
        handled.append((msg.topic() or "", msg.value() or b""))

    url = f"sqlite:///{tmp_path / 'c.db'}"
    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[0.1]),
        dead_letters="store",
        outbox=url,
    )
    try:
        deadline = time.monotonic() + 60
        while consumer.stats()["dead"] < 1:
            assert time.monotonic() < deadline, "no dead letter"
            consumer.poll_once()
        r = run("dlq", "replay", "--outbox", url, "--group", group)
        assert r.output.startswith("Replayed 1 dead letter(s)"), r.output
        healthy = True  # the downstream is back; the consumer's own drain workers send the row
        deadline = time.monotonic() + 60
        while not handled:
            assert time.monotonic() < deadline, "the replayed dead letter was not handled"
            consumer.poll_once()
    finally:
        consumer.close()
    assert handled == [(f"{topic}.{group}.retry-1", b"order-1")]
