"""Tier topics: their names, and creating them at start-up with the source topic's partition count.

Names depend on the source topic, the group and the tier number only, never on a delay, so that
changing a delay renames nothing (Spring's delay-suffixed names do: spring-kafka #2496).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from outbox.errors import ConfigError, KafkaUnavailableError
from outbox.logs import with_librdkafka_log
from outbox.message import MAX_TOPIC_LENGTH, topic_chars_ok

log = logging.getLogger(__name__)


#: Settings only a consumer understands; the admin client and the hop producer do not get them.
CONSUMER_ONLY_PREFIXES = (
    "group.",
    "auto.offset.reset",
    "enable.auto.",
    "auto.commit.",
    "max.poll.",
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "partition.assignment.strategy",
    "enable.partition.eof",
    "isolation.level",
    "fetch.",
    "queued.",
    "check.crcs",
    "allow.auto.create.topics",
    "consume.callback.max.messages",
    "on_commit",
    "offset.store.method",
    "coordinator.query.interval.ms",
    "client.rack",
)


def client_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The consumer's settings without the consumer-only ones: for the admin client and the producer."""
    return {k: v for k, v in config.items() if not k.startswith(CONSUMER_ONLY_PREFIXES)}


def retry_tier_name(topic: str, group: str, n: int) -> str:
    """``<topic>.<group>.retry-<n>`` (n from 1)."""
    return f"{topic}.{group}.retry-{n}"


def dlq_name(topic: str, group: str) -> str:
    """``<topic>.<group>.dlq``."""
    return f"{topic}.{group}.dlq"


@dataclass(frozen=True, slots=True)
class Place:
    """Where a topic the consumer reads sits in a ladder: its main topic and its tier (0 = main)."""

    main: str
    tier: int


@dataclass(frozen=True)
class Ladder:
    """Every topic of the consumer's ladders, by name."""

    group: str
    mains: tuple[str, ...]
    tiers: int
    with_dlq: bool

    def __post_init__(self) -> None:
        if not topic_chars_ok(self.group):
            raise ConfigError(
                f"group.id {self.group!r} cannot be part of a topic name (allowed: letters, digits, '.', '_', '-'); "
                "tier topics are named <topic>.<group>.retry-N"
            )
        for main in self.mains:
            longest = dlq_name(main, self.group) if self.tiers == 0 else retry_tier_name(main, self.group, self.tiers)
            if len(longest) > MAX_TOPIC_LENGTH:
                raise ConfigError(f"tier topic name {longest!r} is longer than Kafka's {MAX_TOPIC_LENGTH} characters")

    def retry_topic(self, main: str, n: int) -> str:
        return retry_tier_name(main, self.group, n)

    def dlq_topic(self, main: str) -> str:
        return dlq_name(main, self.group)

    def places(self) -> dict[str, Place]:
        """Every topic the consumer subscribes to (mains and retry tiers), with its place."""
        out = {m: Place(m, 0) for m in self.mains}
        for m in self.mains:
            for n in range(1, self.tiers + 1):
                out[self.retry_topic(m, n)] = Place(m, n)
        return out

    def tier_topics(self, main: str) -> list[str]:
        """The topics this ladder needs next to `main`: retry tiers, then the DLQ if it is used."""
        names = [self.retry_topic(main, n) for n in range(1, self.tiers + 1)]
        if self.with_dlq:
            names.append(self.dlq_topic(main))
        return names


def ensure_tiers(
    admin_config: Mapping[str, Any],
    ladder: Ladder,
    *,
    create: bool,
    timeout: float = 30.0,
    same_partitions: bool = False,
) -> dict[str, int]:
    """Check (and create, if allowed) every tier topic; return each main topic's partition count.

    Tiers get the main topic's partition count, so partition p of every tier lands on the consumer
    that owns partition p of the main topic under the default range assignor, and its replication
    factor. Existing tiers with another partition count are used as they are, with a warning.

    `same_partitions` (ordering="key"): a tier with another partition count is a ConfigError,
    since a message and the later ones of its key would not share a tier partition.

    Raises:
        ConfigError: a main topic is missing, or tiers are missing and `create` is False.
        KafkaUnavailableError: the cluster did not answer within `timeout`.
    """
    admin = AdminClient(with_librdkafka_log(admin_config))
    deadline = time.monotonic() + timeout
    try:
        md = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise KafkaUnavailableError(f"could not read the cluster's topics: {exc.args[0]}") from None
    counts: dict[str, int] = {}
    wanted: list[NewTopic] = []
    missing: list[str] = []
    for main in ladder.mains:
        tmd = md.topics.get(main)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            raise ConfigError(f"topic {main!r} does not exist: create it before starting the consumer")
        counts[main] = len(tmd.partitions)
        rf = len(tmd.partitions[min(tmd.partitions)].replicas) or 1
        for name in ladder.tier_topics(main):
            have = md.topics.get(name)
            if have is not None and have.error is None and have.partitions:
                if len(have.partitions) != counts[main] and same_partitions:
                    raise ConfigError(
                        f"tier {name} has {len(have.partitions)} partitions, {main} has {counts[main]}: "
                        "ordering='key' needs the same count (recreate the tier topic)"
                    )
                if len(have.partitions) != counts[main]:
                    log.warning(
                        "tier %s has %d partitions, %s has %d: retried messages change partition",
                        name, len(have.partitions), main, counts[main],
                    )
                continue
            missing.append(name)
            wanted.append(NewTopic(name, num_partitions=counts[main], replication_factor=rf))
    if missing and not create:
        raise ConfigError(
            f"tier topics missing: {', '.join(missing)}; create them with the partition count of their "
            "main topic, or pass create_topics=True"
        )
    if wanted:
        futures = admin.create_topics(wanted, request_timeout=timeout)
        for name, fut in futures.items():
            try:
                fut.result(timeout=max(1.0, deadline - time.monotonic()))
                log.info("created tier topic %s", name)
            except KafkaException as exc:
                err: KafkaError = exc.args[0]
                if err.code() != KafkaError.TOPIC_ALREADY_EXISTS:  # another instance won the race
                    raise ConfigError(f"could not create tier topic {name!r}: {err.str()}") from None
        _wait_for_leaders(admin, missing, deadline)
    return counts


def _wait_for_leaders(admin: AdminClient, names: Sequence[str], deadline: float) -> None:
    """Wait until every new topic has a leader for each partition, so the group can assign it at once."""
    waiting = set(names)
    while waiting:
        md = admin.list_topics(timeout=5.0)
        for name in list(waiting):
            tmd = md.topics.get(name)
            if tmd is not None and tmd.error is None and tmd.partitions and all(
                p.leader >= 0 for p in tmd.partitions.values()
            ):
                waiting.discard(name)
        if waiting:
            if time.monotonic() > deadline:
                raise KafkaUnavailableError(f"tier topics created but without leaders: {', '.join(sorted(waiting))}")
            time.sleep(0.1)
