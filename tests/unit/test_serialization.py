"""outbox.producer.serialization and outbox.otel's header handling: pure logic, no Kafka."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka.error import KeySerializationError, ValueSerializationError
from confluent_kafka.serialization import MessageField, SerializationContext, StringSerializer
from opentelemetry.sdk.trace import TracerProvider

from outbox.otel import _with_trace_headers, message_context
from outbox.producer.serialization import Serializers

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_no_serializers_means_no_work() -> None:
    assert Serializers.of(None, None) is None


def test_each_field_gets_its_context_and_the_shared_header_list() -> None:
    seen: list[tuple[str, MessageField, Any]] = []

    def key_ser(obj: Any, ctx: SerializationContext) -> bytes:
        seen.append((ctx.topic, ctx.field, ctx.headers))
        ctx.headers.append(("__key_schema_id", b"\x01"))  # what header_schema_id_serializer does
        return str(obj).encode()

    s = Serializers.of(key_ser, StringSerializer())
    assert s is not None
    value, key, headers = s("orders", "v", 7, {"a": b"1"})
    assert (value, key) == (b"v", b"7")
    assert headers == [("a", b"1"), ("__key_schema_id", b"\x01")]
    assert seen == [("orders", MessageField.KEY, headers)]


def test_none_passes_through_confluent_serializers() -> None:
    s = Serializers.of(StringSerializer(), StringSerializer())
    assert s is not None
    assert s("t", None, None, None) == (None, None, [])


def test_errors_name_the_field_and_keep_the_cause() -> None:
    def boom(obj: Any, ctx: SerializationContext) -> bytes:
        raise ValueError(f"no {obj}")

    with pytest.raises(KeySerializationError, match="no k") as kerr:
        Serializers(boom, None)("t", b"v", "k", None)
    assert isinstance(kerr.value.exception, ValueError)
    with pytest.raises(ValueSerializationError, match="no v"):
        Serializers(None, boom)("t", "v", b"k", None)
    with pytest.raises(TypeError, match="key_serializer must be callable"):
        Serializers("utf-8", None)  # type: ignore[arg-type]


def test_trace_headers_set_by_the_application_are_kept_and_linked() -> None:
    headers, links = _with_trace_headers([("a", b"1"), ("traceparent", TRACEPARENT)])
    assert headers == [("a", b"1"), ("traceparent", TRACEPARENT)]
    assert [f"{ln.context.trace_id:032x}" for ln in links] == ["4bf92f3577b34da6a3ce929d0e0e4736"]


def test_the_current_span_is_injected_after_the_application_headers() -> None:
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("request") as span:
        headers, links = _with_trace_headers({"a": b"1"})
    ctx = span.get_span_context()
    assert links == []
    assert headers[0] == ("a", b"1")
    assert headers[1] == ("traceparent", f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}".encode())
    assert message_context(headers) is not None


def test_without_a_recording_span_headers_are_unchanged() -> None:
    assert _with_trace_headers(None) == ([], [])
    assert message_context([("a", b"1")]) is None
