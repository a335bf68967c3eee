"""Every worker of a drain run until empty takes part, not only the first to claim."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, cast

from outbox import Drainer, Listener, NewMessage, SQLiteOutbox
from outbox.stores.base import Outbox

from .delivery import read_topic


class FirstClaimOfSecondThreadLost:
    """The real store, except that the second thread to claim finds nothing the first time.

    That is what a claim returns when another worker leased the rows it chose first (two claims
    read one snapshot), which happens at random when a run's workers start together.
    """

    def __init__(self, store: SQLiteOutbox) -> None:
        self._store = store
        self._threads: list[str] = []
        self._lock = threading.Lock()

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        me = threading.current_thread().name
        with self._lock:
            first_time = me not in self._threads
            if first_time:
                self._threads.append(me)
            lose = first_time and len(self._threads) == 2
        return [] if lose else self._store.claim(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_worker_whose_claim_lost_the_race_stays_in_the_run(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    # A worker of a run until empty used to end at its first empty claim, leaving the run to the
    # other one. Here the first worker to deliver a batch waits in its delivered listener until a second
    # thread has delivered one: with a single worker left, it waits out the 60 s given to the
    # whole run, which then ends with one thread seen.
    total = 8000
    store = SQLiteOutbox(str(tmp_path / "o.db"))
    store.enqueue(
        [NewMessage(topic, b"v%d" % i, None, [("outbox-id", b"m%d" % i)], -1, f"m{i}") for i in range(total)]
    )
    threads: set[str] = set()
    both = threading.Event()
    lock = threading.Lock()
    give_up_at = time.monotonic() + 60

    class WaitForBoth(Listener):
        def delivered(self, rows: object) -> None:
            with lock:
                threads.add(threading.current_thread().name)
                if len(threads) == 2:
                    both.set()
            both.wait(max(0.0, give_up_at - time.monotonic()))

    drainer = Drainer(cast(Outbox, FirstClaimOfSecondThreadLost(store)), {"bootstrap.servers": kafka_bootstrap},
                      workers=2, batch_size=1000)
    drainer.subscribe(WaitForBoth())
    result = drainer.run(until_empty=True)

    assert len(threads) == 2, f"only {sorted(threads)} delivered"
    assert (result.delivered, result.remaining) == (total, 0)
    assert read_topic(kafka_bootstrap, topic, total).unique == total
