"""A refusal of the credentials is told once in the process, until every circuit in it has closed."""

from __future__ import annotations

import gc
import logging

from outbox.producer.refusals import REFUSALS, RefusalNotices, Refusals, refusal_of


class Circuit:
    """Stands for a producer's circuit: a refusal only keeps a weak reference to it."""


def test_the_first_circuit_of_a_refusal_tells_and_the_others_do_not_until_all_have_left() -> None:
    refusals = Refusals()
    key = refusal_of({"bootstrap.servers": "b:9093,a:9093", "sasl.mechanism": "PLAIN", "sasl.username": "alice"})
    app, hops = Circuit(), Circuit()
    assert refusals.join(key, app) and not refusals.join(key, hops)
    refusals.leave(app)
    assert not refusals.join(key, app)  # the hops' circuit is still refused: the same refusal
    refusals.leave(app)
    refusals.leave(hops)
    assert refusals.join(key, app)  # every circuit closed meanwhile: a new refusal, told again


def test_a_refusal_is_the_cluster_and_the_identity_presented_there() -> None:
    refusals = Refusals()
    alice = {"bootstrap.servers": "a:9093, b:9093", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "alice"}
    circuits = [Circuit() for _ in range(4)]
    assert refusals.join(refusal_of(alice), circuits[0])
    assert not refusals.join(
        refusal_of({**alice, "bootstrap.servers": "b:9093,a:9093", "sasl.password": "x"}), circuits[1]
    )
    assert refusals.join(refusal_of({**alice, "sasl.username": "bob"}), circuits[2])
    assert refusals.join(refusal_of({**alice, "bootstrap.servers": "c:9093"}), circuits[3])


def test_a_circuit_dropped_without_closing_leaves_its_refusal() -> None:
    refusals = Refusals()
    key = refusal_of({"bootstrap.servers": "a:9093"})
    circuit: Circuit | None = Circuit()
    assert refusals.join(key, circuit)
    circuit = None
    gc.collect()
    assert refusals.join(key, Circuit())


def test_a_consumer_that_is_refused_first_tells_once_and_a_circuit_after_it_does_not() -> None:
    config = {"bootstrap.servers": "consumer-first:9093", "sasl.mechanism": "PLAIN", "sasl.username": "alice"}
    notices, circuit = RefusalNotices(config), Circuit()
    assert [notices.level(), notices.level()] == [logging.WARNING, logging.INFO]  # its repeats: INFO
    assert not REFUSALS.join(refusal_of(config), circuit)  # a producer's circuit then: INFO
    notices.answered()
    REFUSALS.leave(circuit)
    assert notices.level() == logging.WARNING  # a new refusal
    notices.answered()
