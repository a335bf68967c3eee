"""Prometheus metrics for kafka-outbox (``pip install 'kafka-outbox[metrics]'``).

    from prometheus_client import start_http_server
    from outbox.metrics import register_producer
    register_producer(producer)          # a ResilientProducer or an AsyncResilientProducer
    register_consumer(consumer)          # a ResilientConsumer or an AsyncResilientConsumer
    start_http_server(9108)

Custom collectors read, at scrape time, the counters the SDK keeps anyway (``stats()``, the
store's ``stats()``, the writer's commit histogram). Nothing is added to ``produce()``: no
per-message lock, no per-message call. A scrape costs one ``stats()`` of the producer and one
of the store (a ``GROUP BY`` over the outbox table; run at scrape time only).

What is by topic and what is not: the store knows pending and dead rows per topic, so those
gauges carry a ``topic`` label. The producer's counters (produced, delivered, outboxed,
retried, dead-lettered) are process-wide totals: the SDK keeps no per-topic counters on its
hot path, and adding them would cost a dict update per message.

Not exported: a produce()-call latency histogram. Timing every call costs two clock reads and a
bucket update per message (a few per cent of the per-message budget); time ``produce()`` in
the application if it matters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
        StateSetMetricFamily,
    )
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("outbox.metrics needs prometheus-client: pip install 'kafka-outbox[metrics]'") from exc

from outbox.consumer import ResilientConsumer
from outbox.drain.workers import Drainer
from outbox.errors import StoreError
from outbox.producer.circuit import CircuitState
from outbox.producer.resilient import ResilientProducer
from outbox.records import StoreStats
from outbox.stores import Outbox

log = logging.getLogger(__name__)

__all__ = [
    "ConsumerCollector",
    "ProducerCollector",
    "StoreCollector",
    "register_consumer",
    "register_producer",
    "register_store",
]


def _as_sync(producer: Any) -> ResilientProducer:
    """The ResilientProducer behind an AsyncResilientProducer (or the producer itself)."""
    inner = getattr(producer, "producer", producer)
    if not isinstance(inner, ResilientProducer):
        raise TypeError(f"expected a ResilientProducer or AsyncResilientProducer, not {type(producer).__name__}")
    return inner


def _store_metrics(stats: StoreStats, now: float, labels: Mapping[str, str]) -> Iterator[Metric]:
    names, values = list(labels), list(labels.values())
    pending = GaugeMetricFamily("outbox_pending_messages", "Messages waiting in the outbox.", labels=names)
    pending.add_metric(values, stats.pending)
    yield pending
    by_topic = GaugeMetricFamily(
        "outbox_pending_messages_by_topic", "Messages waiting in the outbox, by topic.", labels=[*names, "topic"]
    )
    for topic, n in sorted(stats.pending_by_topic.items()):
        by_topic.add_metric([*values, topic], n)
    yield by_topic
    dead = GaugeMetricFamily("outbox_dead_letters", "Dead letters stored in the outbox.", labels=names)
    dead.add_metric(values, stats.dead)
    yield dead
    dead_topic = GaugeMetricFamily(
        "outbox_dead_letters_by_topic", "Dead letters stored in the outbox, by topic.", labels=[*names, "topic"]
    )
    for topic, n in sorted(stats.dead_by_topic.items()):
        dead_topic.add_metric([*values, topic], n)
    yield dead_topic
    age = GaugeMetricFamily(
        "outbox_oldest_pending_age_seconds", "Age of the oldest pending message (0: none pending).", labels=names
    )
    age.add_metric(values, 0.0 if stats.oldest_pending_at is None else max(0.0, now - stats.oldest_pending_at))
    yield age
    leased = GaugeMetricFamily(
        "outbox_leased_messages", "Pending messages a drain worker is sending now.", labels=names
    )
    leased.add_metric(values, stats.leased)
    yield leased


_STORE_METRICS: tuple[tuple[str, str], ...] = (
    ("outbox_pending_messages", "gauge"),
    ("outbox_pending_messages_by_topic", "gauge"),
    ("outbox_dead_letters", "gauge"),
    ("outbox_dead_letters_by_topic", "gauge"),
    ("outbox_oldest_pending_age_seconds", "gauge"),
    ("outbox_leased_messages", "gauge"),
)
_STORE_ONLY_METRICS = (("outbox_store_up", "gauge"), *_STORE_METRICS)
_PRODUCER_METRICS: tuple[tuple[str, str], ...] = (
    ("outbox_produced", "counter"),
    ("outbox_delivered", "counter"),
    ("outbox_outboxed", "counter"),
    ("outbox_retried", "counter"),
    ("outbox_dead_lettered", "counter"),
    ("outbox_failed_no_retry", "counter"),
    ("outbox_queue_full_waits", "counter"),
    ("outbox_in_memory_messages", "gauge"),
    ("outbox_unsaved_messages", "gauge"),
    ("outbox_circuit_state", "stateset"),
    ("outbox_drain_rate_messages_per_second", "gauge"),
    ("outbox_commit_seconds", "histogram"),
    ("outbox_drain_claim_seconds", "histogram"),
    *_STORE_METRICS,
)


def _describe(metrics: tuple[tuple[str, str], ...]) -> Iterator[Metric]:
    return iter([Metric(name, "", kind) for name, kind in metrics])


class StoreCollector(Collector):
    """Gauges of an outbox store alone: what ``outbox metrics`` serves beside a fleet.

    Args:
        store: the outbox.
        labels: constant labels for every sample (e.g. ``{"outbox": "orders"}``). Never put the
            store URL there: it may hold a password.
    """

    def __init__(self, store: Outbox, labels: Mapping[str, str] | None = None) -> None:
        self.store = store
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        up = GaugeMetricFamily(
            "outbox_store_up", "1 if the outbox could be read at this scrape.", labels=list(self.labels)
        )
        try:
            stats = self.store.stats(now=now)
        except StoreError as exc:
            log.warning("outbox metrics: cannot read the outbox: %s", exc)
            up.add_metric(list(self.labels.values()), 0)
            yield up
            return
        up.add_metric(list(self.labels.values()), 1)
        yield up
        yield from _store_metrics(stats, now, self.labels)

    def describe(self) -> Iterator[Metric]:
        """The metric names, without reading anything (registration does not scrape)."""
        return _describe(_STORE_ONLY_METRICS)


class ProducerCollector(Collector):
    """Counters and gauges of one ResilientProducer (and its store), read at scrape time.

    Args:
        producer: a ResilientProducer or an AsyncResilientProducer.
        name: value of the ``producer`` label, to tell several producers of a process apart.
    """

    def __init__(self, producer: Any, *, name: str = "default") -> None:
        self.producer = _as_sync(producer)
        self.labels = {"producer": name}
        self._rate_lock = threading.Lock()  # scrape time only: concurrent scrapes share the rate state
        self._last: tuple[float, int] | None = None

    def collect(self) -> Iterator[Metric]:
        p = self.producer
        st = p.stats()
        now = time.time()
        names, values = list(self.labels), list(self.labels.values())

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        yield counter("outbox_produced", "Messages accepted by produce().", st["produced"])
        delivered = CounterMetricFamily(
            "outbox_delivered", "Messages delivered to Kafka, by path (first_try or outbox).", labels=[*names, "path"]
        )
        delivered.add_metric([*values, "first_try"], st["delivered_first_try"])
        delivered.add_metric([*values, "outbox"], st["delivered_from_outbox"])
        yield delivered
        yield counter("outbox_outboxed", "Messages this process wrote to the outbox to retry later.", st["outboxed"])
        yield counter("outbox_retried", "Re-sends by this process's drain workers that failed again.", st["retried"])
        yield counter("outbox_dead_lettered", "Messages this process dead-lettered.", st["dead_this_process"])
        yield counter("outbox_failed_no_retry", "enable_retry=False messages that failed.", st["failed_no_retry"])
        yield counter(
            "outbox_queue_full_waits", "produce() calls that waited for room in librdkafka's full queue.",
            st["queue_full_waits"],
        )
        yield gauge("outbox_in_memory_messages", "Messages in librdkafka's queue.", st["in_memory"])
        yield gauge(
            "outbox_unsaved_messages",
            "Accepted messages neither committed to the outbox nor handed to librdkafka yet.",
            st["unsaved"],
        )
        state = StateSetMetricFamily("outbox_circuit_state", "Circuit breaker state.", labels=names)
        state.add_metric(values, {s.value: st["circuit"] == s.value for s in CircuitState})
        yield state
        yield gauge(
            "outbox_drain_rate_messages_per_second",
            "Messages delivered from the outbox per second since the previous scrape.",
            self._drain_rate(now, st["delivered_from_outbox"]),
        )
        buckets, total = p.writer.commit_seconds.cumulative()
        hist = HistogramMetricFamily(
            "outbox_commit_seconds", "Duration of the outbox writer's group commits.", labels=names
        )
        hist.add_metric(values, buckets, total)
        yield hist
        if isinstance(p.drainer, Drainer):  # drain_in="process": the claims are the child's
            buckets, total = p.drainer.claim_seconds()
            claims = HistogramMetricFamily(
                "outbox_drain_claim_seconds", "Duration of the drain workers' claims in the outbox.", labels=names
            )
            claims.add_metric(values, buckets, total)
            yield claims
        yield from _store_metrics(p.store.stats(now=now), now, self.labels)

    def _drain_rate(self, now: float, drained: int) -> float:
        with self._rate_lock:
            last, self._last = self._last, (now, drained)
        if last is None:  # first scrape: the drain workers' average since they started
            return self.producer.drainer.result.rate
        dt = now - last[0]
        return (drained - last[1]) / dt if dt > 0 else 0.0

    def describe(self) -> Iterator[Metric]:
        """The metric names, without reading anything (registration does not scrape)."""
        return _describe(_PRODUCER_METRICS)


_CONSUMER_METRICS: tuple[tuple[str, str], ...] = (
    ("outbox_consumer_handled", "counter"),
    ("outbox_consumer_failed", "counter"),
    ("outbox_consumer_retried", "counter"),
    ("outbox_consumer_dead_letters", "counter"),
    ("outbox_consumer_ignored", "counter"),
    ("outbox_consumer_paused_partitions", "gauge"),
    ("outbox_consumer_waiting_hops", "gauge"),
    ("outbox_consumer_hops_pending", "gauge"),
    ("outbox_consumer_circuit_state", "stateset"),
    ("outbox_consumer_circuit_opened", "counter"),
)


def _as_sync_consumer(consumer: Any) -> ResilientConsumer:
    """The ResilientConsumer behind an AsyncResilientConsumer (or the consumer itself)."""
    inner = getattr(consumer, "consumer", consumer)
    if not isinstance(inner, ResilientConsumer):
        raise TypeError(f"expected a ResilientConsumer or AsyncResilientConsumer, not {type(consumer).__name__}")
    return inner


class ConsumerCollector(Collector):
    """Counters and gauges of one ResilientConsumer, read at scrape time from its ``stats()``.

    The consumer's loop thread increments plain ints as it handles messages; a scrape reads them
    (one ``stats()``, whose hop-producer part is a store query). Nothing is added per message.

    Args:
        consumer: a ResilientConsumer or an AsyncResilientConsumer.
        name: value of the ``consumer`` label (the group is a label too).
    """

    def __init__(self, consumer: Any, *, name: str = "default") -> None:
        self.consumer = _as_sync_consumer(consumer)
        self.labels = {"consumer": name, "group": self.consumer.group}

    def collect(self) -> Iterator[Metric]:
        st = self.consumer.stats()
        names, values = list(self.labels), list(self.labels.values())

        def one(family: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, doc: str, v: float) -> Metric:
            m = family(name, doc, labels=names)
            m.add_metric(values, v)
            return m

        yield one(CounterMetricFamily, "outbox_consumer_handled", "Messages the handler handled.", st["handled"])
        yield one(CounterMetricFamily, "outbox_consumer_failed", "Handler (or deserializer) failures.", st["failed"])
        retried = CounterMetricFamily(
            "outbox_consumer_retried", "Failed messages sent to a retry tier, by tier.", labels=[*names, "tier"]
        )
        for tier, n in enumerate(st["retried_by_tier"], start=1):
            retried.add_metric([*values, str(tier)], n)
        yield retried
        yield one(CounterMetricFamily, "outbox_consumer_dead_letters", "Messages dead-lettered.", st["dead"])
        yield one(CounterMetricFamily, "outbox_consumer_ignored", "Failed messages skipped (Ignore).", st["ignored"])
        yield one(
            GaugeMetricFamily, "outbox_consumer_paused_partitions",
            "Partitions paused now (a tier head not yet due, an in-place retry, an open circuit).", st["held"],
        )
        yield one(
            GaugeMetricFamily, "outbox_consumer_waiting_hops",
            "Retry hops and dead letters not yet durable (their offsets are not committed).", st["waiting_hops"],
        )
        pending = st["producer"]["pending"]
        if pending is not None:  # None: the outbox could not be read at this scrape
            yield one(
                GaugeMetricFamily, "outbox_consumer_hops_pending",
                "Retry hops waiting in the consumer's outbox for Kafka to take them.", pending,
            )
        state = StateSetMetricFamily(
            "outbox_consumer_circuit_state", "Main-topic circuit state (all false: no circuit).", labels=names
        )
        state.add_metric(values, {s.value: st["circuit"] == s.value for s in CircuitState})
        yield state
        yield one(
            CounterMetricFamily, "outbox_consumer_circuit_opened", "Times the main-topic circuit opened.",
            st["circuit_opened"],
        )

    def describe(self) -> Iterator[Metric]:
        """The metric names, without reading anything (registration does not scrape)."""
        return _describe(_CONSUMER_METRICS)


def register_consumer(
    consumer: Any, *, name: str = "default", registry: CollectorRegistry = REGISTRY
) -> ConsumerCollector:
    """Register a :class:`ConsumerCollector` for `consumer` in `registry` (default: the global one)."""
    collector = ConsumerCollector(consumer, name=name)
    registry.register(collector)
    return collector


def register_producer(
    producer: Any, *, name: str = "default", registry: CollectorRegistry = REGISTRY
) -> ProducerCollector:
    """Register a :class:`ProducerCollector` for `producer` in `registry` (default: the global one)."""
    collector = ProducerCollector(producer, name=name)
    registry.register(collector)
    return collector


def register_store(
    store: Outbox, *, labels: Mapping[str, str] | None = None, registry: CollectorRegistry = REGISTRY
) -> StoreCollector:
    """Register a :class:`StoreCollector` for `store` in `registry` (default: the global one)."""
    collector = StoreCollector(store, labels)
    registry.register(collector)
    return collector
