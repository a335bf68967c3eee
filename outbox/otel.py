"""Optional OpenTelemetry spans for kafka-outbox (``pip install 'kafka-outbox[otel]'``).

    from outbox.otel import instrument
    instrument(producer)       # a ResilientProducer, an AsyncResilientProducer or a Drainer
    instrument(consumer)       # a ResilientConsumer or an AsyncResilientConsumer

Trace context travels in the message's own headers (W3C ``traceparent`` / ``tracestate``). The
outbox stores headers as opaque bytes and every re-send sends them back unchanged, so a
consumer links to the producing trace whether the message went straight to Kafka or spent an
hour in the outbox. That needs no instrumentation at all; this module adds spans:

* ``send {topic}`` (PRODUCER): around each ``produce()`` call, in the caller's context. If the
  message has no ``traceparent`` header yet, this span's context is injected into its headers
  (appended after the application's own); one the application set is kept as it is and linked.
* ``outbox spill {topic}`` (INTERNAL): a message was committed to the outbox instead of being
  sent (circuit open, queue full, failed send). Linked to the message's context.
* ``outbox deliver {topic}`` (PRODUCER): a message delivered *from the outbox*; it starts when
  the message was first stored and ends at the acknowledgement, so its length is the time the
  outbox held it. Linked to the message's context.
* ``outbox dead-letter {topic}`` (INTERNAL, status ERROR): the message was dead-lettered.
* ``process {topic}`` (CONSUMER): around each call of a consumer's handler, linked to the
  context in the message's headers (the producing trace: retry hops and dead letters keep the
  ``traceparent`` / ``tracestate`` headers byte for byte). It is the current span while the
  handler runs, so the handler's own spans are its children; status ERROR when it raises.

Without a configured SDK (opentelemetry-api alone) the spans are non-recording and cost little.
The outbox spans come from a listener of the producer's events (`outbox.events`:
``ResilientProducer.subscribe``, ``Drainer.subscribe``); nothing of the producer is replaced.
The ``send`` spans come from a produce hook (``ResilientProducer.hook_produce``): set by
default, it costs produce() nothing while unset (``spans_on_produce=False`` skips it for
throughput-critical producers: the outbox spans still link to the context the application put
in the headers). An `AsyncResilientProducer`'s ``send`` span is opened on its event loop, by a
wrapper of its ``produce``.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

try:
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer, TracerProvider
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError("outbox.otel needs opentelemetry-api: pip install 'kafka-outbox[otel]'") from exc

from confluent_kafka import Message

from outbox.consumer import AsyncResilientConsumer, ResilientConsumer
from outbox.consumer import headers as consumer_headers
from outbox.drain.workers import Drainer
from outbox.events import Committed, Drained, Listener
from outbox.headers import ID_HEADER
from outbox.producer.aio import AsyncResilientProducer
from outbox.producer.resilient import HookedHeaders, ResilientProducer
from outbox.records import DeadLetter

__all__ = ["TRACE_HEADERS", "instrument", "message_context"]

#: The W3C trace-context headers; kept byte for byte through the outbox and every re-send.
TRACE_HEADERS = ("traceparent", "tracestate")
_SCOPE = "kafka-outbox"
_SEND = {"messaging.operation.type": "send"}


def _getter_headers(headers: Iterable[tuple[str, bytes | str | None]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers:
        if name in TRACE_HEADERS and value is not None and name not in out:
            out[name] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return out


def message_context(headers: Iterable[tuple[str, bytes | str | None]] | None) -> Context | None:
    """The trace context carried in a message's headers (None if it carries none)."""
    carrier = _getter_headers(headers or ())
    if "traceparent" not in carrier:
        return None
    return propagate.extract(carrier)


def _links(headers: Iterable[tuple[str, bytes | str | None]] | None) -> list[Link]:
    ctx = message_context(headers)
    if ctx is None:
        return []
    span_ctx = trace.get_current_span(ctx).get_span_context()
    return [Link(span_ctx)] if span_ctx.is_valid else []


