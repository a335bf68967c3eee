"""Dead-letter retention (`ResilientProducer(dead_letter_retention=...)`): a thread of its own,
`outbox-retention`, deletes the outbox's dead letters older than the retention.

Older by the time of their last failure (`last_failed_at`), which is when a message became a
dead letter: a dead letter replayed that fails again is young again. `outbox dlq purge --until`
and `--older-than` compare the same time. Every dead letter of the outbox counts, whoever stored
it (this producer, another one sharing the outbox, a `ResilientConsumer` with
`dead_letters="store"`).

A pass runs when the thread starts and then every `EVERY` seconds; it deletes in bounded
batches, each its own short transaction and its own audit entry (who: "retention",
`outbox.stores.audited.purge_in_batches`). Its own thread, not one of the producer's: the key
thread's checks and the drain workers' claims must not wait behind a purge of many thousands of
rows, and with `drain_workers=0` or `drain_in="process"` the producer has no drain thread. The
thread never dies silently: a failed pass is logged (a store error once per failing spell) and
tried again after `RETRY` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from outbox.errors import StoreError
from outbox.records import DeadLetterFilter
from outbox.stores.audited import purge_in_batches
from outbox.stores.base import StoreAdmin

log = logging.getLogger("outbox")

#: Seconds between two passes.
EVERY = 300.0
#: Seconds before a failed pass is tried again.
RETRY = 30.0
#: Who the audit log names for what the retention deleted.
WHO = "retention"


class DeadLetterRetention:
    """Deletes the dead letters of `store` older than `seconds`, on a daemon thread of its own.

    Args:
        store: the outbox (shared with the producer's other threads: stores are thread-safe).
        seconds: the retention: dead letters whose last failure is older are deleted.
        every: seconds between two passes.
        retry: seconds before a failed pass is tried again.
        clock: the current time, epoch seconds.
    """

    def __init__(
        self, store: StoreAdmin, seconds: float, *, every: float = EVERY, retry: float = RETRY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.seconds = seconds
        self._store = store
        self._every = every
        self._retry = retry
        self._clock = clock
        #: Dead letters deleted so far.
        self.purged = 0
        #: Passes that failed (logged).
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-retention", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """End the thread: at once between passes, after the current batch during one."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def purge_expired(self) -> int:
        """One pass: delete every dead letter whose last failure is older than the retention."""
        flt = DeadLetterFilter(until=self._clock() - self.seconds)
        return purge_in_batches(self._store, flt, who=WHO, stop=self._stop)

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            wait = self._every
            try:
                purged = self.purge_expired()
                self.purged += purged
                if purged:
                    log.info("outbox: deleted %d dead letter(s) older than the retention (%gs)", purged, self.seconds)
                failing = False
            except StoreError as exc:  # tried again soon; logged once per failing spell
                self.failures += 1
                if not failing:
                    log.warning("outbox: cannot delete dead letters older than the retention (retrying): %s", exc)
                failing = True
                wait = self._retry
            except Exception:  # never die silently: the next pass tries again
                self.failures += 1
                log.exception("outbox: dead-letter retention failed; retrying")
                wait = self._retry
            self._stop.wait(wait)
