"""Trace context through the outbox, and the optional spans, against the real 3-broker cluster.

Spans are recorded by opentelemetry-sdk's InMemorySpanExporter on a private TracerProvider.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from outbox import ID_HEADER, DeadLetter
from outbox.otel import instrument
from outbox.producer.aio import AsyncResilientProducer
from outbox.testing import KafkaCluster

from .delivery import header, read_topic
from .test_producer import FAST, make_producer, wait_until

# Tests without an outage: librdkafka's usual patience, so a loaded machine's slow acknowledgements
# do not send messages to the outbox (3 s time-outs did at load average 30).
STEADY = {**FAST, "message.timeout.ms": 30000}
# A foreign trace context, as an upstream service would have set it (tracestate with two vendors).
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def traceparent_of(span: ReadableSpan) -> bytes:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}".encode()


def linked_traceparents(span: ReadableSpan) -> set[bytes]:
    """The links' contexts as traceparent values (trace-flags as the propagator writes them)."""
    return {
        f"00-{ln.context.trace_id:032x}-{ln.context.span_id:016x}-{ln.context.trace_flags:02x}".encode()
        for ln in span.links
    }


def test_trace_headers_survive_the_outbox_and_every_resend_and_spans_link_to_them(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = make_topic()
    bs = chaos_cluster.bootstrap_servers
    provider, exporter = tracing()
    tracer = provider.get_tracer("app")
    p = make_producer(bs, tmp_path / "o.db")
    instrument(p, tracer_provider=provider)
    foreign: list[str] = []
    injected: list[str] = []
    try:
        p.produce(topic, b"warm-up")
        wait_until(lambda: p.stats()["delivered"] == 1, 60, "the warm-up message is delivered")
        chaos_cluster.stop_all()
        with tracer.start_as_current_span("handle request"):
            for i in range(30):
                # Messages that carry an upstream context (kept byte for byte) ...
                foreign.append(
                    p.produce(topic, b"f%d" % i, headers=[("a", b"1"), ("traceparent", TRACEPARENT),
                                                          ("tracestate", TRACESTATE), ("z", b"2")])
                )
                # ... and messages that get the send span's context injected.
                injected.append(p.produce(topic, b"i%d" % i, headers={"a": b"1"}))
        wait_until(lambda: p.stats()["pending"] >= 60, 60, "the outage's messages are in the outbox")
        # The drain workers send nothing into a cluster known to be down (the circuit is open and
        # no broker answers them): the stored messages are re-sent once it is back.
        chaos_cluster.start_all()
        wait_until(lambda: p.stats()["pending"] == 0, 120, "the outbox is drained")
    finally:
        p.close()
    got = read_topic(bs, topic, 61)
    assert got.unique == 61
    spans = exporter.get_finished_spans()
    sends = {s.attributes["messaging.message.id"]: s for s in spans if s.name == f"send {topic}"}
    assert set(sends) >= set(foreign) | set(injected)
    assert all(s.kind is SpanKind.PRODUCER for s in sends.values())
    parent = next(s for s in spans if s.name == "handle request")
    assert {s.parent.span_id for mid, s in sends.items() if mid in foreign + injected} == {
        parent.get_span_context().span_id
    }
    resent_attempts = []
    for mid in foreign:
        [msg] = got.by_id[mid][:1]
        hdrs = msg.headers()
        assert hdrs[:4] == [("a", b"1"), ("traceparent", TRACEPARENT), ("tracestate", TRACESTATE), ("z", b"2")]
        assert [h for h in hdrs if h[0] in ("traceparent", "tracestate")] == [
            ("traceparent", TRACEPARENT), ("tracestate", TRACESTATE)
        ], "no second trace header was added"
        assert linked_traceparents(sends[mid]) == {TRACEPARENT}
        resent_attempts.append(int(header(msg, "outbox-attempt") or b"0"))
    for mid in injected:
        [msg] = got.by_id[mid][:1]
        assert msg.headers()[0] == ("a", b"1")
        assert header(msg, "traceparent") == traceparent_of(sends[mid]), "the send span's context travels"
        resent_attempts.append(int(header(msg, "outbox-attempt") or b"0"))
    # Sent first (or spilled), delivered from the outbox: the delivering re-send carries
    # outbox-attempt (the outage itself counted no attempt).
    assert min(resent_attempts) >= 1, f"each message was delivered by a re-send: {resent_attempts}"

    spills = [s for s in spans if s.name == f"outbox spill {topic}"]
    delivers = {s.attributes["messaging.message.id"]: s for s in spans if s.name == f"outbox deliver {topic}"}
    # >=: the warm-up message may have gone through the outbox too (a just-restarted cluster).
    assert {s.attributes["messaging.message.id"] for s in spills} >= set(foreign) | set(injected)
    assert set(delivers) >= set(foreign) | set(injected)
    for mid in foreign:
        assert linked_traceparents(delivers[mid]) == {TRACEPARENT}
    for mid in injected:
        assert linked_traceparents(delivers[mid]) == {traceparent_of(sends[mid])}
        d = delivers[mid]
        assert d.end_time is not None and d.start_time is not None and d.end_time > d.start_time
    print(
        f"\notel: {len(sends)} send, {len(spills)} spill, {len(delivers)} deliver spans; "
        f"attempts before delivery {min(resent_attempts)}..{max(resent_attempts)}"
    )


def test_dead_letter_span_and_async_send_spans(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = make_topic(config={"max.message.bytes": "2000"})
    provider, exporter = tracing()
    tracer = provider.get_tracer("app")
    dead: list[DeadLetter] = []

    async def app() -> tuple[str, str]:
        ap = AsyncResilientProducer(
            {"bootstrap.servers": kafka_bootstrap, **STEADY}, outbox=f"sqlite:///{tmp_path / 'o.db'}",
            on_dead_letter=dead.append, drain_poll_interval=0.2,
        )
        instrument(ap, tracer_provider=provider)
        async with ap:
            with tracer.start_as_current_span("task"):
                big = await ap.produce(topic, b"x" * 10_000, headers=[("traceparent", TRACEPARENT)])
                small = await ap.produce(topic, b"small")
            assert await ap.flush(30) == 0
            deadline = time.monotonic() + 30
            while not dead and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        return big, small

    big, small = asyncio.run(app())
    assert [d.msg_id for d in dead] == [big], "the dead-letter callback still runs once"
    spans = exporter.get_finished_spans()
    task = next(s for s in spans if s.name == "task")
    sends = {s.attributes["messaging.message.id"]: s for s in spans if s.name == f"send {topic}"}
    assert set(sends) == {big, small}
    assert {s.parent.span_id for s in sends.values()} == {task.get_span_context().span_id}, "parent: the task"
    [dl] = [s for s in spans if s.name == f"outbox dead-letter {topic}"]
    assert dl.status.status_code is StatusCode.ERROR and "MSG_SIZE_TOO_LARGE" in (dl.status.description or "")
    assert dl.attributes["messaging.message.id"] == big and linked_traceparents(dl) == {TRACEPARENT}
    got = read_topic(kafka_bootstrap, topic, 1)
    [msg] = got.by_id[small]
    assert header(msg, "traceparent") == traceparent_of(sends[small])
    assert header(msg, ID_HEADER) == small.encode()
