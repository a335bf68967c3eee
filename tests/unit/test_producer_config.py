"""ResilientProducer's reading of `delivery.report.only.error` (no Kafka needed: it is checked
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
