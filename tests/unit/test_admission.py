"""Admission: each message's route from the circuit, the key backlog and the hold-back (outbox/producer/admission.py).

Real parts (a circuit on a fake clock, a key backlog on an in-memory store, a hold-back); no Kafka.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox.budget import MemoryBudget
from outbox.producer.admission import HOLD, PROBE, SEND, STORE, Admission
from outbox.producer.circuit import CircuitBreaker
from outbox.producer.keyorder import Holdback, KeyBacklog
from outbox.producer.sendfence import SendFence
from outbox.records import NewMessage
from outbox.stores.memory import MemoryOutbox


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class QueuedRows:
    """The writer's part the key backlog uses: keeps what it is given."""

    def __init__(self) -> None:
        self.rows: list[NewMessage] = []

    def add_new(self, msg: NewMessage, meta: object = None, *, cost: int = 0) -> None:
        self.rows.append(msg)

    def flush(self) -> int:
        return 0


class Parts:
    def __init__(self, *, probes: bool = True, keyed_probes: bool = False) -> None:
        self.clock = Clock()
        self.circuit = CircuitBreaker(failure_threshold=1, reset_timeout=5.0, clock=self.clock)
        self.store = MemoryOutbox()
        self.hold: Holdback[NewMessage] = Holdback(
            lambda m: m.msg_id, budget=MemoryBudget(1 << 20), clock=self.clock
        )
        fence = SendFence(tracking=False, budget=MemoryBudget(1 << 20), on_full=lambda: None, clock=self.clock,
                          longest=30.0)
        self.writer = QueuedRows()
        self.backlog = KeyBacklog(
            self.store, self.writer, self.hold, fence, waiting={}, may_check=lambda: False
        )
        self.admission = Admission(
            self.circuit, self.backlog, self.hold, fence, probes=probes, keyed_probes=keyed_probes
        )

    def open_circuit(self) -> None:
        self.circuit.trip("all brokers down")

    def half_open(self) -> None:
        self.open_circuit()
        self.clock.now += 5.0


@pytest.fixture
def parts() -> Iterator[Parts]:
    p = Parts()
    yield p
    p.store.close()


def test_a_closed_circuit_and_no_waiting_key_sends(parts: Parts) -> None:
    assert parts.admission.route("t", b"k") is SEND
    assert parts.admission.route("t", None) is SEND
    assert parts.admission.route("t", "k") is SEND  # a str key, as produce() may be given


def test_a_key_with_messages_bound_for_the_outbox_holds_its_new_ones_behind_them(parts: Parts) -> None:
    parts.backlog.queue(NewMessage("t", b"v", b"k"), None)
    assert parts.admission.route("t", b"k") is HOLD
    assert parts.admission.route("t", "k") is HOLD  # str keys are compared as their UTF-8 bytes
    # Only that key of that topic: the rest of the traffic still goes straight to Kafka.
    assert parts.admission.route("t", b"other") is SEND
    assert parts.admission.route("u", b"k") is SEND
    assert parts.admission.route("t", None) is SEND


def test_the_key_is_asked_before_the_circuit_so_a_waiting_key_never_probes() -> None:
    p = Parts(keyed_probes=True)
    p.backlog.queue(NewMessage("t", b"v", b"k"), None)
    p.half_open()
    assert p.admission.route("t", b"k") is HOLD
    assert p.admission.route("t", b"free") is PROBE  # the probe was not spent on the waiting key


def test_an_open_circuit_stores_without_a_send(parts: Parts) -> None:
    parts.open_circuit()
    assert parts.admission.route("t", None) is STORE
    assert parts.admission.route("t", b"k") is STORE


def test_a_half_open_circuit_lets_one_unkeyed_message_probe(parts: Parts) -> None:
    parts.half_open()
    assert parts.admission.route("t", b"k") is STORE  # keyed probes only without a drain worker
    assert parts.admission.route("t", None) is PROBE
    assert parts.admission.route("t", None) is STORE  # one probe per reset period
    parts.circuit.record_failure()  # the probe failed: open again
    assert parts.admission.route("t", None) is STORE
    parts.clock.now += 5.0
    assert parts.admission.route("t", None) is PROBE
    parts.circuit.record_success()
    assert parts.admission.route("t", b"k") is SEND


def test_keyed_probes_when_allowed() -> None:
    p = Parts(keyed_probes=True)
    p.half_open()
    assert p.admission.route("t", b"k") is PROBE


def test_nothing_probes_while_the_hold_back_holds(parts: Parts) -> None:
    parts.half_open()
    parts.hold.start(30)
    assert parts.hold.active
    assert parts.admission.route("t", None) is STORE
    assert parts.hold.release(source_empty=True) == []
    assert not parts.hold.active
    assert parts.admission.route("t", None) is PROBE


def test_write_ahead_mode_never_probes() -> None:
    p = Parts(probes=False, keyed_probes=True)
    p.half_open()
    assert p.admission.route("t", None) is STORE
    assert p.admission.route("t", b"k") is STORE
    assert p.circuit.allow_probe()  # the probe is still there for the drain to take


def test_a_released_keys_gated_messages_go_to_kafka_only_while_the_circuit_is_closed(parts: Parts) -> None:
    assert parts.admission.released() is SEND
    parts.half_open()
    assert parts.admission.released() is STORE  # a gate's messages never probe
    assert parts.admission.route("t", None) is PROBE  # and did not spend the probe


def test_a_circuit_closed_again_within_the_holds_grace_still_stores(parts: Parts) -> None:
    # One partition's failure opened the circuit and a drain delivery closed it again at once:
    # until the grace is over, messages are stored (the hold-back keeps them in produce order)
    # while the stragglers of the opening are purged; then fallback mode sends on.
    parts.hold.start(31.0, grace=0.2)
    assert parts.circuit.closed and parts.hold.in_grace()
    assert parts.admission.route("t", b"k") is STORE
    assert parts.admission.route("t", None) is STORE
    parts.clock.now += 0.2
    assert not parts.hold.in_grace()
    assert parts.admission.route("t", b"k") is SEND
