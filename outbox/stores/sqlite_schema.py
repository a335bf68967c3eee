"""The SQLite outbox's tables: their layout (the column lists its statements share) and the
versioned migrations that create and upgrade them (`PRAGMA user_version`)."""

from __future__ import annotations

import sqlite3

from outbox.stores import grouped
from outbox.stores.base import COLUMNS, INSERT_COLUMNS

SCHEMA_VERSION = 7

#: The statement that writes one row (`insert_values` order); benchmarks time it as their baseline.
INSERT_SQL = f"INSERT INTO outbox ({', '.join(INSERT_COLUMNS)}) VALUES ({','.join('?' * len(INSERT_COLUMNS))})"
#: The same with the key id last (`outbox.stores.sealed.seal_values`): an encrypted row.
SEALED_INSERT_SQL = INSERT_SQL.replace(") VALUES (", ", enc_key) VALUES (?,")
#: Both with the id given first (a group's messages exploded into rows of their own ids).
INSERT_WITH_ID_SQL = INSERT_SQL.replace("outbox (", "outbox (id, ").replace("VALUES (", "VALUES (?,")
SEALED_INSERT_WITH_ID_SQL = SEALED_INSERT_SQL.replace("outbox (", "outbox (id, ").replace("VALUES (", "VALUES (?,")

MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE IF NOT EXISTS outbox (
            id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: ids order a key's messages
            msg_id TEXT NOT NULL,
            topic TEXT NOT NULL,
            key BLOB,
            value BLOB,
            headers BLOB,
            partition INTEGER NOT NULL DEFAULT -1,
            status INTEGER NOT NULL DEFAULT 0,
            attempts INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL,
            first_failed_at REAL,
            last_failed_at REAL,
            next_attempt_at REAL NOT NULL DEFAULT 0,
            last_error TEXT,
            lease_owner TEXT
        )""",
        "CREATE INDEX IF NOT EXISTS outbox_due ON outbox (status, next_attempt_at)",
        "CREATE INDEX IF NOT EXISTS outbox_key ON outbox (topic, key, id)",
    ]
}

# Version 3 (the console): dead-letter filters walk small partial indexes in id order (keyset
# pages), a trace finds a message's rows by its outbox-id, and operator actions are audited here,
# in the store itself (same file permissions and backups as the dead letters they describe).
# Partial indexes (WHERE status = 2) cost the producer nothing: pending rows are not in them.
MIGRATIONS[3] = [
    # Dead rows only: a full msg_id index made every spilled message's enqueue cost over a third
    # more CPU, on the path recovery speed depends on. Pending rows are the backlog, gone once
    # drained; trace() scans those.
    "CREATE INDEX IF NOT EXISTS outbox_dead_msg_id ON outbox (msg_id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead ON outbox (id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_topic ON outbox (topic, id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_error_name ON outbox (error_name, id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_error_code ON outbox (error_code, id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_key ON outbox (key, id) WHERE status = 2",
    "CREATE INDEX IF NOT EXISTS outbox_dead_failed ON outbox (last_failed_at) WHERE status = 2",
    """CREATE TABLE IF NOT EXISTS outbox_audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        who TEXT NOT NULL,
        action TEXT NOT NULL,
        filter TEXT NOT NULL,
        count INTEGER NOT NULL
    )""",
]

# Version 4: several messages to a row (`outbox.stores.grouped`). A one-message row has n = 1 and
# no body; the partial index lists the groups (few: one per writer batch), with what stats() and
# the id lookups need, so neither reads a body.
MIGRATIONS[4] = [
    "ALTER TABLE outbox ADD COLUMN n INTEGER NOT NULL DEFAULT 1",
    "ALTER TABLE outbox ADD COLUMN body BLOB",
    "ALTER TABLE outbox ADD COLUMN keys BLOB",
    "CREATE INDEX IF NOT EXISTS outbox_group ON outbox (id, topic, n) WHERE body IS NOT NULL",
]

# Version 5: a group's body and keys live in a table of their own, one row per group. A lease
# changes the size of the `outbox` row (lease_owner NULL -> text), and SQLite then rewrites the
# whole record, overflow pages included: every claim and release of a 1,000-message group wrote
# its whole body again, dozens of pages where a same-size update writes one. Groups are the
# `outbox` rows with n > 1; a trigger deletes a group's body with its row.
MIGRATIONS[5] = [
    """CREATE TABLE IF NOT EXISTS outbox_body (
        id INTEGER PRIMARY KEY,  -- the group's id in outbox
        body BLOB NOT NULL,  -- its messages (outbox.stores.grouped)
        keys BLOB  -- its distinct keys, NULL without any
    )""",
    "INSERT INTO outbox_body (id, body, keys) SELECT id, body, keys FROM outbox WHERE body IS NOT NULL",
    "DROP INDEX IF EXISTS outbox_group",
    "ALTER TABLE outbox DROP COLUMN body",
    "ALTER TABLE outbox DROP COLUMN keys",
    "CREATE INDEX IF NOT EXISTS outbox_group ON outbox (id, topic, n) WHERE n > 1",
    """CREATE TRIGGER IF NOT EXISTS outbox_body_gone AFTER DELETE ON outbox WHEN OLD.n > 1
    BEGIN DELETE FROM outbox_body WHERE id = OLD.id; END""",
]


# Version 7: the id of the key a row's payload is encrypted with (`outbox.stores.sealed`); NULL
# for a row in clear, what every row written without encryption has. No index: only a key
# rotation looks for it, walking the rows in id order a batch at a time.
MIGRATIONS[7] = ["ALTER TABLE outbox ADD COLUMN enc_key TEXT"]


def migrate_to_6(conn: sqlite3.Connection) -> None:
    """Version 6: the record timestamp (ms; 0: unknown, what every row stored before has) as a
    column, and in each message of a group body (`grouped.upgrade_v5` rewrites the bodies)."""
    # BIGINT, INTEGER affinity: a 64-bit integer (the Spark job reads it through JDBC as a long).
    conn.execute("ALTER TABLE outbox ADD COLUMN timestamp BIGINT NOT NULL DEFAULT 0")
    last = 0
    while True:  # a few bodies at a time: a backlog's bodies need not fit in memory at once
        bodies = conn.execute(
            "SELECT id, body FROM outbox_body WHERE id > ? ORDER BY id LIMIT 64", (last,)
        ).fetchall()
        if not bodies:
            return
        conn.executemany(
            "UPDATE outbox_body SET body = ? WHERE id = ?", [(grouped.upgrade_v5(body), gid) for gid, body in bodies]
        )
        last = bodies[-1][0]


#: A group's columns as `_group_messages` reads them (`outbox` as o, `outbox_body` as b).
GROUP = "o.id, o.topic, o.created_at, o.next_attempt_at, o.n, b.body, o.enc_key"
#: A row's columns as `row_from_columns` reads them, then the id of its encryption key.
ROW = f"{COLUMNS}, enc_key"
#: A claim's candidate: the row's columns and key id, then n, body and keys (NULL for a one-message row).
CANDIDATE = ", ".join(f"o.{c.strip()}" for c in ROW.split(",")) + ", o.n, b.body, b.keys"
#: Where a candidate holds n, body and keys.
N = len(ROW.split(","))
BODY, KEYS = N + 1, N + 2
#: A group row with its body and keys.
GROUPS = "outbox AS o INDEXED BY outbox_group JOIN outbox_body AS b ON b.id = o.id"
#: Every column a row has, in the order `_recreate` copies them.
ALL_COLUMNS = f"{ROW}, lease_owner, n"
ALL_PLACES = ",".join("?" * len(ALL_COLUMNS.split(",")))

#: Version 2: the error as code and name columns (filters and stats read them, never the text).
ERROR_COLUMNS = ("error_code", "error_name")


#: A new file's `outbox` table: version 1's with version 2's error columns already beside
#: `last_error`, so that creating an outbox never needs `migrate_to_2`'s copy-and-swap (nor
#: sqlite-utils, which imports pandas when it is installed: about 90 MB in every producer's
#: process, for a table that has no rows yet).
NEW_TABLE = MIGRATIONS[1][0].replace(
    "last_error TEXT,", "last_error TEXT,\n            error_code INTEGER,\n            error_name TEXT,"
)


def migrate_to_2(conn: sqlite3.Connection) -> None:
    """Add error_code/error_name beside last_error and fill them from the stored text.

    Runs inside the caller's BEGIN IMMEDIATE. A file written by version 1 needs schema work,
    which sqlite-utils does: `add_column` (an ALTER TABLE) and `transform()` for the
    copy-and-swap that puts the new columns beside `last_error`, which ALTER TABLE cannot do;
    transform keeps AUTOINCREMENT and the indexes, and its savepoint nests in our transaction.
    The last-issued id is kept so ids are never reused. A new file has them already (`NEW_TABLE`).
    """
    columns = _column_names(conn)
    if columns != _with_error_columns(columns):
        _add_error_columns(conn)
    # The one place the old text form is parsed: "NAME (code): reason", written by version 1.
    conn.execute(
        "UPDATE outbox SET "
        "error_name = substr(last_error, 1, instr(last_error, ' (') - 1), "
        "error_code = CAST(substr(last_error, instr(last_error, ' (') + 2, "
        "instr(last_error, '):') - instr(last_error, ' (') - 2) AS INTEGER) "
        "WHERE last_error IS NOT NULL AND error_code IS NULL "
        "AND instr(last_error, ' (') > 0 AND instr(last_error, '):') > instr(last_error, ' (')"
    )


def _column_names(conn: sqlite3.Connection) -> list[str]:
    return [row[1] for row in conn.execute("PRAGMA table_info(outbox)")]


def _with_error_columns(columns: list[str]) -> list[str]:
    """`columns` as version 2 orders them: the error columns right after `last_error`."""
    order = [c for c in columns if c not in ERROR_COLUMNS]
    at = order.index("last_error") + 1
    order[at:at] = list(ERROR_COLUMNS)
    return order


def _add_error_columns(conn: sqlite3.Connection) -> None:
    """A version-1 file: add the error columns and move them beside `last_error`."""
    import sqlite_utils  # only needed once per version-1 outbox file, when it is upgraded

    db = sqlite_utils.Database(conn, execute_plugins=False)
    table = db.table("outbox")
    columns = table.columns_dict
    for name, kind in (("error_code", int), ("error_name", str)):
        if name not in columns:
            table.add_column(name, kind)
    order = _with_error_columns(list(table.columns_dict))
    if list(table.columns_dict) != order:
        seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
        table.transform(column_order=order)
        if seq is not None:
            conn.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'outbox'", (seq[0],))


def migrate_in(c: sqlite3.Connection, version: int) -> None:
    """From `version` to SCHEMA_VERSION, inside the caller's write transaction."""
    for v in range(version + 1, SCHEMA_VERSION + 1):
        if v == 1:
            c.execute(NEW_TABLE)
            for stmt in MIGRATIONS[1][1:]:
                c.execute(stmt)
            continue
        if v == 2:
            migrate_to_2(c)
            continue
        if v == 6:
            migrate_to_6(c)
            continue
        for stmt in MIGRATIONS[v]:
            c.execute(stmt)
    c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
