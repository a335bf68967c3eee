"""ResilientProducer's checks of its settings (no Kafka needed: they are checked
before anything is opened or started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox import ConfigError, ResilientProducer
from outbox.producer import _is_true


@pytest.mark.parametrize("setting", [True, False])
def test_only_error_setting_is_a_bool(setting: bool) -> None:
    assert _is_true(setting) is setting


# confluent_kafka itself takes only a bool for this key ("Expected ... to be bool type").
@pytest.mark.parametrize("setting", ["true", "maybe", 1, None])
def test_an_unreadable_only_error_setting_is_a_clear_error_and_opens_nothing(setting: object, tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(ConfigError, match=r"delivery.report.only.error must be True or False, got "):
        ResilientProducer(
            {"bootstrap.servers": "127.0.0.1:1", "delivery.report.only.error": setting}, outbox=f"sqlite:///{db}"
        )
    assert not db.exists()


@pytest.mark.parametrize("timeout", [-0.1, float("nan")])
def test_a_negative_queue_full_timeout_is_a_clear_error_and_opens_nothing(timeout: float, tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    with pytest.raises(ConfigError, match=r"queue_full_timeout must be >= 0 seconds, got "):
        ResilientProducer({"bootstrap.servers": "127.0.0.1:1"}, outbox=f"sqlite:///{db}", queue_full_timeout=timeout)
    assert not db.exists()
