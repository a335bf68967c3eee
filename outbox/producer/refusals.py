"""A refusal of the credentials, announced once in the process.

A cluster that refuses a set of credentials refuses every client of the process that presents
them: the application's `ResilientProducer`, the producer a `ResilientConsumer` sends its retry
hops with, a second producer of the application. Each of their circuits opens, each naming the
same cause. The application is told once: the first circuit that opens for a refusal logs its
line at WARNING, and each other one that opens for the same refusal while it lasts logs the
same line at INFO. The refusal lasts while any of those circuits is still open; once every one
of them has closed (the credentials work again) or its producer is closed, the next refusal is
told at WARNING again.

A refusal is known by the cluster and the identity the client presents there
(`refusal_of`): the bootstrap servers, the SASL mechanism and username, the TLS client
certificate's file. Never a secret; and it is only compared, never logged.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

from outbox.lockorder import new_lock

Refusal = tuple[str, str, str, str]


def refusal_of(config: Mapping[str, Any]) -> Refusal:
    """Which refusal a client of `config` is in when the cluster refuses it."""
    servers = str(config.get("bootstrap.servers", config.get("metadata.broker.list", "")))
    return (
        ",".join(sorted(s.strip() for s in servers.split(",") if s.strip())),
        str(config.get("sasl.mechanism", config.get("sasl.mechanisms", ""))),
        str(config.get("sasl.username", "")),
        str(config.get("ssl.certificate.location", "")),
    )


class Refusals:
    """The refusals the process's circuits are open for now, each with the circuits in it."""

    def __init__(self) -> None:
        self._lock = new_lock("refusals")
        # Weak: a producer dropped without close() leaves no refusal behind it.
        self._open: dict[Refusal, weakref.WeakSet[object]] = {}

    def join(self, refusal: Refusal, circuit: object) -> bool:
        """`circuit` opened for `refusal`. True if it is the first of the process to (it tells)."""
        with self._lock:
            members = self._open.setdefault(refusal, weakref.WeakSet())
            first = not members
            members.add(circuit)
            return first

    def leave(self, circuit: object) -> None:
        """`circuit` closed, or its producer did: it is in no refusal any more."""
        with self._lock:
            for refusal, members in list(self._open.items()):
                members.discard(circuit)
                if not members:
                    del self._open[refusal]


#: The process's refusals: every `ResilientProducer`'s circuit joins them.
REFUSALS = Refusals()


class RefusalNotices:
    """A client without a circuit (a `ResilientConsumer`) in the process's refusals: its first
    refused error is logged at WARNING unless the process told of that refusal already, the
    others at INFO, until the cluster answers it again (`answered`).

    Args:
        config: the client's settings, read at each refusal (new credentials change who is refused).
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = config
        self.refusing = False

    def level(self) -> int:
        """The level of a refused error's line."""
        first = REFUSALS.join(refusal_of(self._config), self)
        self.refusing = True
        return logging.WARNING if first else logging.INFO

    def answered(self) -> None:
        """The cluster took the client again, or it is closed."""
        if self.refusing:
            self.refusing = False
            REFUSALS.leave(self)
