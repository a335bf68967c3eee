"""A librdkafka producer made at its first use.

A client that may never be needed (the drain workers' re-senders while the outbox stays empty,
the cluster probe until a queue stays full) is not made up front: each one made is a set of
connections to every broker and librdkafka threads. New SASL credentials reach it whether it is
made yet or not.
"""

from __future__ import annotations

import threading
from typing import Any

from confluent_kafka import Producer


class LazyProducer:
    """A `confluent_kafka.Producer` made from `config` at the first `get()`.

    Args:
        config: its settings; `set_sasl_credentials` updates them for a producer made later.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._producer: Producer | None = None
        self._lock = threading.Lock()  # making it, against new credentials or a replacement

    def get(self) -> Producer:
        """The producer, made now if it is not yet."""
        producer = self._producer
        if producer is None:
            with self._lock:
                if self._producer is None:
                    self._producer = Producer(self.config)
                producer = self._producer
        return producer

    def made(self) -> Producer | None:
        """The producer if it is made, else None (nothing is made)."""
        return self._producer

    def replace(self) -> Producer | None:
        """Make a new producer now; return the one it replaces (None if none was made)."""
        with self._lock:
            old, self._producer = self._producer, Producer(self.config)
        return old

    def take(self) -> Producer | None:
        """Forget the producer (the next `get()` makes a new one) and return it, if made."""
        with self._lock:
            producer, self._producer = self._producer, None
        return producer

    def set_sasl_credentials(self, username: str, password: str) -> None:
        """New SASL credentials: for the producer if it is made, else for the one made later."""
        with self._lock:
            self.config["sasl.username"] = username
            self.config["sasl.password"] = password
            if self._producer is not None:
                self._producer.set_sasl_credentials(username, password)
