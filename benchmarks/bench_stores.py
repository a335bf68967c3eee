"""Enqueue and drain rates of the outbox stores: SQLite vs PostgreSQL on this machine.

Standalone (not collected by pytest):

    python benchmarks/bench_stores.py                 # 50,000 rows, 3 interleaved repetitions
    python benchmarks/bench_stores.py --quick         # 10,000 rows, 2 repetitions
    python benchmarks/bench_stores.py --postgres postgresql://u:p@host:5432/db

What is measured, per store:
    enqueue   rows/s, `Outbox.enqueue` in batches of 1,000 (one transaction per batch: the
              producer's group commit), 200-byte values, 16-byte keys over 100 keys, 2 headers.
    drain     rows/s of `claim(limit=--claim)` + `mark_delivered` of every claimed row until the
              store is empty (one process; no Kafka, so this is the store's own cost).
Each also with this process's CPU µs per row (a PostgreSQL server's CPU is not in it; SQLite's
is, as it runs in the process).
Repetitions are interleaved (SQLite, PostgreSQL, SQLite, ...) so that drift of the shared machine
hits both; each figure is the median. PostgreSQL runs in a fresh schema that is dropped at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from outbox.records import NewMessage  # noqa: E402
from outbox.stores.base import Outbox  # noqa: E402
from outbox.stores.sqlite import SQLiteOutbox  # noqa: E402
from outbox.stores.urls import parse_url  # noqa: E402


def messages(n: int) -> list[NewMessage]:
    value = os.urandom(200)
    return [
        NewMessage(
            topic="bench",
            value=value,
            key=f"key-{i % 100:012d}".encode(),
            headers=[("outbox-id", os.urandom(16)), ("trace", b"abc")],
            msg_id=str(i),
        )
        for i in range(n)
    ]


Rates = tuple[float, float, float, float]  # enqueue rows/s, CPU µs/row; drain rows/s, CPU µs/row


def bench_once(store: Outbox, msgs: list[NewMessage], claim: int) -> Rates:
    n = len(msgs)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, n, 1000):
        store.enqueue(msgs[i : i + 1000])
    enqueue, enqueue_cpu = n / (time.perf_counter() - t0), (time.process_time() - c0) / n * 1e6

    t0, c0 = time.perf_counter(), time.process_time()
    drained = 0
    while True:
        rows = store.claim("bench", claim, 60.0, now=time.time())
        if not rows:
            break
        drained += store.mark_delivered([r.id for r in rows])
    drain, drain_cpu = drained / (time.perf_counter() - t0), (time.process_time() - c0) / n * 1e6
    if drained != n:
        raise SystemExit(f"drained {drained} of {n} rows: the store kept some")
    return enqueue, enqueue_cpu, drain, drain_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--claim", type=int, default=500, help="rows per claim (default 500)")
    ap.add_argument("--quick", action="store_true", help="10,000 rows, 2 repetitions")
    ap.add_argument("--postgres", help="PostgreSQL URL (default: the test harness's server)")
    ap.add_argument("--sqlite-sync", default="FULL", choices=["FULL", "NORMAL"])
    args = ap.parse_args()
    if args.quick:
        args.rows, args.reps = 10_000, 2

    from outbox.stores.postgres import PostgresOutbox

    if not args.postgres:
        from outbox.testing.postgres import ensure_server

        args.postgres = ensure_server()
    base = parse_url(args.postgres)
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    tmp = tempfile.TemporaryDirectory()
    counter = iter(range(10**6))

    def sqlite() -> Outbox:
        return SQLiteOutbox(os.path.join(tmp.name, f"b{next(counter)}.db"), synchronous=args.sqlite_sync)

    def postgres() -> Outbox:
        return PostgresOutbox(dataclasses.replace(base, schema=schema, table=f"b{next(counter)}"))

    backends: dict[str, Callable[[], Outbox]] = {"sqlite": sqlite, "postgresql": postgres}
    results: dict[str, list[Rates]] = {name: [] for name in backends}
    msgs = messages(args.rows)
    print(
        f"{args.rows:,} rows x {args.reps} interleaved reps; claim {args.claim}; "
        f"SQLite synchronous={args.sqlite_sync}; PostgreSQL {base.where()}",
        flush=True,
    )
    try:
        for rep in range(args.reps):
            for name, make in backends.items():
                with make() as store:
                    r = bench_once(store, msgs, args.claim)
                results[name].append(r)
                print(
                    f"  rep {rep + 1} {name:<10} enqueue {r[0]:>10,.0f}/s {r[1]:5.1f} µs  "
                    f"drain {r[2]:>10,.0f}/s {r[3]:5.1f} µs",
                    flush=True,
                )
    finally:
        import psycopg

        kwargs: dict[str, Any] = dict(base.psycopg_kwargs())
        with psycopg.connect(**kwargs, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        tmp.cleanup()

    med = {n: [statistics.median(r[i] for r in rs) for i in range(4)] for n, rs in results.items()}
    print()
    print(f"{'store':<12}{'enqueue rows/s':>16}{'CPU µs/row':>12}{'claim+deliver rows/s':>22}{'CPU µs/row':>12}")
    for name, (enq, enq_cpu, drain, drain_cpu) in med.items():
        print(f"{name:<12}{enq:>16,.0f}{enq_cpu:>12.1f}{drain:>22,.0f}{drain_cpu:>12.1f}")
    ratio_e = med["postgresql"][0] / med["sqlite"][0]
    ratio_d = med["postgresql"][2] / med["sqlite"][2]
    print(f"{'PG/SQLite':<12}{ratio_e:>16.2f}{'':>12}{ratio_d:>22.2f}")


if __name__ == "__main__":
    main()
