"""Is the cluster there? Asked on a librdkafka client of its own.

A producer whose local queue is full asks this before it opens the circuit (`outbox.producer.link`): a
queue that stays full with nothing delivered means either the cluster is gone or hung, or one
broker is gone and its partitions' messages fill the queue while the others deliver nothing new
for want of room. A broker that answers a metadata request tells the two apart.

The question goes through a separate client, not the busy producer: the producer's own metadata
request waits behind its connections' produce traffic. With one broker of three killed under
8 KiB messages, the producer's own request was answered only seconds later, while a separate
client's was answered by a live broker within milliseconds, in each of the 5 stalls measured;
unanswered, the circuit opened as if the whole cluster were down.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox.lazyproducer import LazyProducer
from outbox.retry import a_broker_answers

__all__ = ["ClusterProbe"]

#: Settings the probe's client does not take from the producer's: the callbacks of messages and
#: of the producer's own events (its errors, e.g. "all brokers down", must not reach the circuit
#: twice), and idempotence, which would make the client ask for a producer id it never uses.
_NOT_FOR_THE_PROBE = (
    "error_cb", "stats_cb", "throttle_cb", "on_delivery", "dr_cb", "dr_msg_cb", "statistics.interval.ms",
    "enable.idempotence",
)


class ClusterProbe:
    """A metadata request on a client made from the producer's connection settings (security,
    SASL, OAuth included), created at the first question and kept until `close()`."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = {k: v for k, v in config.items() if k not in _NOT_FOR_THE_PROBE}
        client_id = self._config.get("client.id")
        self._config["client.id"] = f"{client_id or 'outbox'}-probe"
        self._client = LazyProducer(self._config)

    def answers(self, timeout: float) -> bool:
        """Does any broker answer a metadata request within `timeout` seconds?"""
        return a_broker_answers(self._client.get(), timeout)

    def set_sasl_credentials(self, username: str, password: str) -> None:
        """New SASL credentials, for the client now and any made later."""
        self._client.set_sasl_credentials(username, password)

    def close(self) -> None:
        client = self._client.take()
        if client is not None:
            client.flush(0)  # it never produces: nothing to wait for
