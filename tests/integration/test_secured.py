"""A secured cluster (SASL_SSL): every part speaks to it, and credentials that stop working are an outage."""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Message, Producer

from outbox import (
    DeadLetter,
    NewMessage,
    ResilientConsumer,
    ResilientProducer,
    RetryPolicy,
    RetryTopics,
    SQLiteOutbox,
    open_outbox,
)
from outbox.testing import KafkaCluster
from outbox.testing.cluster import USERS
from outbox.testing.plugin import running_cluster

from ..waiting import wait_until
from .delivery import Arrivals, keyed_value, read_topic
from .test_cli_kafka import outbox_cli

# `make chaos` (CHAOS_LONG=1) holds the refusal under a running producer and consumer for a minute;
# `make test` for 10 s.
REFUSAL = 60.0 if os.environ.get("CHAOS_LONG") == "1" else 10.0
CIRCUIT = "outbox.producer.circuit"  # the circuits' openings, the one a refusal told once at WARNING


@pytest.fixture(scope="module")
def secured(request: pytest.FixtureRequest) -> Iterator[KafkaCluster]:
    # Connections re-authenticate every 3 s: a changed password takes effect on open connections too.
    cluster = KafkaCluster(brokers=1, security="SASL_SSL", broker_config={"connections.max.reauth.ms": 3000})
    yield from running_cluster(request, cluster)


def _heard(records: list[logging.LogRecord]) -> list[str]:
    """The WARNING and ERROR lines of the package's own loggers; librdkafka's (``outbox.librdkafka``,
    summarised every 10 s while connections fail) are not among them."""
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING and r.name != "outbox.librdkafka"]


def _read(cluster: KafkaCluster, topic: str, expect: int) -> Arrivals:
    config = cluster.client_config(user="admin")
    return read_topic(config.pop("bootstrap.servers"), topic, expect, config=config)


@pytest.mark.parametrize("drain_in", ["threads", "process"])
def test_a_password_that_stops_working_is_an_outage_and_a_rotation_delivers_everything_in_order(
    secured: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture, drain_in: str
) -> None:
    """The rotation reaches every client of the producer: its own, and its drain's (a drain process's too).
    The application hears of the refusal in one line, the circuit's: the drain, threads or process, says
    it waits for the cluster at INFO (a drain process does not forward it), as that line named the cause."""
    topic = secured.create_topic(f"secured-{time.time_ns()}", partitions=3)
    config = {**secured.client_config(user="alice"), "message.timeout.ms": 3000}
    producer = ResilientProducer(
        config,
        outbox=f"sqlite:///{tmp_path / 'o.db'}",
        retry=RetryPolicy(max_attempts=3, initial_delay=0.2),
        drain_in=drain_in,
    )
    # A drain process does not see the producer's circuit: it finds the cluster gone through a batch
    # of its own that fails (3 s), and a metadata request no broker answers (5 s), after the first
    # sends timed out (3 s) once re-authentication failed (3 s). The refusal lasts until it waits.
    hold = 10 if drain_in == "process" else 0
    ids = []
    try:
        for seq in range(300):
            ids.append(producer.produce(topic, keyed_value(seq % 10, seq)[1], key=keyed_value(seq % 10, seq)[0]))
        assert producer.flush(30) == 0
        secured.set_password("alice", "rotated-secret")  # the operator rotated it; the producer has the old one
        with caplog.at_level(logging.WARNING, logger="outbox"):
            before = len(caplog.records)
            deadline = time.monotonic() + 10
            seq = 300
            while time.monotonic() < deadline:  # producing on through the refusal
                ids.append(producer.produce(topic, keyed_value(seq % 10, seq)[1], key=keyed_value(seq % 10, seq)[0]))
                seq += 1
                time.sleep(0.01)
            time.sleep(hold)
            refused = producer.stats()
            assert refused["dead"] == 0 and refused["retried"] == 0, refused  # no attempt counted
            assert refused["pending"] > 0 and refused["circuit"] != "closed", refused
            producer.set_sasl_credentials("alice", "rotated-secret")
            wait_until(lambda: producer.stats()["pending"] == 0, 90, "the outbox delivered after the rotation")
            assert producer.stats()["dead"] == 0
            heard = _heard(caplog.records[before:])
    finally:
        producer.close(10)
        secured.set_password("alice", USERS["alice"])
    assert len(heard) == 1 and heard[0].startswith("circuit open (every broker refused the connection: "), heard
    assert all(USERS["alice"] not in r.getMessage() for r in caplog.records)  # never the secret
    got = _read(secured, topic, len(ids))
    assert got.unique == len(ids) and set(got.by_id) == set(ids)
    assert got.order_violations() == []


