"""One drainer process of the fleet tests (tests/integration/test_postgres_fleet.py, and the MySQL
one in tests/integration/test_mysql_store.py), on the outbox its URL names.

Run as a script: ``python fleet_worker.py <outbox url> <bootstrap> <report path>``. It drains the
shared outbox in follow mode until the outbox has had no pending row for 2 s, then writes a JSON
report: the outbox-ids Kafka acknowledged to *this* process, its `DrainResult` counts, and the
time of each settled batch. ``FLEET_MESSAGE_TIMEOUT_MS`` overrides message.timeout.ms (10000).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence

from outbox import Drainer, DrainResult, Listener, RetryPolicy, open_outbox
from outbox.events import Drained
from outbox.stores import Outbox

EMPTY_FOR = 2.0  # seconds without a pending row before the worker stops


def _stop_when_empty(store: Outbox, stop: threading.Event) -> None:
    empty_since: float | None = None
    while not stop.is_set():
        if store.stats(now=time.time()).pending:
            empty_since = None
        elif empty_since is None:
            empty_since = time.monotonic()
        elif time.monotonic() - empty_since >= EMPTY_FOR:
            stop.set()
            return
        time.sleep(0.25)


def main(url: str, bootstrap: str, report: str) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    acked: list[str] = []
    acked_batches = 0

    class Acked(Listener):
        def delivered(self, rows: Sequence[Drained]) -> None:
            nonlocal acked_batches
            acked_batches += 1
            acked.extend(r.msg_id for r in rows)

    store = open_outbox(url, create=False)
    drainer = Drainer(
        store,
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "message.timeout.ms": int(os.environ.get("FLEET_MESSAGE_TIMEOUT_MS", "10000")),
        },
        retry=RetryPolicy(max_attempts=100, initial_delay=0.5),
        batch_size=1000,
        lease_seconds=20,
    )
    drainer.subscribe(Acked())
    settled: list[tuple[float, int]] = []  # (wall clock, delivered so far) after each batch

    def progress(result: DrainResult) -> None:
        settled.append((time.time(), result.delivered))

    stop = threading.Event()
    threading.Thread(target=_stop_when_empty, args=(store, stop), daemon=True).start()
    started = time.monotonic()
    result = drainer.run(until_empty=False, stop=stop, progress=progress)
    elapsed = time.monotonic() - started
    store.close()
    with open(report, "w") as f:
        json.dump(
            {
                "acked": acked,
                "acked_batches": acked_batches,
                "delivered": result.delivered,
                "retried": result.retried,
                "dead": result.dead,
                "released": result.released,
                "seconds": elapsed,
                "settled": settled,
            },
            f,
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
