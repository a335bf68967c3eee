"""Logging like a library: quiet unless the application asks, and one line where librdkafka says many.

The package's loggers hang under ``outbox``, which has a `logging.NullHandler` (set in
``outbox/__init__.py``, as the Python logging HOWTO advises for libraries): an application that
configured no logging sees nothing from us, not Python's last-resort stderr output.

librdkafka reports every failed connection attempt (facility ``FAIL``, ``ERROR`` for "all
brokers are down", and ``SSL`` for a TLS handshake's warnings) at LOG_ERR or LOG_WARNING, several
times a second per broker, from every producer the SDK runs (the application's one and each drain
worker's). During an outage that is noise: the circuit breaker's state changes and ``stats()`` say
what an operator needs. `LIBRDKAFKA_LOG`,
the ``logger`` every SDK producer gets, turns them into:

* the first failure of an episode at WARNING (an episode ends after `QUIET` seconds without
  one);
* then each failure at DEBUG, plus one WARNING every `SUMMARY_EVERY` seconds with the count.

Everything else librdkafka logs passes through at its own level on ``outbox.librdkafka``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

#: Seconds between two summary lines while connection failures go on.
SUMMARY_EVERY = 10.0
#: Seconds without a connection failure after which the next one starts a new episode.
QUIET = 60.0

# librdkafka facilities of broker connection failures (rd_kafka_broker_fail, the "N/N brokers
# are down" event, and the TLS handshake's warnings, one per connection attempt); LOG_WARNING and
# above only.
_CONNECTION_FACILITIES = frozenset({"FAIL", "ERROR", "SSL"})


class LibrdkafkaLog:
    """A `logger` for confluent_kafka clients that summarises repeated connection failures.

    confluent_kafka calls ``log(level, "%s [%s] %s", facility, client name, text)`` from the
    thread that polls the client. One instance may serve many clients: it is thread-safe, and
    their failures are counted together.

    Args:
        logger: where the lines go.
        clock: monotonic seconds (a fake clock in tests).
    """

    def __init__(self, logger: logging.Logger, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self._clock = clock
        self._lock = threading.Lock()
        self._last_failure: float | None = None
        self._next_summary = 0.0
        self._since_summary = 0
        self._window_start = 0.0

    def log(self, level: int, msg: str, *args: Any) -> None:
        """confluent_kafka's entry point (the `logging.Logger.log` signature)."""
        facility = args[0] if args else None
        if level < logging.WARNING or facility not in _CONNECTION_FACILITIES:
            self.logger.log(level, msg, *args)
            return
        now = self._clock()
        with self._lock:
            new_episode = self._last_failure is None or now - self._last_failure >= QUIET
            self._last_failure = now
            summary: tuple[int, float] | None = None
            if new_episode:
                self._since_summary = 0
                self._window_start = now
                self._next_summary = now + SUMMARY_EVERY
            else:
                self._since_summary += 1
                if now >= self._next_summary:
                    summary = (self._since_summary, now - self._window_start)
                    self._since_summary = 0
                    self._window_start = now
                    self._next_summary = now + SUMMARY_EVERY
        if new_episode:
            self.logger.warning(
                msg + " (repeated connection failures are summarised every %.0fs; DEBUG shows each)",
                *args, SUMMARY_EVERY,
            )
            return
        self.logger.debug(msg, *args)
        if summary is not None:
            self.logger.warning(
                "librdkafka: %d more broker connection failure(s) in the last %.0fs (last: %s)",
                summary[0], summary[1], args[-1] if args else msg,
            )


#: The `logger` of every librdkafka client the package creates (on the ``outbox.librdkafka`` logger).
LIBRDKAFKA_LOG = LibrdkafkaLog(logging.getLogger("outbox.librdkafka"))


def with_librdkafka_log(config: Mapping[str, Any]) -> dict[str, Any]:
    """A client's `config` with `LIBRDKAFKA_LOG` as its ``logger``, unless it names its own.

    Every confluent_kafka client the package creates (producers, consumers, admin clients) goes
    through here: without a ``logger`` librdkafka writes its lines straight to fd 2, around the
    application's logging configuration and many times a second while no broker answers.
    """
    return {"logger": LIBRDKAFKA_LOG, **config}


class Redact(logging.Filter):
    """Replaces secrets in the records of a logger we do not own (formatted once, args dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if any(s in text for s in self.secrets):
            for s in self.secrets:
                text = text.replace(s, "***")
            record.msg, record.args = text, ()
        return True


_REDACT = Redact()


def redact_in_logs(secret: str, loggers: tuple[str, ...]) -> None:
    """Keep `secret` out of the records of the named loggers and of their children that exist
    now (idempotent).

    py4j logs every command it sends to the JVM at DEBUG, and Spark's JDBC options travel as
    such commands: without this, an application logging at DEBUG would log the database
    password whenever the Spark job reads the outbox.
    """
    if not secret:
        return
    _REDACT.secrets.add(secret)
    # A logger's filters see only the records logged on it, not those its children pass up:
    # the filter goes on each named logger and on every child that exists by now (a module's
    # logger exists once the module is imported).
    existing = list(logging.root.manager.loggerDict)
    for name in loggers:
        for child in [name, *(n for n in existing if n.startswith(name + "."))]:
            logger = logging.getLogger(child)
            if _REDACT not in logger.filters:
                logger.addFilter(_REDACT)