def test_outbox_drain_on_sasl_ssl_waits_out_refused_credentials_then_delivers_in_order(
    secured: KafkaCluster, tmp_path: Path
) -> None:
    """`outbox drain -X ...`: the wrong password is an outage (exit 3, nothing dead), the right one delivers."""
    topic = secured.create_topic(f"secured-drain-{time.time_ns()}", partitions=3)
    path = tmp_path / "o.db"
    with SQLiteOutbox(str(path)) as store:
        store.enqueue(
            [
                NewMessage(topic, value, key, [("outbox-id", f"d{seq}".encode())], -1, f"d{seq}")
                for seq in range(500)
                for key, value in [keyed_value(seq % 10, seq)]
            ]
        )
    settings = secured.client_config(user="alice")
    bootstrap = settings.pop("bootstrap.servers")

    def drain(password: str) -> subprocess.CompletedProcess[str]:
        options = [f"-X{k}={v}" for k, v in {**settings, "sasl.password": password}.items()]
        return outbox_cli("drain", "--outbox", f"sqlite:///{path}", "-b", bootstrap, *options)

    refused = drain("wrong-password")
    assert refused.returncode == 3, refused.stderr  # pending left: the cluster did not take us
    assert "wrong-password" not in refused.stdout + refused.stderr
    with SQLiteOutbox(str(path), create=False) as store:
        stats = store.stats(now=time.time())
        assert (stats.pending, stats.dead) == (500, 0)
        assert all(m.attempts == 0 for m in store.messages())  # no attempt counted
    done = drain(USERS["alice"])
    assert done.returncode == 0, done.stderr
    got = _read(secured, topic, 500)
    assert got.unique == 500 and got.order_violations() == []


def test_a_message_refused_for_its_own_fault_on_sasl_ssl_is_a_dead_letter(
    secured: KafkaCluster, tmp_path: Path
) -> None:
    """On a secured cluster what is the message's fault still dead-letters (here one too large for its topic)."""
    topic = secured.create_topic(f"secured-small-{time.time_ns()}", partitions=1, config={"max.message.bytes": "2000"})
    dead: list[DeadLetter] = []
    with ResilientProducer(
        secured.client_config(), outbox=f"sqlite:///{tmp_path / 'o.db'}", on_dead_letter=dead.append
    ) as producer:
        producer.produce(topic, b"x" * 10_000, key=b"big")
        producer.produce(topic, b"small", key=b"ok")
        assert producer.flush(30) == 0
        wait_until(lambda: len(dead) == 1, 30, "the large message dead-lettered")
        assert producer.stats()["pending"] == 0
    assert dead[0].key == b"big" and (dead[0].last_error or "").startswith("MSG_SIZE_TOO_LARGE")
    assert _read(secured, topic, 1).values() == {b"small"}


def test_the_consumer_ladder_on_sasl_ssl(secured: KafkaCluster, tmp_path: Path) -> None:
    """Retry tier and dead-letter topic through the secured listener: every failing message in the DLQ once."""
    topic = secured.create_topic(f"secured-ladder-{time.time_ns()}", partitions=3)
    group = f"g-{topic}"
    settings = secured.client_config()
    plain = Producer(settings)
    for i in range(200):
        plain.produce(topic, b"fail-%d" % i if i % 10 == 0 else b"ok-%d" % i, key=b"k%d" % (i % 10))
    assert plain.flush(30) == 0
    handled: list[bytes] = []

    def handle(msg: Message) -> None:
        value = msg.value() or b""
        if value.startswith(b"fail"):
            raise TimeoutError("downstream timed out")
        handled.append(value)

    consumer = ResilientConsumer(
        {**settings, "group.id": group, "auto.offset.reset": "earliest"},
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[1]),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    try:
        wait_until(lambda: consumer.poll_once() >= 0 and consumer.stats()["dead"] >= 20, 90, "20 dead letters")
    finally:
        consumer.close()
    assert sorted(handled) == sorted(b"ok-%d" % i for i in range(200) if i % 10)
    dlq = _read(secured, f"{topic}.{group}.dlq", 20)
    assert dlq.values() == {b"fail-%d" % i for i in range(0, 200, 10)} and len(dlq.messages) == 20


