"""The group's rebalance protocol, and changes to a consumer's assignment in the calls it allows.

librdkafka refuses `assign()` under an incremental (COOPERATIVE) protocol and
`incremental_assign()` under an eager one, so every change of the assignment goes through
`Assignments`, which knows which of the two the group uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, TopicPartition

#: librdkafka's built-in classic assignors that hand partitions over incrementally.
_COOPERATIVE_ASSIGNORS = frozenset({"cooperative-sticky"})


def is_consumer_protocol(conf: Mapping[str, Any]) -> bool:
    """`group.protocol=consumer` (KIP-848): the broker assigns, and every rebalance is incremental."""
    return str(conf.get("group.protocol", "classic")).strip().lower() == "consumer"


def is_cooperative(conf: Mapping[str, Any]) -> bool:
    """Whether the group's rebalances are incremental (librdkafka's COOPERATIVE protocol) for a
    consumer made with `conf`, the settings handed to librdkafka, rather than eager.

    librdkafka decides this (rd_kafka_rebalance_protocol()) from the same settings, and
    confluent-kafka does not expose its answer, so it is derived here by librdkafka's rule:
    group.protocol=consumer is always incremental; the classic protocol is as its assignors are,
    and librdkafka refuses a list that mixes eager and cooperative ones.
    """
    if is_consumer_protocol(conf):
        return True
    assignors = str(conf.get("partition.assignment.strategy", "range,roundrobin")).split(",")
    return any(a.strip().lower() in _COOPERATIVE_ASSIGNORS for a in assignors)


@dataclass(frozen=True, slots=True)
class Assignments:
    """Adds partitions to, and removes them from, `consumer`'s assignment.

    Eager: a rebalance revokes the whole assignment and assigns the whole new one, so `add` is
    given every partition the member owns and `remove` drops them all. Incremental: only the
    partitions that come and go.
    """

    consumer: Consumer
    cooperative: bool

    def add(self, partitions: list[TopicPartition]) -> None:
        if self.cooperative:
            self.consumer.incremental_assign(partitions)
        else:
            self.consumer.assign(partitions)

    def remove(self, partitions: list[TopicPartition]) -> None:
        if self.cooperative:
            self.consumer.incremental_unassign(partitions)
        else:
            self.consumer.unassign()
