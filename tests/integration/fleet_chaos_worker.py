"""One process of the fleet chaos test (tests/integration/test_fleet_chaos.py).

    python fleet_chaos_worker.py produce BOOTSTRAP TOPIC NAME SECONDS RATE REPORT
    python fleet_chaos_worker.py drain BOOTSTRAP REPORT          (until SIGTERM)

`produce`: a ResilientProducer on the shared PostgreSQL outbox (one drain worker of its own)
calls produce() about RATE times a second for SECONDS, then closes; the report lists the
outbox-id of every produce() call that returned, the text of every one that raised, and the
producer's counters. `drain`: a standalone Drainer in follow mode, as `outbox drain --follow`
runs it, until SIGTERM; the report holds its counts. The outbox URL comes from OUTBOX_URL (it
has a password: never on a command line).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

from outbox import Drainer, ResilientProducer, RetryPolicy, parse_url
from outbox.stores.postgres import PostgresOutbox

KAFKA = {"acks": "all", "enable.idempotence": True, "message.timeout.ms": 5000}
RETRY = RetryPolicy(max_attempts=10_000, initial_delay=0.5, max_delay=2.0)


def produce(bootstrap: str, topic: str, name: str, seconds: float, rate: float, report: str) -> None:
    returned: list[str] = []
    errors: list[str] = []
    p = ResilientProducer(
        {"bootstrap.servers": bootstrap, **KAFKA},
        outbox=os.environ["OUTBOX_URL"], drain_workers=1, drain_poll_interval=0.2,
        circuit_reset_timeout=2.0, retry=RETRY,
    )
    started = time.monotonic()
    i = 0
    while (elapsed := time.monotonic() - started) < seconds:
        try:
            returned.append(p.produce(topic, f"{name}:{i}".encode(), key=f"{name}-k{i % 16}".encode()))
        except Exception as exc:  # the test reports what produce() raised, if anything
            errors.append(f"{type(exc).__name__}: {exc}")
        i += 1
        ahead = i / rate - elapsed
        if ahead > 0:
            time.sleep(ahead)
    stats = p.stats()
    unsafe = p.flush(60)  # what is neither delivered nor committed to the outbox
    p.close(timeout=60)
    with open(report, "w") as f:
        json.dump({"returned": returned, "errors": errors, "unsafe_at_close": unsafe,
                   "stats": {k: v for k, v in stats.items() if isinstance(v, int | float | str | None)}}, f)


def drain(bootstrap: str, report: str) -> None:
    store = PostgresOutbox(parse_url(os.environ["OUTBOX_URL"]), create=False)
    drainer = Drainer(store, {"bootstrap.servers": bootstrap, **KAFKA}, retry=RETRY, lease_seconds=30,
                      poll_interval=0.2)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    result = drainer.run(until_empty=False, stop=stop)
    store.close()
    with open(report, "w") as f:
        json.dump({"delivered": result.delivered, "retried": result.retried, "dead": result.dead,
                   "store_errors": drainer.health.store_errors}, f)


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if argv[0] == "produce":
        _, bootstrap, topic, name, seconds, rate, report = argv
        produce(bootstrap, topic, name, float(seconds), float(rate), report)
    else:
        _, bootstrap, report = argv
        drain(bootstrap, report)


if __name__ == "__main__":
    main(sys.argv[1:])