def test_an_outage_of_a_secured_cluster_is_stored_and_recovered_in_order(secured: KafkaCluster, tmp_path: Path) -> None:
    """The broker stopped: the producer's messages wait in the outbox, and the restarted broker gets them all."""
    topic = secured.create_topic(f"secured-outage-{time.time_ns()}", partitions=3)
    config = {**secured.client_config(), "message.timeout.ms": 3000}
    ids = []
    with ResilientProducer(config, outbox=f"sqlite:///{tmp_path / 'o.db'}", circuit_reset_timeout=1.0) as producer:
        for seq in range(100):
            ids.append(producer.produce(topic, keyed_value(seq % 10, seq)[1], key=keyed_value(seq % 10, seq)[0]))
        assert producer.flush(30) == 0
        secured.stop_broker(0)
        try:
            for seq in range(100, 400):
                ids.append(producer.produce(topic, keyed_value(seq % 10, seq)[1], key=keyed_value(seq % 10, seq)[0]))
            assert producer.flush(30) == 0  # every message delivered or committed to the outbox
            assert producer.stats()["pending"] > 0
        finally:
            secured.start_all()
        wait_until(lambda: producer.stats()["pending"] == 0, 120, "the outbox delivered after the outage")
        assert producer.stats()["dead"] == 0
    got = _read(secured, topic, len(ids))
    assert got.unique == 400 and got.order_violations() == []


def test_a_spark_drain_through_a_secured_cluster(spark: Any, secured: KafkaCluster, tmp_path: Path) -> None:
    """The executors' producers take the `-X` settings: the Spark job drains into SASL_SSL, in key order."""
    from spark_drain import JobOptions, run_job

    from .test_spark_drain import check_consumed, fill

    topic = secured.create_topic(f"secured-spark-{time.time_ns()}", partitions=3)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    with open_outbox(url) as store:
        ids = fill(store, topic, 2000)
    settings = secured.client_config()
    bootstrap = settings.pop("bootstrap.servers")
    report = run_job(spark, JobOptions(outbox=url, bootstrap_servers=bootstrap, partitions=2, kafka_config=settings))
    assert report.ok and report.total.delivered == 2000, report
    got = _read(secured, topic, 2000)
    check_consumed(got.messages, ids)