def _attributes(topic: str, msg_id: str | None, **extra: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {"messaging.system": "kafka", "messaging.destination.name": topic}
    if msg_id:
        attrs["messaging.message.id"] = msg_id
    attrs.update({k: v for k, v in extra.items() if v is not None})
    return attrs


def _with_trace_headers(
    headers: Sequence[tuple[str, Any]] | Mapping[str, Any] | None,
) -> tuple[list[tuple[str, Any]], list[Link]]:
    """The application's headers plus the current context's traceparent/tracestate, unless it
    set its own (then those stay as they are and the span links to them)."""
    items: list[tuple[str, Any]] = list(headers.items() if isinstance(headers, Mapping) else headers or [])
    if any(name == "traceparent" for name, _ in items if isinstance(name, str)):
        return items, _links(items)
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    items.extend((name, carrier[name].encode()) for name in TRACE_HEADERS if name in carrier)
    return items, []


def instrument(
    target: ResilientProducer | AsyncResilientProducer | Drainer | ResilientConsumer | AsyncResilientConsumer,
    *,
    tracer_provider: TracerProvider | None = None,
    spans_on_produce: bool = True,
) -> None:
    """Add spans to a producer (sync or async), a standalone Drainer or a consumer (sync or async).

    Args:
        target: what to instrument. For an AsyncResilientProducer the ``send`` span is opened
            on the event loop, in the awaiting task's context. For a consumer, its handler is
            wrapped in a ``process`` span (for an AsyncResilientConsumer, on the loop, around
            the coroutine).
        tracer_provider: default: the global one (``opentelemetry.trace.set_tracer_provider``).
        spans_on_produce: open a ``send`` span and inject its context in every produce() call.

    Raises:
        TypeError: `target` is none of these.
    """
    tracer = trace.get_tracer(_SCOPE, tracer_provider=tracer_provider)
    if isinstance(target, (ResilientConsumer, AsyncResilientConsumer)):
        _instrument_consumer(target, tracer)
        return
    if isinstance(target, Drainer):
        _instrument_drainer(target, tracer)
        return
    if isinstance(target, AsyncResilientProducer):
        _instrument_producer(target.producer, tracer, spans_on_produce=False)
        if spans_on_produce and _first_time(target):
            target.hook_produce(functools.partial(_produce_async, tracer))
        return
    if isinstance(target, ResilientProducer):
        _instrument_producer(target, tracer, spans_on_produce=spans_on_produce)
        return
    raise TypeError(
        f"cannot instrument {type(target).__name__}: expected a ResilientProducer, an AsyncResilientProducer, "
        "a Drainer, a ResilientConsumer or an AsyncResilientConsumer"
    )


#: What is instrumented already: instrumenting twice would double every span.
_INSTRUMENTED: weakref.WeakSet[Any] = weakref.WeakSet()


def _first_time(target: object) -> bool:
    if target in _INSTRUMENTED:
        return False
    _INSTRUMENTED.add(target)
    return True


def _instrument_producer(p: ResilientProducer, tracer: Tracer, *, spans_on_produce: bool) -> None:
    if not _first_time(p):
        return
    # The producer's events cover its drain (threads or process) and its first sends' dead letters.
    p.subscribe(_Spans(tracer))
    if spans_on_produce:
        p.hook_produce(functools.partial(_produce, tracer))


def _instrument_drainer(d: Drainer, tracer: Tracer) -> None:
    if _first_time(d):
        d.subscribe(_Spans(tracer))


def _send_span(tracer: Tracer, topic: str) -> Any:
    return tracer.start_as_current_span(
        f"send {topic}", kind=SpanKind.PRODUCER, attributes=_attributes(topic, None, **_SEND)
    )


def _linked_headers(
    span: Span, headers: Sequence[tuple[str, Any]] | Mapping[str, Any] | None
) -> list[tuple[str, Any]]:
    """The message's headers with the trace context written in; the span linked to the message's own context."""
    hdrs, links = _with_trace_headers(headers)
    for link in links:
        span.add_link(link.context)
    return hdrs


def _produce(tracer: Tracer, produce: Callable[..., str], *call: Any) -> str:
    """The produce hook (`ResilientProducer.hook_produce`): the call in a ``send`` span.

    `call`: produce()'s arguments as the hook is given them, in their order (`hook_produce`).
    """
    topic, value, key, partition, on_delivery, timestamp, headers, callback, enable_retry, transaction = call
    with _send_span(tracer, topic) as span:
        hdrs = HookedHeaders(_linked_headers(span, headers))
        msg_id = produce(
            topic, value, key, partition, on_delivery, timestamp, hdrs,
            callback=callback, enable_retry=enable_retry, transaction=transaction,
        )
        span.set_attribute("messaging.message.id", msg_id)
        return msg_id


async def _produce_async(tracer: Tracer, produce: Callable[..., Awaitable[str]], *call: Any) -> str:
    """AsyncResilientProducer's produce hook: the span opened on the loop, so its parent is the
    awaiting task's context. `call` as `_produce`'s."""
    topic, value, key, partition, on_delivery, timestamp, headers, callback, enable_retry, transaction = call
    with _send_span(tracer, topic) as span:
        hdrs = HookedHeaders(_linked_headers(span, headers))
        msg_id = await produce(
            topic, value, key, partition, on_delivery, timestamp, hdrs,
            callback=callback, enable_retry=enable_retry, transaction=transaction,
        )
        span.set_attribute("messaging.message.id", msg_id)
        return msg_id


class _Spans(Listener):
    """The outbox spans, from a producer's (or a drainer's) events."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def committed(self, batch: Committed) -> None:
        for msg, leased in zip(batch.new, batch.leased, strict=True):
            if leased:
                continue  # write-ahead rows sent at once: part of the normal path, not a spill
            span = self._tracer.start_span(
                f"outbox spill {msg.topic}",
                kind=SpanKind.INTERNAL,
                links=_links(msg.headers),
                attributes=_attributes(msg.topic, msg.msg_id, **{"outbox.reason": msg.last_error}),
            )
            span.end()

    def delivered(self, rows: Sequence[Drained]) -> None:
        end = time.time_ns()
        for row in rows:
            span = self._tracer.start_span(
                f"outbox deliver {row.topic}",
                kind=SpanKind.PRODUCER,
                links=_links(row.headers),
                start_time=int(row.created_at * 1e9),
                attributes=_attributes(row.topic, row.msg_id, **{"outbox.attempts": row.attempts}),
            )
            span.end(end_time=end)

    def dead(self, letter: DeadLetter) -> None:
        span = self._tracer.start_span(
            f"outbox dead-letter {letter.topic}",
            kind=SpanKind.INTERNAL,
            links=_links(letter.headers),
            attributes=_attributes(letter.topic, letter.msg_id, **{"outbox.attempts": letter.attempts}),
        )
        span.set_status(Status(StatusCode.ERROR, letter.last_error or "dead-lettered"))
        span.end()


def _instrument_consumer(c: ResilientConsumer | AsyncResilientConsumer, tracer: Tracer) -> None:
    if not _first_time(c):
        return
    if isinstance(c, AsyncResilientConsumer):

        def wrap_async(handler: Callable[[Message], Awaitable[Any]]) -> Callable[[Message], Awaitable[Any]]:
            async def traced(msg: Message) -> Any:
                # On the loop, in the task that runs this message: the handler's spans are children.
                with _process_span(tracer, msg):
                    return await handler(msg)

            return traced

        c.wrap_handler(wrap_async)
        return

    def wrap(handler: Callable[..., Any]) -> Callable[..., Any]:
        def traced(msg: Message, *tx: Any) -> Any:  # tx: a transactional handler's (dedup=True)
            with _process_span(tracer, msg):
                return handler(msg, *tx)

        return traced

    c.wrap_handler(wrap)


def _process_span(tracer: Tracer, msg: Message) -> Any:
    """A CONSUMER span for one handling of `msg`; records the handler's exception and sets ERROR."""
    headers = consumer_headers.headers_of(msg)
    topic = msg.topic() or ""
    attempt = consumer_headers.find_text(headers, consumer_headers.ATTEMPT)
    msg_id = consumer_headers.find_text(headers, ID_HEADER)
    return tracer.start_as_current_span(
        f"process {topic}",
        kind=SpanKind.CONSUMER,
        links=_links(headers),
        attributes=_attributes(
            topic,
            msg_id,
            **{
                "messaging.operation.type": "process",
                "messaging.destination.partition.id": str(msg.partition()),
                "messaging.kafka.offset": msg.offset(),
                # Attempts made before this one (0 on the main topic), from the hop's header.
                "outbox.consumer.attempt": int(attempt) if attempt else 0,
            },
        ),
    )
