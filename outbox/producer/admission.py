"""Admission: where a message goes on its way in, decided in one place.

Each message a `ResilientProducer` accepts takes one of four routes:

- ``SEND``: to Kafka now. The circuit is closed and the message's key has nothing in the outbox.
- ``PROBE``: to Kafka as the half-open circuit's one trial message (fallback mode; in
  write-ahead mode the drain probes). If it fails it is stored like any failed first send.
- ``HOLD``: behind its key. The key has messages in the outbox, or in a gate that is handing
  it back (`outbox.producer.keyorder`), so this one is stored behind them: per-key order.
- ``STORE``: into the outbox without a send. The circuit is not closed and the message may
  not probe.

A message bound for the outbox may wait in the hold-back first: while the
circuit has just opened, or a keyed probe is out, what librdkafka still holds must reach the
outbox first (`outbox.producer.keyorder.Holdback`).

`Admission` decides a message's route on its way in: produce() asks `route` (write-ahead mode's
`WriteAhead.write` too), and the key backlog's handed-back messages ask `released`. What each
route then does is the caller's: `FirstSend` sends, `Spill` stores. A key admitted as HOLD may
have been released since `route`: the key backlog asks again under its lock
(`KeyBacklog.queue_behind_key`).

The happy path pays one call: `route` reads the backlog's pending keys (an empty set is false)
and the circuit's ``closed`` flag, both plain attributes kept exact by their owners.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from outbox.message import as_bytes
from outbox.producer.circuit import CircuitBreaker
from outbox.producer.keyorder import Holdback, KeyBacklog
from outbox.producer.sendfence import SendFence


class Route(IntEnum):
    """A message's way in (module doc)."""

    SEND = 0
    PROBE = 1
    HOLD = 2
    STORE = 3


# Module globals: `route is SEND` on produce()'s path is one global read, not a class attribute's.
SEND, PROBE, HOLD, STORE = Route.SEND, Route.PROBE, Route.HOLD, Route.STORE


class Admission:
    """Decides each message's route (module doc).

    Args:
        circuit: closed: Kafka takes messages; half-open: one may probe.
        backlog: the keys with messages bound for or in the outbox (`KeyBacklog.pending`).
        hold: the hold-back; no message probes while it is active (a probe's failure would be
            stored behind what it holds).
        probes: whether produce() may probe the circuit (fallback mode). Write-ahead mode stores
            every message anyway, and its drain's first delivery closes the circuit.
        keyed_probes: whether a keyed message may probe. Only when no drain worker of this
            process does: a keyed probe holds back what is bound for the outbox until librdkafka
            has reported it (`Spill.hold_behind_probe`), which is worth avoiding when a drain
            delivery can close the circuit instead.
    """

    __slots__ = ("_circuit", "_backlog", "_hold", "_fence", "_probes", "_keyed_probes")

    def __init__(
        self, circuit: CircuitBreaker, backlog: KeyBacklog, hold: Holdback[Any], fence: SendFence, *, probes: bool,
        keyed_probes: bool,
    ) -> None:
        self._circuit = circuit
        self._backlog = backlog
        self._hold = hold
        self._fence = fence
        self._probes = probes
        self._keyed_probes = probes and keyed_probes

    def route(self, topic: str, key: Any) -> Route:
        """The route of a new message of `topic` with `key` (bytes, str or None).

        Key first: a message that must wait behind its key is no use as the circuit's probe.
        PROBE claims the half-open circuit's one probe: send it.
        """
        pending = self._backlog.pending
        handed_back = self._fence.handed_back
        if key is not None and (pending or handed_back):
            k = (topic, key if key.__class__ is bytes else as_bytes(key))
            if k in pending:
                return HOLD
            if k in handed_back:
                # librdkafka held sends of this key when it was asked to hand messages back, and
                # their failures may not be served yet: stored, it waits behind them (sendfence).
                return STORE
        circuit = self._circuit
        hold = self._hold
        if circuit.closed and not hold.active:
            return SEND
        # Write-ahead: while librdkafka hands back what it held when the circuit opened, a key's
        # older rows may still come back failed, and a row sent now would overtake them: it is
        # left to the drain, even if a delivery closed the circuit meanwhile. Fallback mode
        # holds those failures and spills instead and sends on (`outbox.producer.keyorder.Holdback`), except in
        # the hold's first moments, while stragglers are purged (`outbox.producer.spill.STRAGGLER_GRACE`).
        if circuit.closed and self._probes and not hold.in_grace():
            return SEND
        if hold.active or not self._probes or (key is not None and not self._keyed_probes):
            return STORE
        return PROBE if circuit.allow_probe() else STORE

    def released(self) -> Route:
        """The route of a key's messages that a gate held while the key was handed back: SEND
        while the circuit is closed, else STORE (a gate's messages never probe: they go as a
        group, in order)."""
        return SEND if self._circuit.closed else STORE
