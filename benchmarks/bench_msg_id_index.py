"""What a full `msg_id` index would cost the producer's spill path: SQLite `enqueue` of 1,000-row
batches into a version-3 outbox (whose trace index covers dead rows only), with a full
`(msg_id)` index added (set-up only) and without, interleaved.

    .venv/bin/python -m benchmarks.bench_msg_id_index [--messages 100000] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import time
import uuid

from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n, batch = args.messages, 1000
    rows = [NewMessage("orders", b"x" * 200, key=b"k-%d" % i, msg_id=uuid.uuid4().hex) for i in range(n)]
    tmp = tempfile.TemporaryDirectory()
    res: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
    for rep in range(args.reps):
        for mode in ("with", "without"):
            path = os.path.join(tmp.name, f"{mode}-{rep}.db")
            store = SQLiteOutbox(path)
            if mode == "with":  # the shipped schema indexes dead rows only; "with" adds a full index
                with sqlite3.connect(path) as c:
                    c.execute("CREATE INDEX outbox_msg_id_full ON outbox (msg_id)")
            wall, cpu = time.perf_counter(), time.process_time()
            for i in range(0, n, batch):
                store.enqueue(rows[i : i + batch])
            res[mode].append(((time.perf_counter() - wall) / n * 1e6, (time.process_time() - cpu) / n * 1e6))
            store.close()
    for mode, v in res.items():
        print(f"{mode:8} index: wall {statistics.median(x[0] for x in v):6.2f} µs/msg, "
              f"CPU {statistics.median(x[1] for x in v):6.2f} µs/msg")
    pairs = list(zip(res["with"], res["without"], strict=True))
    print(f"ratio with/without (median of paired runs): wall {statistics.median(a[0] / b[0] for a, b in pairs):.2f}, "
          f"CPU {statistics.median(a[1] / b[1] for a, b in pairs):.2f}")


if __name__ == "__main__":
    main()
