"""key_serializer= / value_serializer= with confluent-kafka's serializers, against the real cluster.

The Schema Registry serializers use confluent-kafka's in-process MockSchemaRegistryClient
(``mock://`` URL): no Schema-Registry-compatible server can be installed from PyPI, Maven Central
or Debian here (see the README's Serializers section).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.error import KeySerializationError, ValueSerializationError
from confluent_kafka.schema_registry import SchemaRegistryClient, header_schema_id_serializer
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext, StringDeserializer, StringSerializer
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from outbox import ResilientProducer, RetryPolicy
from outbox.producer.aio import AsyncResilientProducer

from ..waiting import wait_until
from .delivery import header, read_topic

FAST = {"acks": "all", "enable.idempotence": True, "linger.ms": 5, "message.timeout.ms": 3000}
# Tests without an outage: librdkafka's usual patience, so a loaded machine's slow acknowledgements
# do not send messages to the outbox (3 s time-outs did at load average 30).
STEADY = {**FAST, "message.timeout.ms": 30000}
ORDER_JSON = """{"type": "object", "properties": {"id": {"type": "integer"}, "item": {"type": "string"}},
                 "required": ["id", "item"]}"""
ORDER_AVRO = """{"type": "record", "name": "Order",
                 "fields": [{"name": "id", "type": "long"}, {"name": "item", "type": "string"}]}"""


def order_proto_class() -> Any:
    """The message class of ``message Order { int64 id = 1; string item = 2; }`` built without protoc:
    a FileDescriptorProto added to a private descriptor pool, its class made by message_factory."""
    fdp = descriptor_pb2.FileDescriptorProto(name="outbox_test/order.proto", package="outbox.test", syntax="proto3")
    msg = fdp.message_type.add(name="Order")
    f = descriptor_pb2.FieldDescriptorProto
    msg.field.add(name="id", number=1, type=f.TYPE_INT64, label=f.LABEL_OPTIONAL)
    msg.field.add(name="item", number=2, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("outbox.test.Order"))


class Counting:
    """A serializer wrapper that counts its calls (to prove a re-send never serializes again)."""

    def __init__(self, inner: Callable[[Any, SerializationContext], bytes | None]) -> None:
        self.inner = inner
        self.calls: list[tuple[str, MessageField]] = []

    def __call__(self, obj: Any, ctx: SerializationContext) -> bytes | None:
        self.calls.append((ctx.topic, ctx.field))
        return self.inner(obj, ctx)


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_string_serializers_set_key_and_value_bytes(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    with ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap, **STEADY}, outbox=f"sqlite:///{tmp_path / 'o.db'}",
        key_serializer=StringSerializer(), value_serializer=StringSerializer("utf_16"),
    ) as p:
        ids = [p.produce(topic, f"héllo {i}", key=f"k-{i}") for i in range(10)]
        assert p.flush(30) == 0

    async def via_async() -> str:
        async with AsyncResilientProducer(
            {"bootstrap.servers": kafka_bootstrap, **STEADY}, outbox=f"sqlite:///{tmp_path / 'a.db'}",
            key_serializer=StringSerializer(), value_serializer=StringSerializer("utf_16"),
        ) as ap:
            return await ap.produce(topic, "async héllo", key="k-async")

    ids.append(asyncio.run(via_async()))
    got = read_topic(kafka_bootstrap, topic, 11)
    assert got.unique == 11 and set(got.by_id) == set(ids)
    pairs = {(m.key(), m.value()) for m in got.messages}
    assert (b"k-3", "héllo 3".encode("utf_16")) in pairs
    assert (b"k-async", "async héllo".encode("utf_16")) in pairs


def test_schema_registry_bytes_are_made_once_and_the_outbox_resends_them_unchanged(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    json_topic, avro_topic = make_topic(), make_topic()
    registry = SchemaRegistryClient.new_client({"url": "mock://outbox-tests"})
    json_ser = Counting(JSONSerializer(ORDER_JSON, registry))
    # The schema id travels in a header here (header_schema_id_serializer appends to ctx.headers).
    avro_conf = {"schema.id.serializer": header_schema_id_serializer}
    avro_ser = Counting(AvroSerializer(registry, ORDER_AVRO, conf=avro_conf))
    orders = [{"id": i, "item": f"book-{i}"} for i in range(20)]
    db = f"sqlite:///{tmp_path / 'o.db'}"
    # 1) Kafka unreachable: every message ends in the outbox, serialized.
    with ResilientProducer(
        {"bootstrap.servers": closed_port(), **FAST, "message.timeout.ms": 1000},
        outbox=db, drain_workers=0, value_serializer=json_ser,
    ) as p:
        for o in orders:
            p.produce(json_topic, o, headers=[("kind", b"order")])
        assert p.flush(30) == 0
        assert p.stats()["pending"] == 20
    with ResilientProducer(
        {"bootstrap.servers": closed_port(), **FAST, "message.timeout.ms": 1000},
        outbox=db, drain_workers=0, value_serializer=avro_ser,
    ) as p:
        for o in orders[:5]:
            p.produce(avro_topic, o)
        assert p.flush(30) == 0
        assert p.stats()["pending"] == 25
    assert json_ser.calls == [(json_topic, MessageField.VALUE)] * 20
    assert avro_ser.calls == [(avro_topic, MessageField.VALUE)] * 5
    # 2) Another producer, with no serializer at all, drains the stored bytes to the real cluster.
    with ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap, **STEADY}, outbox=db,
        retry=RetryPolicy(max_attempts=100, initial_delay=0.2), drain_poll_interval=0.2,
    ) as drainer:
        wait_until(lambda: drainer.stats()["pending"] == 0, 60, "the outbox is drained")
    assert json_ser.calls == [(json_topic, MessageField.VALUE)] * 20, "a re-send never serializes again"
    got = read_topic(kafka_bootstrap, json_topic, 20)
    decode = JSONDeserializer(ORDER_JSON, schema_registry_client=registry)
    decoded = [
        decode(m.value(), SerializationContext(json_topic, MessageField.VALUE, m.headers())) for m in got.messages
    ]
    assert sorted(decoded, key=lambda o: o["id"]) == orders
    assert all(header(m, "kind") == b"order" for m in got.messages)
    avro_got = read_topic(kafka_bootstrap, avro_topic, 5)
    assert avro_got.unique == 5
    # Avro binary of {"id": i, "item": "book-i"}: zigzag varint id, then the length-prefixed string.
    assert {m.value() for m in avro_got.messages} == {
        bytes([2 * i, 12]) + f"book-{i}".encode() for i in range(5)
    }
    assert all(header(m, "__value_schema_id") for m in avro_got.messages), "the schema-id header was stored and sent"


def test_serialization_errors_raise_at_produce_and_store_nothing(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    registry = SchemaRegistryClient.new_client({"url": "mock://outbox-errors"})

    def bad_key(obj: Any, ctx: SerializationContext) -> bytes:
        raise ValueError(f"cannot encode key {obj!r}")

    with ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap, **STEADY}, outbox=f"sqlite:///{tmp_path / 'o.db'}",
        value_serializer=JSONSerializer(ORDER_JSON, registry),
    ) as p:
        with pytest.raises(ValueSerializationError, match="'x' is not of type 'integer'"):
            p.produce(topic, {"id": "x", "item": "pen"})
        with pytest.raises(ValueSerializationError, match="'item' is a required property"):
            p.produce(topic, {"id": 1})
        assert p.flush(10) == 0
        st = p.stats()
    assert (st["produced"], st["pending"], st["dead"], st["in_memory"], st["unsaved"]) == (0, 0, 0, 0, 0)

    async def via_async() -> None:
        async with AsyncResilientProducer(
            {"bootstrap.servers": kafka_bootstrap, **STEADY}, outbox=f"sqlite:///{tmp_path / 'a.db'}",
            key_serializer=bad_key,
        ) as ap:
            with pytest.raises(KeySerializationError, match="cannot encode key 42") as err:
                await ap.produce(topic, b"v", key=42)  # type: ignore[arg-type]
            assert isinstance(err.value.exception, ValueError)
            st = await ap.stats()
            assert (st["produced"], st["pending"], st["in_memory"]) == (0, 0, 0)

    asyncio.run(via_async())
    with pytest.raises(TypeError, match="value_serializer must be callable as serializer"):
        ResilientProducer({"bootstrap.servers": kafka_bootstrap}, outbox=f"sqlite:///{tmp_path / 'x.db'}",
                          value_serializer="json")  # type: ignore[arg-type]


def test_protobuf_serializer_bytes_made_once_survive_an_outage_and_read_back(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    order_cls = order_proto_class()
    registry = SchemaRegistryClient.new_client({"url": "mock://outbox-protobuf"})
    value_ser = Counting(ProtobufSerializer(order_cls, registry))
    key_ser = Counting(StringSerializer())
    orders = [order_cls(id=i, item=f"book-{i}") for i in range(20)]
    db = f"sqlite:///{tmp_path / 'o.db'}"
    # 1) Kafka unreachable: every message is serialized once, at produce(), and lands in the outbox.
    with ResilientProducer(
        {"bootstrap.servers": closed_port(), **FAST, "message.timeout.ms": 1000},
        outbox=db, drain_workers=0, value_serializer=value_ser, key_serializer=key_ser,
    ) as p:
        for o in orders:
            p.produce(topic, o, key=str(o.id))
        assert p.flush(30) == 0
        assert p.stats()["pending"] == 20
    # 2) Kafka back: a producer with no serializer and no registry drains the stored bytes.
    with ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap, **STEADY}, outbox=db,
        retry=RetryPolicy(max_attempts=100, initial_delay=0.2), drain_poll_interval=0.2,
    ) as drainer:
        wait_until(lambda: drainer.stats()["pending"] == 0, 60, "the outbox is drained")
    assert value_ser.calls == [(topic, MessageField.VALUE)] * 20, "a re-send never serializes again"
    assert key_ser.calls == [(topic, MessageField.KEY)] * 20
    got = read_topic(kafka_bootstrap, topic, 20)
    assert got.unique == 20 and len(got.messages) == 20
    decode = ProtobufDeserializer(order_cls, {}, registry)
    read_back = {}
    for m in got.messages:
        ctx = SerializationContext(topic, MessageField.VALUE, m.headers())
        order = decode(m.value(), ctx)
        assert StringDeserializer()(m.key(), ctx) == str(order.id)
        read_back[order.id] = order
    assert [read_back[i] for i in range(20)] == orders
    # Confluent's wire format: magic byte 0, the schema id, the message-index list, the protobuf bytes.
    schema_id = registry.get_latest_version(f"{topic}-value").schema_id
    assert all(m.value()[:5] == b"\0" + schema_id.to_bytes(4, "big") for m in got.messages)