def test_a_tls_handshake_that_fails_is_an_outage_and_a_restart_with_the_right_authority_delivers(
    secured: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that does not trust the broker's certificate (another authority): stored, never dead."""
    topic = secured.create_topic(f"secured-tls-{time.time_ns()}", partitions=3)
    assert secured.certificates is not None
    url = f"sqlite:///{tmp_path / 'o.db'}"
    wrong = {
        **secured.client_config(),
        "ssl.ca.location": str(secured.certificates.stranger_cert),
        "message.timeout.ms": 3000,
    }
    ids = []
    with caplog.at_level(logging.WARNING, logger="outbox"), ResilientProducer(wrong, outbox=url) as producer:
        for seq in range(200):
            ids.append(producer.produce(topic, keyed_value(seq % 10, seq)[1], key=keyed_value(seq % 10, seq)[0]))
        assert producer.flush(30) == 0  # in the outbox
        stats = producer.stats()
        assert (stats["pending"], stats["dead"], stats["retried"]) == (200, 0, 0), stats
    opened = [r.getMessage() for r in caplog.records if r.getMessage().startswith("circuit open")]
    assert opened and "every broker refused the connection: _SSL" in opened[0], opened
    with ResilientProducer(secured.client_config(), outbox=url) as producer:  # restarted, fixed
        wait_until(lambda: producer.stats()["pending"] == 0, 90, "the outbox delivered")
    got = _read(secured, topic, 200)
    assert set(got.by_id) == set(ids) and got.order_violations() == []


def test_a_rotation_under_a_running_producer_and_consumer_loses_nothing_and_keeps_key_order(
    secured: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both keep going through the refusal (`REFUSAL` seconds); `set_sasl_credentials()` on each, and
    every message is handled once a key at a time in order, with nothing dead-lettered on either side.
    The application hears of the refusal in one line, naming the cause and never the secret.

    The refusal outlasts the consumer's group session: the group drops it, and when it joins again it
    reads from the last offsets committed, which the coordinator refused for a while before the fetches
    stopped. Kafka hands those messages again; the consumer's inbox (`dedup=True`) skips them."""
    topic = secured.create_topic(f"secured-both-{time.time_ns()}", partitions=3)
    config = {**secured.client_config(user="alice"), "message.timeout.ms": 5000}
    handled: dict[bytes, list[int]] = {}

    def handle(msg: Message) -> None:
        key, seq = (msg.value() or b"").split(b":")
        handled.setdefault(key, []).append(int(seq))

    consumer = ResilientConsumer(
        {
            **config,
            "group.id": f"g-{topic}",
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1000,
        },
        topics=[topic],
        handler=handle,
        strategy=RetryTopics(delays=[1]),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
        dedup=True,
    )
    producer = ResilientProducer(config, outbox=f"sqlite:///{tmp_path / 'p.db'}")
    seq = 0
    try:

        def produce_for(seconds: float) -> None:
            nonlocal seq
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                key, value = keyed_value(seq % 10, seq)
                producer.produce(topic, value, key=key)
                seq += 1
                consumer.poll_once()

        produce_for(3)
        secured.set_password("alice", "rotated-secret")
        with caplog.at_level(logging.WARNING, logger="outbox"), caplog.at_level(logging.INFO, logger=CIRCUIT):
            before = len(caplog.records)
            produce_for(REFUSAL)  # refused: both wait
        heard = _heard(caplog.records[before:])
        opened = [r.levelname for r in caplog.records[before:] if r.getMessage().startswith("circuit open")]
        assert producer.stats()["retried"] == 0 and producer.stats()["dead"] == 0, producer.stats()
        producer.set_sasl_credentials("alice", "rotated-secret")
        consumer.set_sasl_credentials("alice", "rotated-secret")
        wait_until(lambda: producer.stats()["pending"] == 0, 90, "the producer's outbox delivered")
        wait_until(
            lambda: consumer.poll_once() >= 0 and sum(map(len, handled.values())) >= seq, 90, "every message handled"
        )
        assert producer.stats()["dead"] == 0 and consumer.stats()["dead"] == 0
        skipped = consumer.stats()["duplicates_skipped"]
    finally:
        producer.close(10)
        consumer.close()
        secured.set_password("alice", USERS["alice"])
    assert sorted(s for seqs in handled.values() for s in seqs) == list(range(seq))  # each once, none lost
    for key, seqs in handled.items():
        assert seqs == sorted(seqs), f"{key!r} handled out of order"
    # Both producers (the application's, the consumer's retry tiers') open their circuits naming the
    # cause, and the consumer may meet refused errors of its own (a rejoin's FindCoordinator): the
    # process tells the application once (`outbox.producer.refusals`), the others at INFO.
    assert len(opened) == 2, opened
    assert len(heard) == 1 and "_AUTHENTICATION" in heard[0], heard
    assert not any(r.levelno >= logging.ERROR for r in caplog.records), heard
    assert not any(secret in r.getMessage() for r in caplog.records for secret in (USERS["alice"], "rotated-secret"))
    print(
        f"\n{seq} produced over {REFUSAL:.0f} s of refusal, {seq} handled once in key order "
        f"({skipped} copies read again skipped), 0 dead; heard:",
        *heard,
        sep="\n",
    )


@pytest.fixture(scope="module")
def mutual_tls(request: pytest.FixtureRequest) -> Iterator[KafkaCluster]:
    """An SSL cluster whose listener requires a client certificate signed by its authority."""
    yield from running_cluster(request, KafkaCluster(brokers=1, security="SSL"))


def _refused_then_delivered(
    cluster: KafkaCluster,
    refused: dict[str, Any],
    fixed: dict[str, Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> list[str]:
    """Produce 200 keyed messages with `refused` settings: all pending, none dead, no attempt
    counted, the circuit open; then a restart with `fixed` delivers them all in key order.
    Returns the warning lines the application saw while refused."""
    topic = cluster.create_topic(f"refused-{time.time_ns()}", partitions=3)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    ids = []
    with (
        caplog.at_level(logging.WARNING, logger="outbox"),
        ResilientProducer({**refused, "message.timeout.ms": 3000}, outbox=url) as producer,
    ):
        for seq in range(200):
            key, value = keyed_value(seq % 10, seq)
            ids.append(producer.produce(topic, value, key=key))
        assert producer.flush(30) == 0  # in the outbox
        stats = producer.stats()
        assert (stats["pending"], stats["dead"], stats["retried"]) == (200, 0, 0), stats
        assert stats["circuit"] != "closed", stats
    heard = _heard(caplog.records)
    assert not any(r.levelno >= logging.ERROR for r in caplog.records), heard
    with SQLiteOutbox(str(tmp_path / "o.db"), create=False) as store:
        assert all(m.attempts == 0 for m in store.messages())  # no attempt counted
    with ResilientProducer(fixed, outbox=url) as producer:  # restarted with the right settings
        wait_until(lambda: producer.stats()["pending"] == 0, 90, "the outbox delivered")
        assert producer.stats()["dead"] == 0
    got = _read(cluster, topic, 200)
    assert got.unique == 200 and set(got.by_id) == set(ids) and got.order_violations() == []
    return heard


def test_a_client_certificate_the_broker_rejects_is_an_outage_and_the_right_one_delivers(
    mutual_tls: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The client's certificate is signed by another authority: the broker ends the handshake."""
    certs = mutual_tls.certificates
    assert certs is not None
    wrong = {
        **mutual_tls.client_config(),
        "ssl.certificate.location": str(certs.stranger_cert),
        "ssl.key.location": str(certs.stranger_key),
    }
    heard = _refused_then_delivered(mutual_tls, wrong, mutual_tls.client_config(), tmp_path, caplog)
    assert (
        len(heard) == 1
        and heard[0].startswith("circuit open (every broker refused the connection: ")
        and ("ssl/tls alert bad certificate" in heard[0])
    ), heard


def _unsecured_jwt(subject: str, lifetime: float) -> tuple[str, float]:
    """A token of Kafka's unsecured JWT mode (`alg: none`, no signature) and its expiry."""

    def part(claims: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()

    now = time.time()
    return f"{part({'alg': 'none'})}.{part({'sub': subject, 'iat': int(now), 'exp': int(now + lifetime)})}.", (
        now + lifetime
    )


def test_an_oauth_token_the_broker_rejects_is_an_outage_and_a_working_oauth_cb_delivers(
    secured: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`oauth_cb` hands librdkafka a token the broker does not accept (a refresh gone wrong)."""
    settings = secured.client_config(mechanism="OAUTHBEARER")
    for unsecured in ("enable.sasl.oauthbearer.unsecure.jwt", "sasl.oauthbearer.config"):
        settings.pop(unsecured)  # the token comes from oauth_cb

    def bad_token(_: Any) -> tuple[str, float]:
        return "not-a-token", time.time() + 3600

    def good_token(_: Any) -> tuple[str, float]:
        return _unsecured_jwt("alice", 3600)

    heard = _refused_then_delivered(
        secured, {**settings, "oauth_cb": bad_token}, {**settings, "oauth_cb": good_token}, tmp_path, caplog
    )
    assert (
        len(heard) == 1
        and heard[0].startswith("circuit open (every broker refused the connection: ")
        and ("SASL authentication error" in heard[0])
    ), heard
    assert not any("not-a-token" in r.getMessage() for r in caplog.records)  # never the token


class TokenServiceDown(Exception):
    """What a token service's client raises when the service does not answer."""


#: What the token service's failure says; no log line may carry it (it could be its answer).
SERVICE_ANSWER = "503 from https://idp.example/token?client_secret=s3cr3t-of-the-service"


class _TokenService:
    """An `oauth_cb`: a token for 6 s while the service is up, `TokenServiceDown` while it is down.
    It keeps the tokens it handed out, to look for them in the logs."""

    def __init__(self) -> None:
        self.up = True
        self.issued: list[str] = []

    def __call__(self, _: Any) -> tuple[str, float]:
        if not self.up:
            raise TokenServiceDown(SERVICE_ANSWER)
        token, expiry = _unsecured_jwt("alice", 6)
        self.issued.append(token)
        return token, expiry


def test_an_oauth_cb_that_raises_is_an_outage_and_a_working_one_delivers_everything_in_key_order(
    secured: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The token service goes down under a running producer: its token expires and `oauth_cb` raises,
    on the producer's client and on the drain workers' (which cannot even be made without a token).
    Nothing is dead-lettered, no attempt is counted, the application hears one line naming the
    cause, and no token nor what the service answered reaches a log line; once the service
    answers again, everything is delivered in key order."""
    topic = secured.create_topic(f"secured-token-{time.time_ns()}", partitions=3)
    settings = secured.client_config(mechanism="OAUTHBEARER")
    for unsecured in ("enable.sasl.oauthbearer.unsecure.jwt", "sasl.oauthbearer.config"):
        settings.pop(unsecured)  # the token comes from oauth_cb
    service = _TokenService()
    ids = []

    def produce_for(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            key, value = keyed_value(len(ids) % 10, len(ids))
            ids.append(producer.produce(topic, value, key=key))
            time.sleep(0.02)

    with caplog.at_level(logging.DEBUG, logger="outbox"):
        producer = ResilientProducer(
            {**settings, "oauth_cb": service, "message.timeout.ms": 3000}, outbox=f"sqlite:///{tmp_path / 'o.db'}"
        )
        try:
            produce_for(1)
            assert producer.flush(30) == 0 and producer.stats()["pending"] == 0  # the tokens work
            service.up = False
            before = len(caplog.records)
            produce_for(15)  # the token expires, and no new one comes
            stats = producer.stats()
            heard = _heard(caplog.records[before:])
            assert (stats["dead"], stats["retried"], stats["drain_restarts"]) == (0, 0, 0), stats
            assert stats["pending"] > 0 and stats["circuit"] != "closed", stats
            service.up = True
            wait_until(lambda: producer.stats()["pending"] == 0, 90, "the outbox delivered once a token came")
            assert producer.stats()["dead"] == 0
        finally:
            producer.close(10)
    assert len(heard) == 1, heard
    assert heard[0].startswith(
        "circuit open (every broker refused the connection: no OAuth token, the application's oauth_cb raised "
        "TokenServiceDown"
    ), heard
    assert not any(r.levelno >= logging.ERROR for r in caplog.records), heard
    lines = [logging.Formatter().format(r) for r in caplog.records]  # tracebacks too
    assert not any(secret in line for line in lines for secret in ("s3cr3t", *service.issued))
    got = _read(secured, topic, len(ids))
    assert got.unique == len(ids) and set(got.by_id) == set(ids) and got.order_violations() == []


def test_the_consoles_redrives_reach_a_sasl_ssl_cluster(secured: KafkaCluster, tmp_path: Path) -> None:
    """A producer's dead letter redriven through the console is delivered by the producer's drain;
    a consumer's DLQ topic redriven through the console lands in its first retry tier."""
    from fastapi.testclient import TestClient

    from outbox.ui import create_app

    from .test_ui_api import consumer_headers

    topic = secured.create_topic(f"secured-redrive-{time.time_ns()}", partitions=1)
    dlq = secured.create_topic(f"{topic}.billing.dlq", partitions=1)
    tier = secured.create_topic(f"{topic}.billing.retry-1", partitions=1)
    settings = secured.client_config()
    plain = Producer(settings)
    plain.produce(dlq, b"dead-in-topic", headers=consumer_headers("billing", topic))
    assert plain.flush(30) == 0
    store = SQLiteOutbox(str(tmp_path / "o.db"))
    try:
        dead = store.add_dead(
            [
                NewMessage(
                    topic,
                    b"dead-in-store",
                    b"k",
                    [],
                    -1,
                    "s1",
                    attempts=3,
                    error_name="MSG_TIMED_OUT",
                    last_error="MSG_TIMED_OUT (-192): timed out",
                )
            ],
            failed_at=time.time(),
        )
        console = TestClient(create_app(store, kafka=settings), base_url="http://localhost")
        job = console.post("/api/redrive", json={"ids": dead})
        assert job.status_code == 202, job.text
        wait_until(lambda: console.get(job.json()["url"]).json()["state"] != "running", 30, "the redrive job")
        assert console.get(job.json()["url"]).json()["state"] == "done"
        replayed = console.post("/api/redrive-topic", json={"dlq_topic": dlq})
        assert replayed.status_code == 200, replayed.text
        assert replayed.json() == {"dlq_topic": dlq, "replayed": 1, "by_topic": {tier: 1}}
    finally:
        store.close()
    with ResilientProducer(settings, outbox=f"sqlite:///{tmp_path / 'o.db'}") as producer:
        wait_until(lambda: producer.stats()["pending"] == 0, 60, "the redriven message delivered")
    assert [m.value() for m in _read(secured, topic, 1).messages] == [b"dead-in-store"]
    assert [m.value() for m in _read(secured, tier, 1).messages] == [b"dead-in-topic"]
