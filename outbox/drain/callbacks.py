"""The application's librdkafka client callbacks on the re-senders' producers.

`error_cb`, `throttle_cb`, `stats_cb` and `oauth_cb` serve every librdkafka client a
`ResilientProducer` runs: its own producer and each drain worker's. On a drain worker, a
callback is called from the worker's `poll()`/`flush()`, and confluent-kafka raises what it
raised from there, which ended the worker. So each is wrapped: an exception is logged and
counted, and the worker goes on.

`oauth_cb` is the exception: librdkafka needs a token or a failure, and confluent-kafka turns a
callback that raises into a token failure, so its exception is raised again. It is not a fault
of the application's code to report but a token that cannot be had, an outage like a token the
broker rejects: the brokers refuse the client, the producer's circuit names the cause
(`outbox.producer.tokens`), and the drain waits for the cluster (`outbox.drain.sendloop`). So it
is neither counted nor logged above DEBUG, and then by its class alone: its text may carry what
the token service answered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from outbox.lockorder import new_lock

log = logging.getLogger("outbox")

#: The client-level callbacks of a confluent_kafka client config.
CLIENT_CALLBACKS = ("error_cb", "throttle_cb", "stats_cb", "oauth_cb")
_RAISES_AGAIN = frozenset({"oauth_cb"})
#: Seconds between two ERROR lines of one callback that keeps raising (a `stats_cb` may be
#: called every few hundred milliseconds per client); the ones between are counted, at DEBUG.
LOG_EVERY = 60.0


class CallbackErrors:
    """How many user callbacks raised (several threads count into it)."""

    def __init__(self) -> None:
        self._lock = new_lock("callback errors")
        self.count = 0

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.count += n


def guarded(config: Mapping[str, Any], errors: CallbackErrors, *, client: str) -> dict[str, Any]:
    """`config` with each client callback wrapped: a raise is logged (naming `client`) and counted."""
    out = dict(config)
    for name in CLIENT_CALLBACKS:
        fn = out.get(name)
        if callable(fn):
            out[name] = _Guard(name, fn, errors, client)
    return out


class _Guard:
    __slots__ = ("name", "fn", "errors", "client", "_next_log", "_quiet")

    def __init__(self, name: str, fn: Callable[..., Any], errors: CallbackErrors, client: str) -> None:
        self.name, self.fn, self.errors, self.client = name, fn, errors, client
        self._next_log = 0.0
        self._quiet = 0  # raises since the last ERROR line

    def __call__(self, *args: Any) -> Any:
        try:
            return self.fn(*args)
        except Exception as exc:
            if self.name in _RAISES_AGAIN:
                log.debug("outbox: the application's %s raised %s on %s", self.name, type(exc).__name__, self.client)
                raise
            self.errors.add()
            now = time.monotonic()
            if now >= self._next_log:
                self._next_log = now + LOG_EVERY
                log.exception(
                    "outbox: the application's %s raised on %s (counted in callback_errors; %d more since the "
                    "last such line)",
                    self.name,
                    self.client,
                    self._quiet,
                )
                self._quiet = 0
            else:
                self._quiet += 1
                log.debug("outbox: the application's %s raised on %s again", self.name, self.client, exc_info=True)
            return None
