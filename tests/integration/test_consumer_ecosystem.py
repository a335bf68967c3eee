"""The consumer side in the Python ecosystem, against the real cluster: an asyncio handler
(AsyncResilientConsumer), Prometheus metrics scraped over HTTP, OpenTelemetry process spans."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Message
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, start_http_server

from outbox import AsyncResilientConsumer, DeadLetter, MainTopicCircuit, ResilientConsumer, RetryTopics
from outbox.consumer import headers as H
from outbox.metrics import register_consumer
from outbox.otel import instrument

from ..group_protocols import group_settings
from .test_consumer import committed, group_name, header, produce, running, wait_until
from .test_metrics_kafka import Samples, scrape
from .test_otel import TRACEPARENT, TRACESTATE, linked_traceparents, tracing


def k(name: str, group: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """A sample's key in `scrape()`'s result: the consumer "orders-worker" of `group`, plus `labels`."""
    return name, tuple(sorted({"consumer": "orders-worker", "group": group, **labels}.items()))


# -- asyncio -----------------------------------------------------------------------------------


def test_async_handler_fails_then_succeeds_through_a_tier_and_a_poison_reaches_the_dlq(
    kafka_bootstrap: str, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]], tmp_path: Path,
    group_protocol: str,
) -> None:
    topic = make_topic(partitions=2)
    group = group_name()
    tier1 = f"{topic}.{group}.retry-1"
    values = [b"m%03d" % i for i in range(40)]
    flaky = {b"m007", b"m021", b"m033"}  # fail on the main topic, succeed on retry-1
    produce(kafka_bootstrap, topic, [*values, b"poison"])
    successes: list[tuple[bytes, str]] = []
    calls_off_the_loop: list[int] = []
    dead: list[DeadLetter] = []
    registry = CollectorRegistry()

    async def app() -> dict[str, Any]:
        loop_thread = threading.get_ident()

        async def handle(msg: Message) -> None:
            if threading.get_ident() != loop_thread:
                calls_off_the_loop.append(threading.get_ident())
            await asyncio.sleep(0.001)  # a real await: the coroutine is suspended mid-message
            v, t = msg.value() or b"", msg.topic() or ""
            if v == b"poison":
                raise ValueError("cannot parse the order")
            if v in flaky and t == topic:
                raise ConnectionError("database unavailable")
            successes.append((v, t))

        consumer = await AsyncResilientConsumer.create(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
            topics=[topic],
            handler=handle,
            strategy=RetryTopics(delays=[0.5]),
            outbox=f"sqlite:///{tmp_path / 'c.db'}",
            on_dead_letter=dead.append,
        )
        register_consumer(consumer, name="orders-worker", registry=registry)
        async with consumer:
            task = asyncio.create_task(consumer.run())
            for _ in range(900):  # up to 90 s
                if len(successes) >= len(values) and dead and (await consumer.stats())["waiting_hops"] == 0:
                    break
                assert not task.done(), f"run() returned early: {task.exception() if not task.cancelled() else ''}"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # a duplicate would show up now
            consumer.stop()
            await asyncio.wait_for(task, 30)
            # The collector reads an AsyncResilientConsumer too (a scrape runs on the server's thread).
            scraped.update(await asyncio.get_running_loop().run_in_executor(None, _collect, registry))
            return await consumer.stats()

    scraped: Samples = {}
    stats = asyncio.run(app())
    assert not calls_off_the_loop, "the async handler ran off the application's event loop"
    assert sorted(v for v, _ in successes) == values, "every message handled exactly once"
    assert {v for v, t in successes if t == tier1} == flaky
    assert stats["handled"] == 40 and stats["failed"] == 5 and stats["dead"] == 1
    assert stats["retried"] == 4 and stats["retried_by_tier"] == [4]  # 3 flaky + the poison's one retry
    dlq = consume_all(f"{topic}.{group}.dlq", 1)
    assert [m.value() for m in dlq] == [b"poison"]
    assert header(dlq[0], H.ATTEMPT) == "2" and header(dlq[0], H.ERROR_CLASS) == "builtins.ValueError"
    assert len(dead) == 1 and dead[0].topic == topic
    # Committed past everything, on the main topic and the tier (the consumer is closed).
    assert sum(committed(kafka_bootstrap, group, topic, 2)) == 41
    assert sum(committed(kafka_bootstrap, group, tier1, 2)) == 4
    samples = {(name, dict(labels).get("tier")): v for (name, labels), v in scraped.items()}
    assert samples[("outbox_consumer_handled_total", None)] == 40
    assert samples[("outbox_consumer_retried_total", "1")] == 4
    assert samples[("outbox_consumer_dead_letters_total", None)] == 1


def _collect(registry: CollectorRegistry) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value for fam in registry.collect() for s in fam.samples
    }


def test_async_run_cancelled_finishes_the_message_in_hand_and_commits_it(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=1)
    group = group_name()
    produce(kafka_bootstrap, topic, [b"a%02d" % i for i in range(20)], partition=0)
    started: list[bytes] = []
    finished: list[bytes] = []

    async def app() -> None:
        gate = asyncio.Event()

        async def handle(msg: Message) -> None:
            started.append(msg.value() or b"")
            if len(started) == 5:
                gate.set()
                await asyncio.sleep(1.0)  # in hand when run() is cancelled
            finished.append(msg.value() or b"")

        async with await AsyncResilientConsumer.create(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
            # Batches of 2: the loop stops after the batch in hand, which must end well before the 20th.
            topics=[topic], handler=handle, outbox=f"sqlite:///{tmp_path / 'c.db'}", batch_size=2,
        ) as consumer:
            task = asyncio.create_task(consumer.run())
            await asyncio.wait_for(gate.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(app())
    assert started == finished, "every handler that began ran to its end (none abandoned mid-way)"
    assert finished == [b"a%02d" % i for i in range(len(finished))] and 5 <= len(finished) < 20
    assert committed(kafka_bootstrap, group, topic, 1) == [len(finished)], "handled ones committed, no other"


# -- Prometheus ----------------------------------------------------------------------------------


def test_consumer_metrics_scraped_over_http_during_a_run_with_failures(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    topic = make_topic(partitions=2)
    group = group_name()
    values = [b"v%03d" % i for i in range(200)]
    twice = {b"v010", b"v020", b"v030", b"v040", b"v050"}  # fail on the main topic and retry-1
    poison = {b"v100", b"v150"}  # fail everywhere: dead after retry-2
    produce(kafka_bootstrap, topic, values)
    handled: list[bytes] = []
    tier_of = {topic: 0, f"{topic}.{group}.retry-1": 1, f"{topic}.{group}.retry-2": 2}

    def handle(msg: Message) -> None:
        v = msg.value() or b""
        if v in poison or (v in twice and tier_of[msg.topic() or ""] < 2):
            raise TimeoutError("downstream timed out")
        handled.append(v)

    registry = CollectorRegistry()
    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic],
        handler=handle,
        # Delays long enough that a scrape sees partitions paused at a tier head that is not due.
        strategy=RetryTopics(delays=[2.0, 2.0]),
        circuit=MainTopicCircuit(consecutive_failures=50),  # never opens here: the state set reads closed
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    register_consumer(consumer, name="orders-worker", registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    during: list[Samples] = []
    try:
        with running(consumer) as c:
            # During the run: every first failure hopped to retry-1, some tier partition paused.
            def mid_run() -> bool:
                s = scrape(url)
                if s.get(k("outbox_consumer_retried_total", group, tier="1"), 0) == 7 and s.get(
                    k("outbox_consumer_paused_partitions", group), 0
                ) >= 1:
                    during.append(s)
                    return True
                return False

            wait_until(mid_run, 60, "a scrape shows 7 hops to retry-1 and a paused tier partition")
            wait_until(
                lambda: len(handled) == 198 and c.stats()["dead"] == 2 and c.stats()["waiting_hops"] == 0,
                90, "198 handled, 2 dead, every hop durable",
            )
            final = scrape(url)
            stats = c.stats()
    finally:
        server.shutdown()
        thread.join(10)
    mid = during[0]
    assert mid[k("outbox_consumer_failed_total", group)] >= 7
    assert mid[k("outbox_consumer_circuit_state", group, outbox_consumer_circuit_state="closed")] == 1
    assert sorted(handled) == sorted(values[i] for i in range(200) if values[i] not in poison)
    assert final[k("outbox_consumer_handled_total", group)] == 198 == stats["handled"]
    assert final[k("outbox_consumer_failed_total", group)] == 7 + 7 + 2 == stats["failed"]
    assert final[k("outbox_consumer_retried_total", group, tier="1")] == 7
    assert final[k("outbox_consumer_retried_total", group, tier="2")] == 7
    assert final[k("outbox_consumer_dead_letters_total", group)] == 2
    assert final[k("outbox_consumer_ignored_total", group)] == 0
    assert final[k("outbox_consumer_waiting_hops", group)] == 0
    assert final[k("outbox_consumer_hops_pending", group)] == 0
    assert final[k("outbox_consumer_circuit_opened_total", group)] == 0
    for state in ("open", "half-open"):
        assert final[k("outbox_consumer_circuit_state", group, outbox_consumer_circuit_state=state)] == 0


# -- OpenTelemetry -------------------------------------------------------------------------------


def test_process_spans_link_to_the_message_context_and_trace_headers_survive_every_hop(
    kafka_bootstrap: str, make_topic: Callable[..., str], consume_all: Callable[..., list[Any]], tmp_path: Path,
    group_protocol: str,
) -> None:
    from confluent_kafka import Producer

    topic = make_topic(partitions=1)
    group = group_name()
    p = Producer({"bootstrap.servers": kafka_bootstrap, "acks": "all"})
    for v in (b"ok", b"flaky", b"poison"):
        p.produce(topic, v, key=v, headers=[("traceparent", TRACEPARENT), ("tracestate", TRACESTATE), ("app", b"x")])
    assert p.flush(30) == 0
    provider, exporter = tracing()
    seen: list[tuple[str, bytes, list[tuple[str, bytes | None]]]] = []
    inner_parents: list[int] = []

    def handle(msg: Message) -> None:
        v = msg.value() or b""
        seen.append((msg.topic() or "", v, list(H.headers_of(msg))))
        with provider.get_tracer("app").start_as_current_span("save order") as span:
            parent = span.parent  # type: ignore[attr-defined]  # the SDK's span (the API's has no parent)
            inner_parents.append(parent.span_id if parent is not None else 0)
        if v == b"poison" or (v == b"flaky" and msg.topic() == topic):
            raise ConnectionError("try later")

    consumer = ResilientConsumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, **group_settings(group_protocol)},
        topics=[topic], handler=handle, strategy=RetryTopics(delays=[0.3, 0.3]),
        outbox=f"sqlite:///{tmp_path / 'c.db'}",
    )
    instrument(consumer, tracer_provider=provider)
    with running(consumer) as c:
        wait_until(lambda: c.stats()["dead"] == 1 and c.stats()["waiting_hops"] == 0, 60, "the poison is dead")
    # The trace headers, byte for byte and in their place, on every hop and in the dead letter.
    assert len(seen) == 1 + 2 + 3  # ok; flaky twice; poison on main, retry-1, retry-2
    for _, _, hs in seen:
        assert hs[:3] == [("traceparent", TRACEPARENT), ("tracestate", TRACESTATE), ("app", b"x")]
    dlq = consume_all(f"{topic}.{group}.dlq", 1)
    assert (dlq[0].headers() or [])[:3] == [("traceparent", TRACEPARENT), ("tracestate", TRACESTATE), ("app", b"x")]
    # One CONSUMER span per handling, linked to the producer's context, parent of the handler's spans.
    spans: list[ReadableSpan] = [s for s in exporter.get_finished_spans() if s.name.startswith("process ")]
    assert len(spans) == 6
    assert all(s.kind is SpanKind.CONSUMER and linked_traceparents(s) == {TRACEPARENT} for s in spans)
    ids = [s.context.span_id for s in spans if s.context is not None]
    assert sorted(inner_parents) == sorted(ids)
    by = {(s.name, s.attributes["outbox.consumer.attempt"] if s.attributes else -1): s for s in spans}
    tier2 = f"process {topic}.{group}.retry-2"
    assert by[(tier2, 2)].status.status_code is StatusCode.ERROR  # the poison's last attempt
    errors = [s for s in spans if s.status.status_code is StatusCode.ERROR]
    assert len(errors) == 4 and all(s.events and s.events[0].name == "exception" for s in errors)
    assert all(s.attributes and s.attributes["messaging.message.id"] for s in spans if "retry" in s.name)


def test_async_process_span_is_the_parent_of_the_coroutine_spans(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, group_protocol: str
) -> None:
    from confluent_kafka import Producer

    topic = make_topic(partitions=1)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "acks": "all"})
    for i in range(3):
        p.produce(topic, b"%d" % i, headers=[("traceparent", TRACEPARENT)])
    assert p.flush(30) == 0
    provider, exporter = tracing()
    tracer = provider.get_tracer("app")
    done: list[bytes] = []

    async def app() -> None:
        async def handle(msg: Message) -> None:
            with tracer.start_as_current_span("async work"):
                await asyncio.sleep(0.001)
            done.append(msg.value() or b"")

        async with await AsyncResilientConsumer.create(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group_name(), **group_settings(group_protocol)},
            topics=[topic], handler=handle, outbox=f"sqlite:///{tmp_path / 'c.db'}",
        ) as consumer:
            instrument(consumer, tracer_provider=provider)
            task = asyncio.create_task(consumer.run())
            for _ in range(600):
                if len(done) == 3:
                    break
                await asyncio.sleep(0.1)
            consumer.stop()
            await asyncio.wait_for(task, 30)

    asyncio.run(app())
    assert done == [b"0", b"1", b"2"]
    spans = exporter.get_finished_spans()
    process = {s.context.span_id: s for s in spans if s.name == f"process {topic}" and s.context is not None}
    work = [s for s in spans if s.name == "async work"]
    assert len(process) == 3 and len(work) == 3
    assert all(w.parent is not None and w.parent.span_id in process for w in work)
    assert all(linked_traceparents(s) == {TRACEPARENT} for s in process.values())
