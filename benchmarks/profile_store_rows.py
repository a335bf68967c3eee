"""What one outbox row costs in SQLite: CPU µs per row of insert, claim and delete.

Standalone (not collected by pytest):

    python benchmarks/profile_store_rows.py              # 200,000 rows, 3 repetitions
    python benchmarks/profile_store_rows.py --rows 50000 --reps 1

The outbox path of a message during recovery is one insert (the spill), one claim and one delete
(the drain). Each is timed with this thread's CPU time (SQLite runs in the calling thread), the
way the drain uses them: batches of 5,000, 1,000 keys, 200-byte values, the id header, two
batches leased at a time. Baselines in the same run, on the same schema and the same row tuples:
plain `sqlite3` executemany of the rows, and a plain SELECT of 5,000 rows plus a DELETE by id
range. Medians of the repetitions; the ratio says how many times the baseline the store costs.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from outbox import SQLiteOutbox  # noqa: E402
from outbox.records import NewMessage, Status  # noqa: E402
from outbox.stores.base import COLUMNS, Settlement, insert_values  # noqa: E402
from outbox.stores.sqlite import INSERT_SQL  # noqa: E402

BATCH = 5000


def messages(n: int) -> list[NewMessage]:
    value = os.urandom(200)
    return [
        NewMessage("bench", value, b"key-%04d" % (i % 1000), [("outbox-id", b"%032x" % i)], -1, f"m{i}")
        for i in range(n)
    ]


def fresh(workdir: str, name: str) -> str:
    path = os.path.join(workdir, f"{name}.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    SQLiteOutbox(path).close()  # the outbox schema
    return path


def store_costs(path: str, msgs: list[NewMessage]) -> dict[str, float]:
    store = SQLiteOutbox(path)
    spent = {"insert": 0.0, "claim": 0.0, "delete": 0.0}
    t = time.thread_time()
    for i in range(0, len(msgs), BATCH):
        store.enqueue(msgs[i : i + BATCH])
    spent["insert"] = time.thread_time() - t
    leased: list[list[int]] = []
    while True:
        t = time.thread_time()
        rows = store.claim("profile", BATCH, 120.0, now=time.time())
        spent["claim"] += time.thread_time() - t
        if rows:
            leased.append([r.id for r in rows])
        if leased and (len(leased) == 2 or not rows):  # a drain worker keeps two batches in flight
            t = time.thread_time()
            store.apply(Settlement(delivered=leased.pop(0)), now=time.time())
            spent["delete"] += time.thread_time() - t
        elif not rows:
            break
    store.close()
    return {k: v / len(msgs) * 1e6 for k, v in spent.items()}


def raw_costs(path: str, msgs: list[NewMessage]) -> dict[str, float]:
    now = time.time()
    rows = [insert_values(m, Status.PENDING, None, None, now) for m in msgs]  # built outside the timing
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    t = time.thread_time()
    for i in range(0, len(rows), BATCH):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(INSERT_SQL, rows[i : i + BATCH])
        conn.execute("COMMIT")
    spent_insert = time.thread_time() - t
    t = time.thread_time()
    last = 0
    while True:
        got = conn.execute(f"SELECT {COLUMNS} FROM outbox WHERE id > ? ORDER BY id LIMIT ?", (last, BATCH)).fetchall()
        if not got:
            break
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM outbox WHERE id BETWEEN ? AND ?", (got[0][0], got[-1][0]))
        conn.execute("COMMIT")
        last = got[-1][0]
    spent_drain = time.thread_time() - t
    conn.close()
    return {"insert": spent_insert / len(msgs) * 1e6, "select+delete": spent_drain / len(msgs) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    msgs = messages(args.rows)
    store_runs: list[dict[str, float]] = []
    raw_runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="outbox-rows-") as workdir:
        for _ in range(args.reps):  # interleaved, so drift of a shared machine hits both
            store_runs.append(store_costs(fresh(workdir, "store"), msgs))
            raw_runs.append(raw_costs(fresh(workdir, "raw"), msgs))

    def med(runs: list[dict[str, float]], k: str) -> float:
        return statistics.median(r[k] for r in runs)

    raw_insert, raw_drain = med(raw_runs, "insert"), med(raw_runs, "select+delete")
    ins, claim, delete = med(store_runs, "insert"), med(store_runs, "claim"), med(store_runs, "delete")
    print(f"{args.rows:,} rows, 1,000 keys, 200 B, batches of {BATCH:,}; CPU µs per row, medians of {args.reps}")
    print(f"  raw sqlite3 executemany            {raw_insert:6.1f}   baseline")
    print(f"  raw SELECT + DELETE by id range    {raw_drain:6.1f}   baseline")
    print(f"  SQLiteOutbox.enqueue (spill)       {ins:6.1f}   {ins / raw_insert:4.2f} x raw insert")
    print(f"  SQLiteOutbox.claim (lease)         {claim:6.1f}")
    print(f"  SQLiteOutbox.apply (delete)        {delete:6.1f}")
    print(f"  claim + delete (drain's store part) {claim + delete:5.1f}   {(claim + delete) / raw_drain:4.2f} x raw")
    print(f"  spill + drain, store only          {ins + claim + delete:6.1f}")


if __name__ == "__main__":
    main()
