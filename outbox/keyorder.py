"""Keys with messages in the outbox: a producer sends their later messages behind them.

Once a key has a message bound for the outbox, the producer stores that key's later messages
too, so one key's messages leave in the order `produce()` took them (README, "Order per key").
`KeyBacklog` is that set of keys: the producer asks `in`, marks a key for every message it sends
to the outbox, and a thread of its own (`outbox-keys`) releases the keys whose rows are all
delivered, by this process or by anyone else. It is the one place keys are released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from .errors import StoreError
from .stores import Outbox

log = logging.getLogger("outbox")

Key = tuple[str, bytes]

RELEASE_EVERY = 0.25  # least seconds between two checks for keys whose outbox backlog is gone
WATCH_EVERY = 1.0  # most seconds between two checks (rows drained by another process)


class KeyBacklog:
    """The (topic, key) pairs whose new messages must queue behind the outbox.

    Args:
        store: the outbox; read for every key with a pending row at start-up (rows an earlier
            process left) and for which keys still have rows.
        flush: commits what the producer has queued for the store, so the check sees it.
        holding: whether messages bound for the outbox are held in memory (neither queued nor
            stored yet: the circuit has just opened); no key is released meanwhile.
        may_check: whether a check is worth its query now (the producer: circuit not open).

    `lock` makes "mark the key and queue its message" one step for the producer: a check must
    never see a key marked while its message is in neither the writer nor the hold.
    """

    def __init__(
        self, store: Outbox, *, flush: Callable[[], object], holding: Callable[[], bool], may_check: Callable[[], bool]
    ) -> None:
        self.lock = threading.RLock()
        self._store = store
        self._flush = flush
        self._holding = holding
        self._may_check = may_check
        #: The keys; read without the lock on the hot path (a set lookup is atomic under the GIL).
        self.pending: set[Key] = set()
        # Mark number of each key's latest message bound for the outbox: a check looks at the
        # store without the lock and keeps a key that was marked since it looked.
        self._mark = 0
        self._marks: dict[Key, int] = {}
        self._loaded = self._load(report=True)
        self._stop = threading.Event()
        self._drained = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="outbox-keys", daemon=True)
        self._thread.start()

    def mark(self, key: Key) -> None:
        """A message of `key` is bound for the outbox (call under `lock`)."""
        self.pending.add(key)
        self._mark += 1
        self._marks[key] = self._mark

    def add(self, key: Key) -> None:
        """`key` has a row in the store already (a write-ahead row that failed)."""
        self.pending.add(key)

    def drained(self, keys: Iterable[Key]) -> None:
        """A drain delivered or dead-lettered rows of these keys: check soon if one is pending."""
        if any(k in self.pending for k in keys):
            self._drained.set()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._drained.set()
        self._thread.join(timeout)

    def release_delivered(self, candidates: set[Key]) -> None:
        """Release the candidates with no row left in the store and no message marked since."""
        with self.lock:
            if self._holding():  # held messages are in neither the writer nor the store yet
                return
            seen = self._mark  # every message marked up to here is already in the writer
        # Not under the lock: produce() needs it for every message of a pending key, and the
        # commit and the query take milliseconds (holding it stalled the application).
        self._flush()  # rows queued up to `seen` are committed: the query sees them
        still = self._store.keys_with_pending(sorted(candidates))
        with self.lock:
            for k in candidates - still:
                if self._marks.get(k, 0) <= seen:  # nothing bound for the outbox since we looked
                    self.pending.discard(k)
                    self._marks.pop(k, None)

    def _load(self, *, report: bool) -> bool:
        """Add every key with a PENDING row in the store (one pass over the pending rows).

        At start-up, and again by the thread if the store could not answer then: until it does,
        a key's new messages may overtake rows an earlier process left (logged once).
        """
        try:
            keys = self._store.pending_keys()
        except StoreError as exc:
            if report:
                log.warning(
                    "outbox: cannot read which keys have messages in the outbox (retrying); until then "
                    "new messages of those keys may overtake them: %s", exc,
                )
            return False
        with self.lock:
            self.pending |= keys
        return True

    def _watch(self) -> None:
        """Release keys whose backlog is delivered (the `outbox-keys` thread).

        Woken early when this process's drain delivers a pending key's row, and at least every
        `WATCH_EVERY` seconds for rows delivered by anyone else (`outbox drain`, a sidecar with
        `drain_workers=0`, another producer of a PostgreSQL fleet). The drain workers never wait
        for a check: it flushes the writer first, and a drain worker that waited for the writer's
        commit spent 18 % of its time there (recovery profile, 10 % of R0).
        """
        failing = False
        rest = RELEASE_EVERY
        while not self._stop.wait(rest):  # at least `rest` between two checks
            self._drained.wait(WATCH_EVERY - rest)
            self._drained.clear()
            if self._stop.is_set():
                return
            if not self._loaded:
                self._loaded = self._load(report=False)
            if not self.pending or not self._may_check():
                continue
            try:
                started = time.monotonic()
                with self.lock:
                    keys = set(self.pending)
                self.release_delivered(keys)
                # At most a tenth of a thread's time: with very many keys one check takes long.
                rest = max(RELEASE_EVERY, 10 * (time.monotonic() - started))
                failing = False
            except StoreError as exc:  # looked at again next round; logged once per failing spell
                if not failing:
                    log.warning("outbox: cannot check which keys still have messages in the outbox: %s", exc)
                failing = True
            except Exception:  # never die silently: the next round tries again
                log.exception("outbox key watcher failed; retrying")
