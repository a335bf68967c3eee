"""The cluster probe's client: the producer's connection settings, none of its callbacks."""

from __future__ import annotations

from outbox.producer.probe import ClusterProbe


def test_no_broker_answers_an_unreachable_bootstrap() -> None:
    probe = ClusterProbe({"bootstrap.servers": "127.0.0.1:1", "error_cb": lambda e: None})
    try:
        assert probe.answers(0.2) is False
    finally:
        probe.close()


def test_the_client_keeps_connection_settings_and_drops_the_producers_callbacks() -> None:
    def called(*_: object) -> None:
        raise AssertionError("a producer callback reached the probe")

    config = {
        "bootstrap.servers": "127.0.0.1:1",
        "security.protocol": "plaintext",
        "client.id": "orders",
        "error_cb": called,
        "stats_cb": called,
        "on_delivery": called,
        "statistics.interval.ms": 10,
        "enable.idempotence": True,
    }
    probe = ClusterProbe(config)
    kept = {"bootstrap.servers": "127.0.0.1:1", "security.protocol": "plaintext", "client.id": "orders-probe"}
    assert probe._config == kept
    try:
        assert probe.answers(0.3) is False
    finally:
        probe.close()
