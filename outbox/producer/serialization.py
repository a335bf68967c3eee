"""Key and value serializers for ResilientProducer: confluent-kafka's, called once, before the outbox.

Any callable ``serializer(obj, ctx) -> bytes | None`` works; confluent_kafka.serialization's
(StringSerializer, IntegerSerializer, ...) and the Schema Registry serializers (Avro, JSON
Schema, Protobuf) are such callables. Each gets ``SerializationContext(topic, MessageField.KEY
or VALUE, headers)``, where ``headers`` is the message's header list: a serializer that writes
the schema id into a header (``header_schema_id_serializer``) appends to it, and that header is
sent and stored with the message.

The outbox stores the bytes, so a re-send, a drain by another process or a Spark job never
serializes again (and never needs the registry). A serializer's error is raised from
``produce()`` as confluent-kafka's KeySerializationError / ValueSerializationError (as its
SerializingProducer does), and nothing is sent or stored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka.error import KeySerializationError, ValueSerializationError
from confluent_kafka.serialization import MessageField, SerializationContext

Serializer = Callable[[Any, SerializationContext], bytes | None]

__all__ = ["Serializer", "Serializers"]


class Serializers:
    """The key and value serializers of one producer.

    Args:
        key: serializer for keys, or None to send keys as given (bytes, str or None).
        value: serializer for values, or None likewise.
    """

    __slots__ = ("key", "value")

    def __init__(self, key: Serializer | None, value: Serializer | None) -> None:
        for name, s in (("key_serializer", key), ("value_serializer", value)):
            if s is not None and not callable(s):
                raise TypeError(f"{name} must be callable as serializer(obj, ctx), got {type(s).__name__}")
        self.key = key
        self.value = value

    @classmethod
    def of(cls, key: Serializer | None, value: Serializer | None) -> Serializers | None:
        """None when there is nothing to do, so that produce() pays one `is None` test."""
        return None if key is None and value is None else cls(key, value)

    def __call__(self, topic: str, value: Any, key: Any, headers: Any) -> tuple[Any, Any, list[tuple[str, Any]]]:
        """Serialize `key` and `value` for `topic`; returns (value, key, headers as a list)."""
        items = headers.items() if isinstance(headers, Mapping) else headers or ()
        hdrs: list[tuple[str, Any]] = list(items)
        if self.key is not None:
            try:
                key = self.key(key, SerializationContext(topic, MessageField.KEY, hdrs))
            except Exception as exc:
                raise KeySerializationError(exc) from exc
        if self.value is not None:
            try:
                value = self.value(value, SerializationContext(topic, MessageField.VALUE, hdrs))
            except Exception as exc:
                raise ValueSerializationError(exc) from exc
        return value, key, hdrs
