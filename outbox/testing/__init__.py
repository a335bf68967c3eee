"""Test bed for kafka-outbox: a real local Kafka cluster, pytest fixtures and helpers.

Installed with the `testing` extra (``pip install 'kafka-outbox[testing]'``: pytest for the
plugin, `outbox.testing.plugin`). For unit tests without a broker, see `outbox.testkit`.

Faults for the real cluster: `KafkaCluster.freeze_broker` (SIGSTOP), network faults between
clients and brokers with `KafkaCluster(proxied=True)` and its `network` (a `FaultProxy`), and a
full disk under a SQLite outbox with `small_disk` / `resize_disk`.
"""

from outbox.testing.cluster import (
    KAFKA_VERSION,
    KafkaCluster,
    KafkaSetupError,
    create_topic,
    fetch_kafka,
    kafka_libs_dir,
    wait_for_isr,
)
from outbox.testing.diskfaults import resize_disk, small_disk
from outbox.testing.netfaults import FaultProxy, LinkFaults

__all__ = [
    "KAFKA_VERSION",
    "FaultProxy",
    "KafkaCluster",
    "KafkaSetupError",
    "LinkFaults",
    "create_topic",
    "fetch_kafka",
    "kafka_libs_dir",
    "resize_disk",
    "small_disk",
    "wait_for_isr",
]
