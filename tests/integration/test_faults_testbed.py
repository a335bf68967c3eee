"""The test bed's fault injection against a real cluster: frozen brokers, network faults, a full disk.

One proxied 3-broker cluster serves the whole module; every test heals what it broke.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from outbox.errors import StoreError
from outbox.records import NewMessage
from outbox.stores import open_outbox
from outbox.testing import KafkaCluster, resize_disk, small_disk
from outbox.testing.consume import consume
from outbox.testing.plugin import running_cluster


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[KafkaCluster]:
    yield from running_cluster(request, KafkaCluster(brokers=3, proxied=True))


@pytest.fixture
def faults(cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    """The module's cluster, with every fault removed afterwards, whatever the test left on."""
    yield cluster
    cluster.thaw_all()
    cluster.network.heal_all()
    cluster.start_all()


def _topic(cluster: KafkaCluster) -> str:
    return cluster.create_topic(f"faults-{uuid.uuid4().hex[:8]}", partitions=1)


def _admin(port: int) -> AdminClient:
    # Only this broker is known until a metadata answer arrives, so nothing bypasses its fault.
    return AdminClient({"bootstrap.servers": f"127.0.0.1:{port}", "socket.timeout.ms": 2000})


def _producer(cluster: KafkaCluster, **conf: Any) -> Producer:
    return Producer({"bootstrap.servers": cluster.bootstrap_servers, "acks": "all", "linger.ms": 0, **conf})


def _send(producer: Producer, topic: str, value: bytes, reports: list[Any]) -> None:
    producer.produce(topic, value, on_delivery=lambda err, _msg: reports.append(err))
    producer.poll(0)


def test_clients_reach_every_broker_through_the_proxy(faults: KafkaCluster) -> None:
    ports = faults.network.ports
    assert faults.bootstrap_servers == ",".join(f"127.0.0.1:{p}" for p in ports)
    md = _admin(ports[0]).list_topics(timeout=10)
    # Metadata advertises the proxy's ports, so every later connection goes through it as well.
    assert {b.id: b.port for b in md.brokers.values()} == dict(enumerate(ports))


def test_frozen_cluster_delivers_only_after_thaw(faults: KafkaCluster) -> None:
    topic = _topic(faults)
    reports: list[Any] = []
    producer = _producer(faults, **{"message.timeout.ms": 120_000})
    _send(producer, topic, b"before", reports)
    assert producer.flush(30) == 0

    faults.freeze_all()
    assert faults.frozen_brokers == [0, 1, 2]
    _send(producer, topic, b"frozen", reports)
    producer.poll(3)
    assert reports == [None]  # nothing answers while every broker is stopped

    faults.thaw_all()
    assert faults.frozen_brokers == []
    assert producer.flush(90) == 0
    assert reports == [None, None]
    assert sorted(m.value() for m in consume(faults.bootstrap_servers, topic, 2)) == [b"before", b"frozen"]


def test_frozen_brokers_can_be_stopped_and_killed(faults: KafkaCluster) -> None:
    faults.freeze_broker(1)
    faults.freeze_broker(2)
    assert faults.frozen_brokers == [1, 2]
    faults.stop_broker(1)  # graceful: the pending SIGTERM acts once the broker is continued
    faults.kill_broker(2)
    assert faults.frozen_brokers == []
    assert faults.running_brokers() == [0]

    faults.start_all()
    # The proxy outlived the restarts: each restarted broker answers through its own proxy port.
    for i in (1, 2):
        md = _admin(faults.network.port(i)).list_topics(timeout=10)
        assert set(md.brokers) == {0, 1, 2}


def test_blackholed_broker_times_out_while_the_others_answer(faults: KafkaCluster) -> None:
    faults.network.blackhole(0)
    assert faults.network.faults(0).mode == "blackhole"
    with pytest.raises(KafkaException) as info:
        _admin(faults.network.port(0)).list_topics(timeout=3)
    assert info.value.args[0].code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT)
    assert set(_admin(faults.network.port(1)).list_topics(timeout=10).brokers) == {0, 1, 2}

    faults.network.heal(0)
    assert set(_admin(faults.network.port(0)).list_topics(timeout=10).brokers) == {0, 1, 2}


