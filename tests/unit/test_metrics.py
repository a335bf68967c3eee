"""outbox.metrics pieces that need no Kafka: the commit histogram, the store collector, the CLI."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from outbox_cli.main import cli
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from outbox.latency import LatencyHistogram
from outbox.metrics import StoreCollector
from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"OUTBOX_URL": ""}, catch_exceptions=False)


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "outbox.db")
    now = time.time()
    with SQLiteOutbox(path) as store:
        store.enqueue(
            [
                NewMessage("orders", b"1", b"k", [], -1, "a", 0, None, None, now),
                NewMessage("orders", b"2", b"k", [], -1, "b", 0, None, None, now),
                NewMessage("payments", b"3", None, [], -1, "c", 0, None, None, now),
            ]
        )
        store.add_dead([NewMessage("orders", b"4", None, [], -1, "d", 1, now, "X (1): bad", now)], failed_at=now)
    return path


def test_histogram_buckets_are_cumulative_and_le_inclusive() -> None:
    h = LatencyHistogram((0.01, 0.1))
    for v in (0.001, 0.01, 0.05, 0.1, 7.0):
        h.observe(v)
    buckets, total = h.cumulative()
    assert buckets == [("0.01", 2), ("0.1", 4), ("+Inf", 5)]
    assert total == pytest.approx(7.161)
    with pytest.raises(ValueError, match="strictly increasing"):
        LatencyHistogram((0.1, 0.01))


def test_store_collector_reports_pending_dead_and_by_topic(db: str) -> None:
    registry = CollectorRegistry(auto_describe=True)
    with SQLiteOutbox(db) as store:
        registry.register(StoreCollector(store, {"outbox": "orders"}))
        got = samples(generate_latest(registry).decode())
    lab = (("outbox", "orders"),)
    assert got[("outbox_store_up", lab)] == 1
    assert got[("outbox_pending_messages", lab)] == 3
    assert got[("outbox_pending_messages_by_topic", (*lab, ("topic", "orders")))] == 2
    assert got[("outbox_pending_messages_by_topic", (*lab, ("topic", "payments")))] == 1
    assert got[("outbox_dead_letters", lab)] == 1
    assert got[("outbox_dead_letters_by_topic", (*lab, ("topic", "orders")))] == 1
    assert 0 <= got[("outbox_oldest_pending_age_seconds", lab)] < 60


def test_store_collector_says_down_when_the_store_cannot_be_read(db: str) -> None:
    store = SQLiteOutbox(db)
    store.close()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StoreCollector(store))
    got = samples(generate_latest(registry).decode())
    assert got == {("outbox_store_up", ()): 0}


def test_cli_metrics_once_and_textfile(db: str, tmp_path: Path) -> None:
    once = run("metrics", "--outbox", db, "--once", "--label", "outbox=orders")
    assert once.exit_code == 0, once.output
    assert samples(once.output)[("outbox_pending_messages", (("outbox", "orders"),))] == 3
    out = tmp_path / "outbox.prom"
    written = run("metrics", "--outbox", db, "--textfile", str(out))
    assert written.exit_code == 0 and written.output == ""
    assert samples(out.read_text())[("outbox_dead_letters", ())] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".outbox-metrics-")] == []


def test_cli_metrics_errors(db: str, tmp_path: Path) -> None:
    missing = run("metrics", "--outbox", str(tmp_path / "nope.db"), "--once")
    assert missing.exit_code == 1
    assert missing.stderr.strip() == f"Error: outbox file {tmp_path / 'nope.db'} does not exist"
    bad = run("metrics", "--outbox", db, "--once", "--label", "1x=2")
    assert bad.exit_code == 2
    assert "expected NAME=VALUE with a label name like outbox=orders, got '1x=2'" in bad.stderr
