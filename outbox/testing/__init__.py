"""Test bed for kafka-outbox: a real local Kafka cluster, pytest fixtures and helpers.

Installed with the `testing` extra (``pip install 'kafka-outbox[testing]'``: pytest for the
plugin, `outbox.testing.plugin`). For unit tests without a broker, see `outbox.testkit`.

Faults for the real cluster: `KafkaCluster.freeze_broker` (SIGSTOP), network faults between
clients and brokers with `KafkaCluster(proxied=True)` and its `network` (a `FaultProxy`), and a
full disk under a SQLite outbox with `small_disk` / `resize_disk`; schedules of them, played in
the background, with `Fault` and `play`. `History` checks what a topic holds against what was
produced: lost messages, reordered keys, duplicates.
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
from outbox.testing.history import History, Verdict
from outbox.testing.netfaults import FaultProxy, LinkFaults
from outbox.testing.schedule import Fault, FaultPlayer, play

__all__ = [
    "KAFKA_VERSION",
    "Fault",
    "FaultPlayer",
    "FaultProxy",
    "History",
    "KafkaCluster",
    "KafkaSetupError",
    "LinkFaults",
    "Verdict",
    "create_topic",
    "fetch_kafka",
    "kafka_libs_dir",
    "play",
    "resize_disk",
    "small_disk",
    "wait_for_isr",
]
