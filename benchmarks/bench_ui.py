"""The console's latency with a million dead letters: list page and JSON API, SQLite and
PostgreSQL, several filters, deep keyset pages. Target: median under 300 ms.

    .venv/bin/python -m benchmarks.bench_ui              # 1,000,000 dead letters per store
    .venv/bin/python -m benchmarks.bench_ui --rows 100000 --reps 10 --backends sqlite
    .venv/bin/python -m benchmarks.bench_ui --postgres postgresql://u:p@host:5432/db

Public API only: the stores are filled with `Outbox.add_dead` (10,000 rows a call), the console
is `outbox.ui.create_app` served by uvicorn in a child process, and requests go over HTTP
(httpx, one keep-alive connection). The baseline, measured in the same run, is the store call
the request makes (`list_dead` with the same filter, in this process): the ratio is what HTTP,
FastAPI and the rendering add. Not a test: nothing fails on a number.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from outbox.records import DeadLetterFilter, NewMessage
from outbox.stores import Outbox, SQLiteOutbox
from outbox.stores.filters import error_filter, parse_time
from outbox.stores.urls import parse_url

ROOT = Path(__file__).resolve().parents[1]
BATCH = 10_000
DAY = 86_400.0
TOPICS = [f"orders-{i}" for i in range(20)]
ERRORS = [  # (share, code, name, text)
    (0.70, -192, "_MSG_TIMED_OUT", "_MSG_TIMED_OUT (-192): Local: Message timed out"),
    (0.20, 10, "MSG_SIZE_TOO_LARGE", "MSG_SIZE_TOO_LARGE (10): Broker: Message size too large"),
    (0.09, 29, "TOPIC_AUTHORIZATION_FAILED", "TOPIC_AUTHORIZATION_FAILED (29): Broker: Topic authorization failed"),
]
GROUP_SHARE = 0.01  # consumer dead letters of group "billing" (topic orders.billing.retry-1)

SERVE = """
import sys, uvicorn
from outbox.stores import open_outbox
from outbox.ui import create_app
store = open_outbox(sys.argv[1], create=False)
uvicorn.run(create_app(store), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
"""


def fill(store: Outbox, rows: int, now: float) -> float:
    """`rows` dead letters over the last 30 days (failure time grows with the id); returns seconds."""
    started = time.perf_counter()
    value = b'{"order": 0, "customer": "c-0000", "lines": [{"sku": "A-1", "qty": 2}], "note": "' + b"x" * 120 + b'"}'
    n = 0
    while n < rows:
        batch = []
        for i in range(n, min(rows, n + BATCH)):
            r = (i * 7919) % 100 / 100  # a fixed spread of errors, not random: the same in every run
            if r < GROUP_SHARE:
                batch.append(NewMessage("orders.billing.retry-1", value, key=b"k-%d" % (i % 10_000),
                                        msg_id=f"m-{i}", headers=[("outbox-group", b"billing")], attempts=4,
                                        error_name="builtins.ValueError",
                                        last_error="builtins.ValueError (consumer): price is not a number"))
                continue
            code, name, text = _error(r)
            batch.append(NewMessage(TOPICS[i % len(TOPICS)], value, key=b"k-%d" % (i % 10_000), msg_id=f"m-{i}",
                                    attempts=5, error_code=code, error_name=name, last_error=text))
        store.add_dead(batch, failed_at=now - 30 * DAY * (1 - n / rows))
        n += len(batch)
    return time.perf_counter() - started


def _error(r: float) -> tuple[int, str, str]:
    """The error of a row whose fixed spread value is `r` (0 <= r < 1), by the shares in ERRORS."""
    acc = GROUP_SHARE
    for share, code, name, text in ERRORS:
        acc += share
        if r < acc:
            return code, name, text
    return ERRORS[-1][1:]


def queries(rows: int) -> list[tuple[str, str]]:
    """(label, query string): first pages of several filters, and deep keyset pages."""
    deep = int(rows * 0.9)
    return [
        ("no filter", ""),
        ("error=MSG_SIZE_TOO_LARGE (20 %)", "error=MSG_SIZE_TOO_LARGE"),
        ("error + topic (0.45 %)", "error=TOPIC_AUTHORIZATION_FAILED&topic=orders-3"),
        ("group=billing (1 %)", "group=billing"),
        ("key=k-42 (0.01 %)", "key=k-42"),
        ("text=authorization (9 %)", "text=authorization"),
        ("since=3d&until=2d (3 %)", "since=3d&until=2d"),
        ("deep page: after=90 %", f"after={deep}"),
        ("deep page: error, after=90 %", f"error=MSG_SIZE_TOO_LARGE&after={deep}"),
        ("deep page: key, after=90 %", f"key=k-42&after={deep}"),
    ]


def store_filter(query: str) -> DeadLetterFilter:
    """The filter the console builds for `query` (for the in-process baseline)."""
    kw: dict[str, object] = {"limit": 51}
    for part in filter(None, query.split("&")):
        k, _, v = part.partition("=")
        if k == "error":
            kw["error"] = error_filter(v)
        elif k in ("since", "until"):
            kw[k] = parse_time(v)
        elif k == "after":
            kw["after_id"] = int(v)
        elif k == "key":
            kw["key"] = v.encode()
        else:
            kw[k] = v
    return DeadLetterFilter(**kw)  # type: ignore[arg-type]


def get(http: httpx.Client, path: str) -> None:
    """GET `path`; an error status raises."""
    http.get(path).raise_for_status()


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `reps` calls, after one unrecorded warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def serve(url: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SERVE, url, str(port)], cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(base + "/api/dead-letters?limit=1", timeout=5)
            return proc, base
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"the console did not start for {parse_url(url).redacted()}") from None
            time.sleep(0.3)


def measure(name: str, store: Outbox, url: str, rows: int, reps: int) -> list[tuple[str, str, float, float, float]]:
    proc, base = serve(url)
    out = []
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            for label, q in queries(rows):
                flt = store_filter(q)
                api = timed(functools.partial(get, http, f"/api/dead-letters?{q}"), reps)
                page = timed(functools.partial(get, http, f"/dead-letters?{q}"), reps)
                base_ms = timed(functools.partial(store.list_dead, flt), reps)
                out.append((name, label, api, page, base_ms))
                print(f"{name:10} {label:32} API {api:8.1f} ms   page {page:8.1f} ms   "
                      f"store call {base_ms:8.1f} ms   API/store {api / base_ms:5.2f}", flush=True)
            # Not in the target: the overview counts every row (stats() groups the whole table).
            stats = timed(lambda: http.get("/api/stats").raise_for_status(), max(3, reps // 3))
            overview = timed(lambda: http.get("/").raise_for_status(), max(3, reps // 3))
            base_ms = timed(lambda: store.stats(now=time.time()), max(3, reps // 3))
            print(f"{name:10} {'overview (whole-table counts)':32} API {stats:8.1f} ms   page {overview:8.1f} ms   "
                  f"store call {base_ms:8.1f} ms", flush=True)
    finally:
        proc.terminate()
        proc.wait(10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--postgres", help="PostgreSQL URL (default: the test harness's server)")
    ap.add_argument("--backends", default="sqlite,postgresql")
    args = ap.parse_args()
    now = time.time()
    results = []
    tmp = tempfile.TemporaryDirectory(prefix="bench-ui-")
    backends = args.backends.split(",")
    if "sqlite" in backends:
        path = os.path.join(tmp.name, "ui.db")
        store: Outbox = SQLiteOutbox(path, synchronous="NORMAL")
        print(f"sqlite: {args.rows:,} dead letters in {fill(store, args.rows, now):.0f} s", flush=True)
        results += measure("sqlite", store, path, args.rows, args.reps)
        store.close()
    if "postgresql" in backends:
        import psycopg

        from outbox.stores.postgres import PostgresOutbox
        from outbox.testing.postgres import create_database, drop_database, ensure_server

        server = args.postgres or ensure_server()
        url = create_database(server, prefix="bench_ui_")  # a database of its own, dropped at the end
        store = PostgresOutbox(url)
        try:
            print(f"postgresql: {args.rows:,} dead letters in {fill(store, args.rows, now):.0f} s", flush=True)
            # Set-up, not measured: planner statistics, as autovacuum would gather them after a fill.
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("ANALYZE outbox")
            results += measure("postgresql", store, url, args.rows, args.reps)
        finally:
            store.close()
            drop_database(url, server)
    worst = max(r[2] for r in results) if results else 0.0
    print(f"\nslowest API median: {worst:.1f} ms (target < 300 ms); rows per store: {args.rows:,}; reps {args.reps}")


if __name__ == "__main__":
    main()