def test_followers_cut_off_from_clients_keep_replicating(faults: KafkaCluster) -> None:
    for i in range(faults.num_brokers):
        props = (faults.dir / f"broker-{i}" / "server.properties").read_text()
        assert "inter.broker.listener.name=INTERNAL\n" in props
        internal = int(props.split("INTERNAL://127.0.0.1:")[1].split()[0].split(",")[0])
        assert internal not in faults.network.ports
    topic = faults.create_topic(f"faults-{uuid.uuid4().hex[:8]}", partitions=3, config={"min.insync.replicas": "3"})
    md = _admin(faults.network.port(0)).list_topics(topic, timeout=10)
    led_by_0 = next(p.id for p in md.topics[topic].partitions.values() if p.leader == 0)
    faults.network.blackhole(1)
    faults.network.blackhole(2)
    reports: list[Any] = []
    # Bootstrapped at broker 0 only: the client never needs the black-holed brokers.
    producer = Producer({"bootstrap.servers": f"127.0.0.1:{faults.network.port(0)}", "acks": "all"})
    producer.produce(topic, b"replicated", partition=led_by_0, on_delivery=lambda err, _m: reports.append(err))
    # acks=all with min.insync.replicas=3: delivered only once brokers 1 and 2 have it.
    assert producer.flush(30) == 0
    assert reports == [None]


def test_reset_gives_a_transport_error_and_recovers_after_heal(faults: KafkaCluster) -> None:
    topic = _topic(faults)
    errors: list[KafkaError] = []
    reports: list[Any] = []
    producer = _producer(
        faults,
        **{"error_cb": errors.append, "message.timeout.ms": 60_000, "reconnect.backoff.max.ms": 1000},
    )
    _send(producer, topic, b"before", reports)
    assert producer.flush(30) == 0

    for i in range(faults.num_brokers):
        faults.network.reset(i)
    # Accepted, then reset: the RST may already beat connect() back on loopback.
    with pytest.raises(ConnectionResetError), socket.create_connection(("127.0.0.1", faults.network.port(0)), 5) as raw:
        raw.recv(1)
    deadline = time.monotonic() + 30
    wanted = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN}
    while not any(e.code() in wanted for e in errors) and time.monotonic() < deadline:
        producer.poll(0.2)
    assert any(e.code() in wanted for e in errors), errors

    faults.network.heal_all()
    _send(producer, topic, b"after", reports)
    assert producer.flush(60) == 0
    assert reports == [None, None]
    assert sorted(m.value() for m in consume(faults.bootstrap_servers, topic, 2)) == [b"after", b"before"]


def test_latency_and_bandwidth_still_deliver(faults: KafkaCluster) -> None:
    topic = _topic(faults)
    for i in range(faults.num_brokers):
        faults.network.latency(i, 0.1)
        faults.network.bandwidth(i, 128 * 1024)
    state = faults.network.faults(0)
    assert (state.mode, state.latency, state.bandwidth) == ("pass", 0.1, 128 * 1024)

    values = [bytes([n]) * 60_000 for n in range(3)]
    reports: list[Any] = []
    producer = _producer(faults, **{"message.timeout.ms": 60_000})
    for v in values:
        _send(producer, topic, v, reports)
    assert producer.flush(60) == 0
    assert reports == [None, None, None]
    # Read back through the same slow links.
    assert sorted(m.value() for m in consume(faults.bootstrap_servers, topic, 3, timeout=60)) == values


def _fill(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS t (v BLOB)")
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        for _ in range(10_000):
            conn.execute("INSERT INTO t VALUES (randomblob(8000))")


@pytest.mark.parametrize("mount", [None, False], ids=["tmpfs", "page-limit"])
def test_small_disk_fills_and_grows_back(mount: bool | None) -> None:
    with small_disk(256 * 1024, mount=mount) as disk:
        if mount is None:
            assert str(disk) in Path("/proc/mounts").read_text()  # the tests run as root on Linux
        conn = sqlite3.connect(disk / "full.db", isolation_level=None)
        _fill(conn)
        resize_disk(disk, 16 * 1024 * 1024)
        conn.execute("INSERT INTO t VALUES (randomblob(8000))")
        conn.close()
    assert not disk.exists()
    assert str(disk) not in Path("/proc/mounts").read_text()


def test_outbox_store_on_a_full_disk_accepts_writes_after_growing() -> None:
    with small_disk(512 * 1024) as disk:
        store = open_outbox(f"sqlite:///{disk / 'outbox.db'}")
        try:
            with pytest.raises(StoreError, match="database or disk is full"):
                for _ in range(1000):
                    store.enqueue([NewMessage("orders", os.urandom(8000))])  # incompressible
            resize_disk(disk, 32 * 1024 * 1024)
            [msg_id] = store.enqueue([NewMessage("orders", b"after")])
            assert msg_id
        finally:
            store.close()
