"""A secured cluster (SASL_SSL): the producer speaks to it, and credentials that stop working are an outage."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import ResilientProducer, RetryPolicy
from outbox.testing import KafkaCluster
from outbox.testing.cluster import USERS
from outbox.testing.plugin import running_cluster

from ..waiting import wait_until
from .delivery import Arrivals, keyed_value, read_topic


@pytest.fixture(scope="module")
def secured(request: pytest.FixtureRequest) -> Iterator[KafkaCluster]:
    # Connections re-authenticate every 3 s: a changed password takes effect on open connections too.
    cluster = KafkaCluster(brokers=1, security="SASL_SSL", broker_config={"connections.max.reauth.ms": 3000})
    yield from running_cluster(request, cluster)


def _read(cluster: KafkaCluster, topic: str, expect: int) -> Arrivals:
    config = cluster.client_config(user="admin")
    return read_topic(config.pop("bootstrap.servers"), topic, expect, config=config)


@pytest.mark.parametrize("drain_in", ["threads", "process"])
def test_a_password_that_stops_working_is_an_outage_and_a_rotation_delivers_everything_in_order(
    secured: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture, drain_in: str
) -> None:
    """The rotation reaches every client of the producer: its own, and its drain's (a drain process's too)."""
    topic = secured.create_topic(f"secured-{time.time_ns()}", partitions=3)
    config = {**secured.client_config(user="alice"), "message.timeout.ms": 5000}
    producer = ResilientProducer(
        config, outbox=f"sqlite:///{tmp_path / 'o.db'}", retry=RetryPolicy(max_attempts=3, initial_delay=0.2),
        drain_in=drain_in,
    )
    ids = []
    try:
        for seq in range(300):
            ids.append(producer.produce(topic, keyed_value(seq % 10, seq)[1], key=keyed_value(seq % 10, seq)[0]))
        assert producer.flush(30) == 0
        secured.set_password("alice", "rotated-secret")  # the operator rotated it; the producer has the old one
        with caplog.at_level(logging.WARNING, logger="outbox"):
            deadline = time.monotonic() + 20
            seq = 300
            while time.monotonic() < deadline:  # producing on through the refusal
                ids.append(producer.produce(topic, keyed_value(seq % 10, seq)[1], key=keyed_value(seq % 10, seq)[0]))
                seq += 1
                time.sleep(0.01)
        refused = producer.stats()
        assert refused["dead"] == 0 and refused["retried"] == 0, refused  # no attempt counted
        assert refused["pending"] > 0 and refused["circuit"] != "closed", refused
        opened = [r.getMessage() for r in caplog.records if r.getMessage().startswith("circuit open")]
        assert opened and "every broker refused the connection" in opened[0], opened
        assert all(USERS["alice"] not in r.getMessage() for r in caplog.records)  # never the secret
        producer.set_sasl_credentials("alice", "rotated-secret")
        wait_until(lambda: producer.stats()["pending"] == 0, 90, "the outbox delivered after the rotation")
        assert producer.stats()["dead"] == 0
    finally:
        producer.close(10)
        secured.set_password("alice", USERS["alice"])
    got = _read(secured, topic, len(ids))
    assert got.unique == len(ids) and set(got.by_id) == set(ids)
    assert got.order_violations() == []
