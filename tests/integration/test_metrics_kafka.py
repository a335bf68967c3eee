"""Prometheus endpoints scraped over real HTTP while every broker is down, and after recovery.

Two endpoints: the application's own (outbox.metrics.ProducerCollector on prometheus-client's
HTTP server) and the `outbox metrics` sidecar command, run as a subprocess on the same outbox.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from outbox import ResilientProducer, RetryPolicy
from outbox.metrics import register_producer
from outbox.testing import KafkaCluster

from ..waiting import wait_until
from .delivery import read_topic

FAST = {"acks": "all", "enable.idempotence": True, "linger.ms": 5, "message.timeout.ms": 3000}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def k(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """A sample's key in `scrape()`'s result: labels of the producer "orders-api" plus `labels`."""
    return name, tuple(sorted({"producer": "orders-api", **labels}.items()))


def start_sidecar(db: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "outbox"), "metrics", "--outbox", str(db), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    found = re.search(r"(http://127\.0\.0\.1:\d+/metrics)", line)
    assert found, f"the sidecar did not say where it serves: {line!r}"
    return proc, found.group(1)


def test_metrics_endpoints_during_an_outage_and_after_recovery(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = make_topic()
    bs = chaos_cluster.bootstrap_servers
    db = tmp_path / "o.db"
    p = ResilientProducer(
        {"bootstrap.servers": bs, **FAST},
        outbox=f"sqlite:///{db}",
        retry=RetryPolicy(max_attempts=100, initial_delay=0.5),
        circuit_reset_timeout=1.0,
        drain_poll_interval=0.2,
        lease_seconds=10.0,
    )
    registry = CollectorRegistry(auto_describe=True)
    register_producer(p, name="orders-api", registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    app_url = f"http://127.0.0.1:{server.server_port}/metrics"
    sidecar, sidecar_url = start_sidecar(db)
    try:
        for i in range(100):
            p.produce(topic, b"before-%d" % i)
        wait_until(lambda: p.stats()["delivered"] == 100, 60, "the first 100 messages are delivered")
        healthy = scrape(app_url)
        # (first try unless a loaded machine made a send time out: then through the outbox)
        assert healthy[k("outbox_delivered_total", path="first_try")] + healthy[
            k("outbox_delivered_total", path="outbox")
        ] == 100
        assert healthy[k("outbox_queue_full_waits_total")] == 0  # 100 messages never fill librdkafka's queue

        chaos_cluster.stop_all()
        for i in range(200):
            p.produce(topic, b"during-%d" % i)
        wait_until(lambda: p.stats()["pending"] >= 200, 60, "the outage's messages are in the outbox")
        down: dict[str, Any] = scrape(app_url)
        side_down = scrape(sidecar_url)

        chaos_cluster.start_all()
        wait_until(lambda: p.stats()["pending"] == 0, 120, "the outbox is drained")
        up: dict[str, Any] = scrape(app_url)
        side_up = scrape(sidecar_url)
    finally:
        sidecar.terminate()
        sidecar.wait(10)
        server.shutdown()
        thread.join(5)
        p.close()
    assert sidecar.returncode == 0, "SIGTERM stops the sidecar cleanly"

    assert down[k("outbox_produced_total")] == 300
    assert down[k("outbox_outboxed_total")] >= 200
    assert down[k("outbox_pending_messages")] >= 200
    assert down[k("outbox_pending_messages_by_topic", topic=topic)] >= 200
    assert down[k("outbox_oldest_pending_age_seconds")] > 0
    assert down[k("outbox_circuit_state", outbox_circuit_state="closed")] == 0
    assert down[k("outbox_commit_seconds_count")] >= 1
    assert side_down[("outbox_store_up", ())] == 1
    assert side_down[("outbox_pending_messages", ())] >= 200

    assert up[k("outbox_pending_messages")] == 0
    assert up[k("outbox_oldest_pending_age_seconds")] == 0
    delivered = up[k("outbox_delivered_total", path="first_try")] + up[
        k("outbox_delivered_total", path="outbox")
    ]
    assert delivered == 300 and up[k("outbox_delivered_total", path="outbox")] >= 200
    # The rows drained after the outage were claimed first: each claim is timed.
    assert up[k("outbox_drain_claim_seconds_count")] >= 1
    assert up[k("outbox_dead_lettered_total")] == 0
    assert side_up[("outbox_pending_messages", ())] == 0
    got = read_topic(bs, topic, 300)
    assert got.unique == 300
    circuit = [dict(lab)["outbox_circuit_state"] for (n, lab), v in down.items() if n == "outbox_circuit_state" and v]
    print(
        f"\nmetrics: during the outage pending={down[k('outbox_pending_messages')]:.0f}, "
        f"circuit={circuit}; "
        f"after: delivered from outbox={up[k('outbox_delivered_total', path='outbox')]:.0f}, "
        f"drain rate at the last scrape {up[k('outbox_drain_rate_messages_per_second')]:.0f}/s, "
        f"commits={up[k('outbox_commit_seconds_count')]:.0f} "
        f"(sum {up[k('outbox_commit_seconds_sum')] * 1000:.0f} ms)"
    )
