"""Redrive a DLQ *topic*: publish its messages again into their group's first retry tier.

Not into the main topic: other groups read it too, and would get the message twice (the Uber
seed's "merge"). What has been redriven is remembered by a consumer group of its own
(``outbox-redrive.<dlq topic>``), whose offsets are committed only after Kafka acknowledged every
republished message: an interrupted redrive is run again and may repeat, never skip, a message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from outbox.consumer.headers import DUE_AT, consumer_failure, headers_of, record_timestamp
from outbox.consumer.tiers import client_config, retry_tier_name
from outbox.errors import ConfigError, KafkaDeliveryError, KafkaUnavailableError
from outbox.logs import with_librdkafka_log

log = logging.getLogger(__name__)


@dataclass
class RedriveResult:
    """What a redrive did: how many messages went where."""

    dlq_topic: str
    replayed: int = 0
    by_topic: dict[str, int] = field(default_factory=dict)


def redrive_topic(
    config: Mapping[str, Any],
    dlq_topic: str,
    *,
    to_topic: str | None = None,
    redrive_group: str | None = None,
    limit: int | None = None,
    timeout: float = 30.0,
) -> RedriveResult:
    """Republish the DLQ topic's messages not redriven yet, oldest first per partition.

    Args:
        config: client settings (`bootstrap.servers`, security); consumer-only keys are ignored.
        dlq_topic: e.g. ``orders.billing.dlq``.
        to_topic: send everything here instead of each message's ``<topic>.<group>.retry-1``.
        redrive_group: the consumer group remembering progress (default ``outbox-redrive.<dlq_topic>``).
        limit: at most this many messages.
        timeout: seconds for the cluster to answer each step.

    Raises:
        ConfigError: the topic does not exist, or a message has no consumer headers and no `to_topic`.
        KafkaUnavailableError: the cluster did not answer.
        KafkaDeliveryError: a republish failed; no progress was committed.
    """
    base = with_librdkafka_log(client_config(config))  # the reader and the republishing producer
    consumer = Consumer(
        {
            **base,
            "group.id": redrive_group or f"outbox-redrive.{dlq_topic}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": True,
        }
    )
    try:
        try:
            md = consumer.list_topics(dlq_topic, timeout=timeout)
        except KafkaException as exc:
            # The KafkaError's own sentence: its str() is a repr, KafkaError{code=...,str="..."}.
            err = exc.args[0]
            why = f"{err.name()}: {err.str()}" if isinstance(err, KafkaError) else str(err)
            raise KafkaUnavailableError(
                f"no Kafka broker answered at {base.get('bootstrap.servers', '?')} within {timeout:g}s ({why})"
            ) from None
        tmd = md.topics.get(dlq_topic)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            raise ConfigError(f"topic {dlq_topic!r} does not exist")
        parts = [TopicPartition(dlq_topic, p) for p in sorted(tmd.partitions)]
        start = {tp.partition: tp.offset for tp in _committed(consumer, parts, timeout)}
        ends = {p.partition: consumer.get_watermark_offsets(p, timeout=timeout)[1] for p in parts}
        todo = []
        for p in parts:
            s = start.get(p.partition, OFFSET_INVALID)
            if s == OFFSET_INVALID or s < ends[p.partition]:
                todo.append(TopicPartition(dlq_topic, p.partition, OFFSET_BEGINNING if s == OFFSET_INVALID else s))
        msgs = _read(consumer, todo, ends, limit, timeout)
        result = RedriveResult(dlq_topic)
        if not msgs:
            return result
        plan = [(_target(m, to_topic), m) for m in msgs]
        _publish(base, plan, timeout)
        last: dict[int, int] = {}
        for target, m in plan:
            last[m.partition()] = m.offset()  # type: ignore[index,assignment]
            result.by_topic[target] = result.by_topic.get(target, 0) + 1
        consumer.commit(offsets=[TopicPartition(dlq_topic, p, o + 1) for p, o in last.items()], asynchronous=False)
        result.replayed = len(plan)
        return result
    finally:
        consumer.close()


def _read(
    consumer: Consumer, todo: list[TopicPartition], ends: dict[int, int], limit: int | None, timeout: float
) -> list[Message]:
    if not todo:
        return []
    consumer.assign(todo)
    open_parts = {tp.partition for tp in todo}
    out: list[Message] = []
    idle = 0.0
    while open_parts and (limit is None or len(out) < limit):
        batch = consumer.consume(500, 0.5)
        if not batch:
            idle += 0.5
            if idle >= timeout:
                raise KafkaUnavailableError(f"no message read from {todo[0].topic} for {timeout:.0f}s")
            continue
        idle = 0.0
        for m in batch:
            err = m.error()
            part: int = m.partition()  # type: ignore[assignment]
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    open_parts.discard(part)
                    continue
                raise KafkaDeliveryError(err.code(), err.name(), err.str())
            if part not in open_parts:
                continue
            out.append(m)
            if m.offset() + 1 >= ends[part]:  # type: ignore[operator]
                open_parts.discard(part)
            if limit is not None and len(out) >= limit:
                break
    return out


def _target(m: Message, to_topic: str | None) -> str:
    if to_topic is not None:
        return to_topic
    failure = consumer_failure(headers_of(m))
    if failure is None:
        raise ConfigError(
            f"{m.topic()} [{m.partition()}] @{m.offset()} has no outbox-group / outbox-original-topic headers: "
            "give the topic to send it to"
        )
    return retry_tier_name(failure.origin.topic, failure.group, 1)


def _publish(config: Mapping[str, Any], plan: list[tuple[str, Message]], timeout: float) -> None:
    producer = Producer({**config, "acks": "all", "enable.idempotence": True,
                         "message.timeout.ms": int(timeout * 1000)})
    failures: list[KafkaError] = []

    def report(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failures.append(err)

    for target, m in plan:
        headers = [(h, v) for h, v in headers_of(m) if h != DUE_AT]  # due at once
        producer.produce(
            target, m.value(), m.key(), headers=headers, on_delivery=report,  # type: ignore[arg-type]
            timestamp=record_timestamp(m),  # the original's: a redriven record keeps its event time
        )
        producer.poll(0)
    left = producer.flush(timeout + 5)
    if failures or left:
        err = failures[0] if failures else None
        raise KafkaDeliveryError(
            err.code() if err else KafkaError._MSG_TIMED_OUT,
            err.name() if err else "_MSG_TIMED_OUT",
            f"{len(failures) + left} of {len(plan)} messages not republished ({err.str() if err else 'timed out'}); "
            "nothing was marked as redriven, run it again",
        )
    log.info("republished %d messages", len(plan))


#: A group coordinator that is moving or loading answers with these for a moment: asked again.
_COORDINATOR_BUSY = frozenset({
    KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE,
})


def _committed(consumer: Consumer, parts: list[TopicPartition], timeout: float) -> list[TopicPartition]:
    """The group's committed offsets, asked again while its coordinator is busy (a group used for
    the first time, a broker restarted) within `timeout`: a retriable answer is not an error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return list(consumer.committed(parts, timeout=max(1.0, deadline - time.monotonic())))
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError) or err.code() not in _COORDINATOR_BUSY or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
