"""PollReport: what the producer's threads did for the application since it last looked.

The application's callbacks (`on_delivery`, `error_cb`, `stats_cb`, `on_dead_letter`, ...) run
on the producer's own threads, not in `poll()`. `poll()` still answers what confluent_kafka's
does: it waits for events and returns how many were served since the previous call; and an
exception a callback raised is raised again in the application's thread by the next `poll()` or
`flush()`, instead of ending in a log line on a thread the application never sees.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from outbox.lockorder import new_condition

log = logging.getLogger("outbox")

#: Exceptions kept for poll()/flush() to raise; later ones are counted and logged only (a
#: callback that raises on every message must not hold every message's exception in memory).
MAX_KEPT_ERRORS = 100


class PollReport:
    """Counts served events, keeps the exceptions callbacks raised, and wakes `poll()`."""

    def __init__(self) -> None:
        self._cond = new_condition("poll report")
        self._count = 0
        self._seen = 0
        self._errors: deque[BaseException] = deque()
        self.callback_errors = 0
        self._closed = False
        #: Callbacks run by the delivery thread since it last published them: counted there
        #: without a lock (that thread alone writes it), published once per poll.
        self.delivery_thread_calls = 0
        self._published = 0

    def publish(self) -> None:
        """Delivery thread, after each poll: make its callbacks since the last one count."""
        calls = self.delivery_thread_calls
        if calls != self._published:
            self.add(calls - self._published)
            self._published = calls

    def add(self, n: int) -> None:
        """`n` events were served (delivery reports, other callbacks) on a producer thread."""
        with self._cond:
            self._count += n
            self._cond.notify_all()

    def failed(self, exc: BaseException) -> None:
        """A callback raised `exc` on a producer thread: poll()/flush() raise it."""
        log.error("outbox: a callback raised %r; the next poll() or flush() raises it", exc, exc_info=exc)
        with self._cond:
            self.callback_errors += 1
            self._count += 1
            if len(self._errors) < MAX_KEPT_ERRORS:
                self._errors.append(exc)
            self._cond.notify_all()

    def close(self) -> None:
        """End every wait (the producer is closing)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def raise_pending(self) -> None:
        """Raise the oldest exception a callback raised and nobody has seen yet, if any."""
        if self._errors:  # read without the lock: a miss is caught at the next call
            with self._cond:
                exc = self._errors.popleft() if self._errors else None
            if exc is not None:
                raise exc

    def wait(self, timeout: float | None) -> int:
        """Wait up to `timeout` seconds (None: without end) for an event; return how many were
        served since the previous call, after raising a callback's pending exception."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._count == self._seen and not self._errors and not self._closed:
                if deadline is None:
                    # In slices, so that a signal (Ctrl-C) is seen while nothing happens.
                    self._cond.wait(0.2)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.2))
            served = self._count - self._seen
            self._seen = self._count
        self.raise_pending()
        return served
