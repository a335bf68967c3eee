"""The PostgreSQL outbox's tables and their versioned DDL (one row per version applied in
`<table>_schema_version`)."""

from __future__ import annotations

SCHEMA_VERSION = 7

#: Table pages are filled to this percentage: a claim's lease rewrites each row it takes, and a
#: rewrite that fits in its own page is a heap-only (HOT) update, which adds no index entries.
#: A spilled page is full of rows leased together, so each needs room for a copy of itself.
FILLFACTOR = 50


# The earliest next_attempt_at of a pending row, on the ready_at index (ready_at <= next_attempt_at
# always). u: the next_attempt_at of the first row in ready_at order that is not leased
# (ready_at = next_attempt_at), found by walking the index past the leased ones. A row due
# before u has its ready_at before u too: the rest of the answer is among those, the leased few.
NEXT_DUE_SQL = (
    "SELECT LEAST(u.at, (SELECT min(next_attempt_at) FROM {t} WHERE status = 0 "
    "AND ready_at < COALESCE(u.at, 'infinity'))) FROM (SELECT ("
    "SELECT next_attempt_at FROM {t} WHERE status = 0 AND next_attempt_at = ready_at "
    "ORDER BY ready_at LIMIT 1) AS at) AS u"
)


def migrations(schema: str, table: str) -> dict[int, list[str]]:
    """Versioned DDL. Names are validated by `outbox.stores.urls` (letters, digits, _) and quoted."""
    t = f'"{schema}"."{table}"'
    return {
        1: [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- orders a key's messages
                msg_id TEXT NOT NULL,
                topic TEXT NOT NULL,
                key BYTEA,
                value BYTEA,
                headers BYTEA,
                partition INTEGER NOT NULL DEFAULT -1,
                status SMALLINT NOT NULL DEFAULT 0,
                attempts INTEGER NOT NULL DEFAULT 0,
                created_at DOUBLE PRECISION NOT NULL,
                first_failed_at DOUBLE PRECISION,
                last_failed_at DOUBLE PRECISION,
                next_attempt_at DOUBLE PRECISION NOT NULL DEFAULT 0,
                last_error TEXT,
                lease_owner TEXT
            )""",
            # Oldest pending first: claim walks this small partial index in id order.
            f'CREATE INDEX IF NOT EXISTS "{table}_pending_id" ON {t} (id) WHERE status = 0',
            # "Anything due?" probes, next_due_at, and due-row scans when most rows back off.
            f'CREATE INDEX IF NOT EXISTS "{table}_due" ON {t} (status, next_attempt_at)',
            # Per-key order checks and has_pending. md5(key), not key: a btree entry is limited
            # to ~2.7 kB and Kafka keys are not; queries also compare the key itself.
            f'CREATE INDEX IF NOT EXISTS "{table}_key" ON {t} (topic, md5(key), id) '
            "WHERE status = 0 AND key IS NOT NULL",
            f'CREATE INDEX IF NOT EXISTS "{table}_dead" ON {t} (id) WHERE status = 2',
        ],
        # The error as code and name columns: filters and stats read them, never the text.
        2: [
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS error_code INTEGER",
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS error_name TEXT",
            # The one place the old text form "NAME (code): reason" (version 1) is parsed.
            f"UPDATE {t} SET error_name = m[1], error_code = m[2]::integer "
            "FROM (SELECT id AS mid, regexp_match(last_error, '^(\\S+) \\((-?\\d+)\\):') AS m "
            f"FROM {t} WHERE last_error IS NOT NULL AND error_code IS NULL) AS x "
            "WHERE id = x.mid AND x.m IS NOT NULL",
        ],
        # The console: dead-letter filters walk small partial indexes in id order (keyset pages;
        # pending rows are not in them, so the producer's writes do not pay for them), a trace
        # finds a message's rows by outbox-id, and operator actions are audited in the store.
        3: [
            # Dead rows only, as in SQLite: a full index taxes every spilled message.
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_msg_id" ON {t} (msg_id) WHERE status = 2',
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_topic" ON {t} (topic, id) WHERE status = 2',
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_error_name" ON {t} (error_name, id) WHERE status = 2',
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_error_code" ON {t} (error_code, id) WHERE status = 2',
            # md5(key), as for the pending key index: a btree entry is limited to ~2.7 kB.
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_key" ON {t} (md5(key), id) WHERE status = 2',
            f'CREATE INDEX IF NOT EXISTS "{table}_dead_failed" ON {t} (last_failed_at) WHERE status = 2',
            f"""CREATE TABLE IF NOT EXISTS "{schema}"."{table}_audit" (
                id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                at DOUBLE PRECISION NOT NULL,
                who TEXT NOT NULL,
                action TEXT NOT NULL,
                filter TEXT NOT NULL,
                count BIGINT NOT NULL
            )""",
        ],
        # The record timestamp every send of a row carries (ms since the epoch); rows stored
        # before it read 0, "unknown", and are sent as they always were (librdkafka's now).
        4: [f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS timestamp BIGINT NOT NULL DEFAULT 0"],
        # Leases become heap-only updates. A lease still pushes next_attempt_at to its expiry (what
        # "due" means for every reader), but no index covers next_attempt_at any more: the due
        # index covers ready_at, "due when, leases aside", which the lease does not write. It is
        # never later than next_attempt_at (0 is valid: rows a writer of version 4 adds are
        # found by the index and judged on next_attempt_at), so the index finds a superset of
        # the due rows: the due ones plus the few leased.
        5: [
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS ready_at DOUBLE PRECISION NOT NULL DEFAULT 0",
            f"UPDATE {t} SET ready_at = next_attempt_at WHERE status = 0",
            f'CREATE INDEX IF NOT EXISTS "{table}_ready" ON {t} (ready_at) WHERE status = 0',
            f'DROP INDEX IF EXISTS "{schema}"."{table}_due"',
            # New pages only; the rows already stored keep their pages.
            f"ALTER TABLE {t} SET (fillfactor = {FILLFACTOR})",
        ],
        # Group rows (`outbox.stores.grouped`): one row holds a batch of messages, as in SQLite.
        # A group row is always PENDING, its key/value/headers NULL, its messages in `body` and
        # its distinct keys in `keys`. The body is stored out of line and uncompressed: it is
        # written once and read once, and compressing JSON-like bodies made their COPY take
        # nearly three times as long (docs/DESIGN.md).
        6: [
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS n INTEGER NOT NULL DEFAULT 1",
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS body BYTEA",
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS keys BYTEA",
            f"ALTER TABLE {t} ALTER COLUMN body SET STORAGE EXTERNAL",
            f'CREATE INDEX IF NOT EXISTS "{table}_group" ON {t} (id) WHERE n > 1',
        ],
        # The id of the key a row's payload is encrypted with (`outbox.stores.sealed`); NULL for a
        # row in clear, what every row written without encryption has. No index: only a key
        # rotation looks for it, walking the rows in id order a batch at a time.
        7: [f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS enc_key TEXT"],
    }

#: How the dead-letter filter compares keys: through the md5 index, then exactly.
