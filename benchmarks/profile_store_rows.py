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

What if (not the product): the same messages stored several to a row, the design proposed in
docs/DESIGN.md. A prototype codec packs each writer batch's messages into one row (the encoded
messages back to back, the batch's distinct keys in a side column for the per-key rule); the drain
side reads the rows in id order, decodes every message and deletes the rows. Its cost per message
is the floor that design can reach in the store, against today's spill + drain.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from outbox import SQLiteOutbox  # noqa: E402
from outbox.records import NewMessage, Status  # noqa: E402
from outbox.stores.base import COLUMNS, Settlement, insert_values  # noqa: E402
from outbox.stores.codec import decode_headers, encode_headers  # noqa: E402
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


_FIXED = struct.Struct(">iiiiiid")  # lengths of topic, key, value, headers, msg_id; partition; created_at


def _pack(msgs: list[NewMessage], now: float) -> tuple[bytes, bytes]:
    """A prototype group codec: (encoded messages, the distinct keys, NUL-separated)."""
    parts: list[bytes] = []
    for m in msgs:
        t, k, v, i = m.topic.encode(), m.key or b"", m.value or b"", m.msg_id.encode()
        h = encode_headers(m.headers) or b""
        parts += (_FIXED.pack(len(t), len(k), len(v), len(h), len(i), m.partition, now), t, k, v, h, i)
    return b"".join(parts), b"\0".join({m.key or b"" for m in msgs})


def _unpack(body: bytes) -> list[tuple[str, bytes, bytes, list[tuple[str, bytes | None]], str, int, float]]:
    out = []
    pos, end, size, unpack = 0, len(body), _FIXED.size, _FIXED.unpack_from
    while pos < end:
        lt, lk, lv, lh, li, part, created = unpack(body, pos)
        pos += size
        t = body[pos : pos + lt].decode()
        pos += lt
        k = body[pos : pos + lk]
        pos += lk
        v = body[pos : pos + lv]
        pos += lv
        h = decode_headers(body[pos : pos + lh])
        pos += lh
        out.append((t, k, v, h, body[pos : pos + li].decode(), part, created))
        pos += li
    return out


def grouped_costs(path: str, msgs: list[NewMessage], per_row: int) -> dict[str, float]:
    """Encode + insert, then select + decode + delete, `per_row` messages to a row (plain sqlite3)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute(
        "CREATE TABLE grouped (id INTEGER PRIMARY KEY AUTOINCREMENT, status INTEGER NOT NULL DEFAULT 0, "
        "next_attempt_at REAL NOT NULL DEFAULT 0, lease_owner TEXT, keys BLOB, body BLOB)"
    )
    conn.execute("CREATE INDEX grouped_due ON grouped (status, next_attempt_at)")
    t = time.thread_time()
    for i in range(0, len(msgs), BATCH):
        batch = msgs[i : i + BATCH]
        now = time.time()
        rows = [_pack(batch[j : j + per_row], now) for j in range(0, len(batch), per_row)]
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO grouped (body, keys) VALUES (?, ?)", rows)
        conn.execute("COMMIT")
    spent_insert = time.thread_time() - t
    t = time.thread_time()
    decoded, take = 0, max(1, BATCH // per_row)
    while True:
        conn.execute("BEGIN IMMEDIATE")
        got = conn.execute(
            "SELECT id, keys, body FROM grouped WHERE status = 0 AND next_attempt_at <= ? ORDER BY id LIMIT ?",
            (time.time(), take),
        ).fetchall()
        if got:
            conn.execute(
                "UPDATE grouped SET lease_owner = 'p', next_attempt_at = ? WHERE id BETWEEN ? AND ?",
                (time.time() + 120, got[0][0], got[-1][0]),
            )
        conn.execute("COMMIT")
        if not got:
            break
        for _, _, body in got:
            decoded += len(_unpack(body))
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM grouped WHERE id BETWEEN ? AND ?", (got[0][0], got[-1][0]))
        conn.execute("COMMIT")
    spent_drain = time.thread_time() - t
    conn.close()
    assert decoded == len(msgs), (decoded, len(msgs))
    return {"insert": spent_insert / len(msgs) * 1e6, "drain": spent_drain / len(msgs) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--per-row", type=int, default=500, help="messages per row in the what-if (default 500)")
    args = ap.parse_args()
    msgs = messages(args.rows)
    store_runs: list[dict[str, float]] = []
    raw_runs: list[dict[str, float]] = []
    grouped_runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="outbox-rows-") as workdir:
        for rep in range(args.reps):  # interleaved, so drift of a shared machine hits both
            store_runs.append(store_costs(fresh(workdir, "store"), msgs))
            raw_runs.append(raw_costs(fresh(workdir, "raw"), msgs))
            grouped_runs.append(grouped_costs(os.path.join(workdir, f"grouped-{rep}.db"), msgs, args.per_row))

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
    g_ins, g_drain = med(grouped_runs, "insert"), med(grouped_runs, "drain")
    print(f"  what if {args.per_row} messages to a row (prototype codec, plain sqlite3; per message):")
    print(f"    encode + insert                  {g_ins:6.1f}   {g_ins / ins:4.2f} x enqueue")
    print(f"    claim + decode + delete          {g_drain:6.1f}   {g_drain / (claim + delete):4.2f} x claim + delete")
    today = ins + claim + delete
    print(f"    spill + drain                    {g_ins + g_drain:6.1f}   {(g_ins + g_drain) / today:4.2f} x today")


if __name__ == "__main__":
    main()
