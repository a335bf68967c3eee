"""How far behind each consumer group is in its retry tiers (the overview, with `-b`).

A `ResilientConsumer` group G of topic T keeps its waiting messages in `T.G.retry-N` (see
`outbox.consumer.tiers`). The tiers are found from the cluster itself: every consumer group
the cluster knows, and every topic named `<topic>.<that group>.retry-<n>` whose main topic
exists. The lag of a tier is, summed over its partitions, the high watermark minus the group's
committed offset (minus the low watermark where the group has not committed yet): what is
waiting there, due or not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from outbox.consumer.tiers import client_config
from outbox.errors import KafkaUnavailableError
from outbox.logs import with_librdkafka_log


@dataclass(frozen=True, slots=True)
class TierLag:
    group: str
    topic: str  # the main topic
    tier: str  # the tier's topic, e.g. orders.billing.retry-1
    number: int
    lag: int


def tier_lags(config: Mapping[str, Any], *, timeout: float = 10.0) -> list[TierLag]:
    """The lag of every retry tier of every consumer group the cluster knows, by group and tier.

    Raises:
        KafkaUnavailableError: the cluster did not answer within `timeout`.
    """
    admin = AdminClient(with_librdkafka_log(client_config(config)))
    try:
        md = admin.list_topics(timeout=timeout).topics
        topics = set(md)
        groups = [g.group_id for g in admin.list_consumer_groups(request_timeout=timeout).result(timeout).valid]
        out: list[TierLag] = []
        for group in sorted(groups):
            tiers = []
            pattern = re.compile(r"^(.+)\." + re.escape(group) + r"\.retry-(\d+)$")
            for name in sorted(topics):
                m = pattern.match(name)
                if m and m.group(1) in topics:
                    tiers.append((name, m.group(1), int(m.group(2))))
            if not tiers:
                continue
            parts = [TopicPartition(t, p) for t, _, _ in tiers for p in sorted(md[t].partitions)]
            committed = {
                (tp.topic, tp.partition): tp.offset
                for tp in admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group, parts)],
                                                            request_timeout=timeout)[group]
                .result(timeout).topic_partitions
            }
            high = _offsets(admin, parts, OffsetSpec.latest(), timeout)  # type: ignore[no-untyped-call]
            low = _offsets(admin, parts, OffsetSpec.earliest(), timeout)  # type: ignore[no-untyped-call]
            for tier, main, n in tiers:
                lag = 0
                for tp in parts:
                    if tp.topic != tier:
                        continue
                    key = (tp.topic, tp.partition)
                    start = committed.get(key, -1)
                    lag += max(0, high[key] - (start if start >= 0 else low[key]))
                out.append(TierLag(group, main, tier, n, lag))
        return out
    except KafkaException as exc:
        raise KafkaUnavailableError(f"could not read the retry tiers' offsets: {exc.args[0]}") from None


def _offsets(admin: AdminClient, parts: list[TopicPartition], spec: Any, timeout: float) -> dict[tuple[str, int], int]:
    futures = admin.list_offsets({tp: spec for tp in parts}, request_timeout=timeout)
    return {(tp.topic, tp.partition): f.result(timeout).offset for tp, f in futures.items()}
