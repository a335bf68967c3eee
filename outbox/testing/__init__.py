"""Test bed for kafka-outbox: a real local Kafka cluster, pytest fixtures and helpers.

Installed with the `testing` extra (``pip install 'kafka-outbox[testing]'``: pytest for the
plugin, `outbox.testing.plugin`). For unit tests without a broker, see `outbox.testkit`.
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

__all__ = [
    "KAFKA_VERSION",
    "KafkaCluster",
    "KafkaSetupError",
    "create_topic",
    "fetch_kafka",
    "kafka_libs_dir",
    "wait_for_isr",
]
