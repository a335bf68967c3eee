"""PostgreSQL outbox against the real server: concurrent claimers, transactional enqueue, errors."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import random
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox.drain.sendloop import resend
from outbox.errors import ConfigError, StoreError, StoreNotFoundError
from outbox.records import NewMessage, Status
from outbox.stores import grouped, open_outbox
from outbox.stores.owners import Liveness, OwnerId, new_owner, parse_owner
from outbox.stores.postgres import SCHEMA_VERSION, PostgresOutbox
from outbox.stores.postgres_claim import ClaimedRows
from outbox.stores.urls import StoreURL, parse_url

from ..resend_cases import odd_messages
from ..waiting import wait_until

SECRET = "s3cr3t-pw"


@pytest.fixture
def pg_url(postgres_url: str) -> Iterator[StoreURL]:
    """The session database, with a schema of this test's own (dropped afterwards)."""
    schema = f"pgstore_{uuid.uuid4().hex[:10]}"
    yield dataclasses.replace(parse_url(postgres_url), schema=schema)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def store(pg_url: StoreURL) -> Iterator[PostgresOutbox]:
    with PostgresOutbox(pg_url) as s:
        assert isinstance(s, PostgresOutbox)
        yield s


def _conninfo(url: StoreURL) -> dict[str, Any]:
    return dict(url.psycopg_kwargs())


# -- many claimers at once ---------------------------------------------------------------------------


def _claimer(url: StoreURL, owner: str, batch: int) -> list[tuple[int, int, list[int]]]:
    """Claim and acknowledge until the outbox is empty; return (claimed_ns, acked_ns, ids) per claim.

    Runs in a spawned process. The clock is CLOCK_MONOTONIC, shared by all processes of the host:
    `claimed_ns` is read after the claim committed, `acked_ns` before the acknowledgement starts.
    """
    out: list[tuple[int, int, list[int]]] = []
    with PostgresOutbox(url, create=False, pool_size=1) as s:
        while True:
            rows = s.claim(owner, batch, 120.0, now=time.time())
            claimed = time.monotonic_ns()
            if not rows:
                if s.stats(now=time.time()).pending == 0:
                    return out
                time.sleep(0.002)
                continue
            time.sleep(0.001)  # "sending": gives an out-of-order claim by another process time to show
            acked = time.monotonic_ns()
            assert s.mark_delivered([r.id for r in rows]) == len(rows)
            out.append((claimed, acked, [r.id for r in rows]))


def test_four_processes_claim_every_row_once_and_keep_per_key_order(store: PostgresOutbox) -> None:
    rng = random.Random(5)
    n_rows, n_keys = 20_000, 50
    keys = [rng.randrange(n_keys) for _ in range(n_rows)]
    key_of: dict[int, int] = {}
    # Written GROUP_MIN - 1 at a time: one row per message, so that the claimers contend for
    # rows (group rows of many keys are claimed in turn; tests/integration/test_postgres_fleet.py
    # has four processes draining groups).
    step = grouped.GROUP_MIN - 1
    for start in range(0, n_rows, step):
        chunk = keys[start : start + step]
        got = store.enqueue([NewMessage("t", b"v", f"key-{k}".encode()) for k in chunk])
        key_of.update(zip(got, chunk, strict=True))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_claimer, [(store.url, f"w{n}", 20) for n in range(4)])

    claims = [c for per_process in results for c in per_process]
    all_ids = [i for _, _, ids in claims for i in ids]
    assert len(all_ids) == n_rows and set(all_ids) == set(key_of)  # every row once, none twice
    assert sum(1 for per_process in results if per_process) >= 2  # the work was really shared
    assert store.stats(now=time.time()).pending == 0

    per_key: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # key -> (claimed, id, acked)
    for claimed, acked, ids in claims:
        for i in ids:
            per_key[key_of[i]].append((claimed, i, acked))
    for k, seq in per_key.items():
        seq.sort()
        in_claim_order = [i for _, i, _ in seq]
        assert in_claim_order == sorted(in_claim_order), f"key {k} claimed out of id order"
        for (c1, _, a1), (c2, i2, _) in zip(seq, seq[1:], strict=False):
            if c1 != c2:  # another claim: the earlier one must have been acknowledged first
                assert a1 < c2, f"key {k}: row {i2} claimed while an earlier row was still leased"


def test_lease_of_a_dead_process_expires(store: PostgresOutbox) -> None:
    got = store.enqueue([NewMessage("t", b"v", b"k") for _ in range(3)])
    now = time.time()
    assert [r.id for r in store.claim("crashed", 10, 5.0, now=now)] == got
    with PostgresOutbox(store.url, create=False) as other:
        assert other.claim("alive", 10, 5.0, now=now + 1) == []
        assert [r.id for r in other.claim("alive", 10, 5.0, now=now + 6)] == got


# -- transactional enqueue ---------------------------------------------------------------------------


def _business_table(url: StoreURL) -> str:
    table = f'"{url.schema}".orders'
    with psycopg.connect(**_conninfo(url), autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id TEXT PRIMARY KEY)")
    return table


def test_rolled_back_business_transaction_leaves_no_message(store: PostgresOutbox) -> None:
    orders = _business_table(store.url)
    with psycopg.connect(**_conninfo(store.url)) as conn:
        conn.execute(f"INSERT INTO {orders} VALUES ('o-1')")
        ids = store.enqueue_in_transaction(conn, [NewMessage("orders", b"created o-1", b"o-1", msg_id="m1")])
        assert len(ids) == 1
        conn.rollback()
        assert conn.execute(f"SELECT count(*) FROM {orders}").fetchone() == (0,)
    assert store.stats(now=time.time()).pending == 0
    assert store.claim("w", 10, 30, now=time.time()) == []


def test_committed_business_transaction_leaves_the_message_and_only_then(store: PostgresOutbox) -> None:
    orders = _business_table(store.url)
    headers = [("trace", b"\x01\x02"), ("trace", None)]
    with psycopg.connect(**_conninfo(store.url)) as conn:
        conn.execute(f"INSERT INTO {orders} VALUES ('o-2')")
        [i] = store.enqueue_in_transaction(
            conn, [NewMessage("orders", b"created", b"o-2", headers, msg_id="m2")]
        )
        # Not visible to the drainers before the business transaction commits.
        assert store.stats(now=time.time()).pending == 0
        assert store.claim("w", 10, 30, now=time.time()) == []
        conn.commit()
    [row] = store.claim("w", 10, 30, now=time.time())
    assert (row.id, row.msg_id, row.topic, row.key, row.value, row.headers, row.status) == (
        i,
        "m2",
        "orders",
        b"o-2",
        b"created",
        headers,
        Status.PENDING,
    )


def test_transaction_block_on_autocommit_connection(store: PostgresOutbox) -> None:
    with psycopg.connect(**_conninfo(store.url), autocommit=True) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            store.enqueue_in_transaction(conn, [NewMessage("t", b"lost")])
            raise RuntimeError("business rule failed")
        with conn.transaction():
            store.enqueue_in_transaction(conn, [NewMessage("t", b"kept")])
    assert [r.value for r in store.claim("w", 10, 30, now=time.time())] == [b"kept"]


def test_transactional_enqueue_refuses_what_would_not_be_atomic(
    store: PostgresOutbox, postgres_url: str
) -> None:
    with (
        psycopg.connect(**_conninfo(store.url), autocommit=True) as conn,
        pytest.raises(ConfigError, match="autocommit"),
    ):
        store.enqueue_in_transaction(conn, [NewMessage("t", b"v")])
    other = dataclasses.replace(store.url, database="postgres")
    with psycopg.connect(**_conninfo(other)) as conn, pytest.raises(ConfigError, match="database"):
        store.enqueue_in_transaction(conn, [NewMessage("t", b"v")])
    with psycopg.connect(**_conninfo(store.url)) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(StoreError, match="aborted"):
            store.enqueue_in_transaction(conn, [NewMessage("t", b"v")])
    with pytest.raises(ConfigError):
        store.enqueue_in_transaction(object(), [NewMessage("t", b"v")])
    assert store.stats(now=time.time()).pending == 0


# -- schema ------------------------------------------------------------------------------------------


def test_schema_and_table_from_the_jdbc_url_and_versioned(postgres_url: str) -> None:
    base = parse_url(postgres_url)
    schema = f"jdbc_{uuid.uuid4().hex[:8]}"
    jdbc = (
        f"jdbc:postgresql://{base.host}:{base.port}/{base.database}?user={base.user}"
        f"&password={base.password}&currentSchema={schema}&table=events_outbox"
    )
    try:
        with open_outbox(jdbc) as s:
            [i] = s.enqueue([NewMessage("t", b"v")])
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute(f"SELECT count(*) FROM {schema}.events_outbox").fetchone() == (1,)
            assert conn.execute(
                f"SELECT max(version) FROM {schema}.events_outbox_schema_version"
            ).fetchone() == (SCHEMA_VERSION,)
            indexes = {
                r[0]
                for r in conn.execute(
                    "SELECT indexname FROM pg_indexes WHERE schemaname = %s", [schema]
                ).fetchall()
            }
        assert {"events_outbox_pending_id", "events_outbox_ready", "events_outbox_key"} <= indexes
        assert "events_outbox_due" not in indexes  # replaced by the ready_at index (version 5)
        with open_outbox(jdbc, create=False) as again:
            assert again.get(i).value == b"v"
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_missing_table_without_create_is_store_not_found(pg_url: StoreURL) -> None:
    with pytest.raises(StoreNotFoundError, match=pg_url.where()):
        PostgresOutbox(pg_url, create=False)


def test_newer_schema_version_is_refused(store: PostgresOutbox) -> None:
    with psycopg.connect(**_conninfo(store.url), autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{store.url.schema}".outbox_schema_version VALUES (99, 0)')
    with pytest.raises(StoreError, match="newer"):
        PostgresOutbox(store.url)


def test_claim_on_a_large_backlog_uses_the_pending_index(store: PostgresOutbox) -> None:
    # 50,000 rows backing off + a few due: the claim must not need to read them all.
    with psycopg.connect(**_conninfo(store.url), autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{store.url.schema}".outbox '
            "(msg_id, topic, key, value, created_at, next_attempt_at) "
            "SELECT g::text, 't', ('k' || (g % 100))::bytea, 'v', 0, 1e12 FROM generate_series(1, 50000) g"
        )
        conn.execute(f'ANALYZE "{store.url.schema}".outbox')
    due = store.enqueue([NewMessage("t", b"due", b"other")])
    assert [r.id for r in store.claim("w", 10, 30, now=time.time())] == due


# -- errors: host and database named, password never ---------------------------------------------------


def _assert_clean(exc: BaseException, caplog: pytest.LogCaptureFixture, where: str) -> None:
    text = str(exc)
    assert where in text, text
    assert SECRET not in text and SECRET not in repr(exc)
    assert exc.__cause__ is None or SECRET not in str(exc.__cause__)
    assert SECRET not in caplog.text


def test_wrong_password(postgres_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = dataclasses.replace(parse_url(postgres_url), password=SECRET)
    with pytest.raises(StoreError) as info:
        PostgresOutbox(url)
    _assert_clean(info.value, caplog, url.where())
    assert "authentication failed" in str(info.value)


def test_unreachable_server(postgres_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = dataclasses.replace(parse_url(postgres_url), port=port, password=SECRET)
    with pytest.raises(StoreError) as info:
        open_outbox(url)
    _assert_clean(info.value, caplog, f"127.0.0.1:{port}/")
    assert "cannot connect" in str(info.value)


def test_missing_database(postgres_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    base = parse_url(postgres_url)
    # The server checks the password before the database name, so the real one is needed here;
    # test_wrong_password and test_unreachable_server check that a password is never shown.
    url = dataclasses.replace(base, database="no_such_outbox_db")
    with pytest.raises(StoreError) as info:
        PostgresOutbox(url)
    assert "no_such_outbox_db" in str(info.value) and "does not exist" in str(info.value)
    assert url.where() in str(info.value)


def test_missing_schema_permission(postgres_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # The test role may create databases but owns no rights on the "postgres" database: it may
    # neither create a schema there nor (PostgreSQL 15+) a table in its public schema.
    caplog.set_level(logging.DEBUG)
    base = dataclasses.replace(parse_url(postgres_url), database="postgres")
    for url in (dataclasses.replace(base, schema=f"nope_{uuid.uuid4().hex[:6]}"), base):
        with pytest.raises(StoreError) as info:
            PostgresOutbox(url)
        assert "permission denied" in str(info.value)
        assert "postgres" in str(info.value) and url.where() in str(info.value)


def test_broken_connections_are_replaced_and_nothing_is_lost(
    store: PostgresOutbox, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    ids = store.enqueue([NewMessage("t", bytes([n])) for n in range(10)])
    # Kill every session of the store (what a server restart does to a pool).
    with psycopg.connect(**_conninfo(store.url), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    errors = []
    for _ in range(6):
        try:
            stats = store.stats(now=time.time())
            break
        except StoreError as exc:
            errors.append(exc)
    else:
        raise AssertionError(f"the pool never reconnected: {errors}")
    assert stats.pending == 10
    for exc in errors:
        assert store.url.where() in str(exc)
    assert [store.get(i).value for i in ids] == [bytes([n]) for n in range(10)]


def test_version_1_outbox_is_migrated_with_error_columns(postgres_url: str) -> None:
    """A table written by schema version 1 gets error_code/error_name, filled from last_error."""
    import psycopg

    from outbox.records import DeadLetterFilter

    schema = f"mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(
            f'CREATE TABLE "{schema}".outbox (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, '
            "msg_id TEXT NOT NULL, topic TEXT NOT NULL, key BYTEA, value BYTEA, headers BYTEA, "
            "partition INTEGER NOT NULL DEFAULT -1, status SMALLINT NOT NULL DEFAULT 0, "
            "attempts INTEGER NOT NULL DEFAULT 0, created_at DOUBLE PRECISION NOT NULL, "
            "first_failed_at DOUBLE PRECISION, last_failed_at DOUBLE PRECISION, "
            "next_attempt_at DOUBLE PRECISION NOT NULL DEFAULT 0, last_error TEXT, lease_owner TEXT)"
        )
        conn.execute(
            f'CREATE TABLE "{schema}".outbox_schema_version (version INTEGER PRIMARY KEY, '
            "applied_at DOUBLE PRECISION NOT NULL)"
        )
        conn.execute(f'INSERT INTO "{schema}".outbox_schema_version VALUES (1, 0)')
        conn.execute(
            f'INSERT INTO "{schema}".outbox (msg_id, topic, status, attempts, created_at, last_error) VALUES '
            "('a', 't', 2, 3, 1, '_MSG_TIMED_OUT (-192): Local: Message timed out'), "
            "('b', 't', 0, 0, 1, NULL), ('c', 't', 2, 1, 1, 'odd text')"
        )
    store = PostgresOutbox(dataclasses.replace(parse_url(postgres_url), schema=schema))
    try:
        [a, b, c] = [store.get(i) for i in (1, 2, 3)]
        assert (a.error_code, a.error_name) == (-192, "_MSG_TIMED_OUT")
        assert (b.error_code, b.error_name, c.error_code, c.error_name) == (None, None, None, None)
        assert (a.timestamp, b.timestamp, c.timestamp) == (0, 0, 0)  # stored before timestamps: unknown
        assert [r.id for r in store.list_dead(DeadLetterFilter(error="-192"))] == [1]
    finally:
        store.close()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_version_4_outbox_is_migrated_to_leases_no_index_covers(postgres_url: str) -> None:
    """A table of schema version 4 (the due index on next_attempt_at): its pending rows get
    ready_at, the due index is replaced by one on ready_at, and no index covers a column a
    lease writes (so a lease is a heap-only update). A lease, a back-off and a due row stored
    before the migration keep their meaning: only the due row is claimed, the leased one once
    its lease ends, and next_due_at sees the lease and the back-off."""
    schema = f"mig_{uuid.uuid4().hex[:8]}"
    url = dataclasses.replace(parse_url(postgres_url), schema=schema)
    PostgresOutbox(url).close()
    t = f'"{schema}".outbox'
    now = time.time()
    try:
        with psycopg.connect(postgres_url, autocommit=True) as conn:  # back to version 4
            conn.execute(f"ALTER TABLE {t} DROP COLUMN enc_key")
            conn.execute(f'DELETE FROM "{schema}".outbox_schema_version WHERE version = 7')
            conn.execute(f'DROP INDEX "{schema}".outbox_group')
            conn.execute(f"ALTER TABLE {t} DROP COLUMN n, DROP COLUMN body, DROP COLUMN keys")
            conn.execute(f'DELETE FROM "{schema}".outbox_schema_version WHERE version = 6')
            conn.execute(f'DROP INDEX "{schema}".outbox_ready')
            conn.execute(f"ALTER TABLE {t} DROP COLUMN ready_at")
            conn.execute(f"ALTER TABLE {t} RESET (fillfactor)")
            conn.execute(f'CREATE INDEX outbox_due ON {t} (status, next_attempt_at)')
            conn.execute(f'DELETE FROM "{schema}".outbox_schema_version WHERE version = 5')
            conn.execute(
                f"INSERT INTO {t} (msg_id, topic, value, created_at, next_attempt_at, lease_owner) VALUES "
                "('leased', 't', 'a', 0, %s, 'gone-owner'), ('backing-off', 't', 'b', 0, %s, NULL), "
                "('due', 't', 'c', 0, %s, NULL)",
                [now + 60, now + 120, now - 1],
            )
        store = PostgresOutbox(url, create=False)
        try:
            with psycopg.connect(postgres_url) as conn:
                version = conn.execute(f'SELECT max(version) FROM "{schema}".outbox_schema_version').fetchone()
                assert version == (SCHEMA_VERSION,)
                ready = conn.execute(f"SELECT msg_id, ready_at, next_attempt_at FROM {t} ORDER BY id").fetchall()
                assert [(m, r == n) for m, r, n in ready] == [("leased", True), ("backing-off", True), ("due", True)]
                indexes = [d for (d,) in conn.execute(
                    "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = 'outbox'", [schema]
                ).fetchall()]
                assert not [d for d in indexes if "next_attempt_at" in d or "lease_owner" in d], indexes
                assert any("(ready_at) WHERE (status = 0)" in d for d in indexes), indexes
                assert conn.execute(
                    "SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [t]
                ).fetchone() == (["fillfactor=50"],)
            assert store.next_due_at() == pytest.approx(now - 1)
            [due] = store.claim("new-owner", 10, 30.0, now=now)
            assert due.msg_id == "due"
            assert store.claim("other-owner", 10, 30.0, now=now) == []
            assert store.next_due_at() == pytest.approx(now + 30)  # the new lease ends first
            assert [m.msg_id for m in store.claim("new-owner", 10, 30.0, now=now + 90)] == ["leased", "due"]
        finally:
            store.close()
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_lease_settle_and_release_keep_ready_at_at_or_before_next_attempt_at(postgres_url: str) -> None:
    """ready_at, the due index's column, is never later than next_attempt_at whatever the row
    goes through (claim, fail with a back-off, release, dead letter and replay, write-ahead
    rows born leased): the index then finds every due row."""
    from outbox.stores.base import Failure, Settlement

    schema = f"rdy_{uuid.uuid4().hex[:8]}"
    url = dataclasses.replace(parse_url(postgres_url), schema=schema)
    store = PostgresOutbox(url)
    now = time.time()
    try:
        ids = store.enqueue([NewMessage("t", b"%d" % i, None, [], -1, f"m{i}") for i in range(6)])
        born = store.enqueue([NewMessage("t", b"w", None, [], -1, "w")], lease_owner="writer", lease_until=now + 30)
        rows = store.claim("o", 6, 30.0, now=now)
        assert [r.id for r in rows] == ids
        store.apply(
            Settlement(
                delivered=[ids[0]],
                failures=[
                    Failure(ids[1], "boom", now + 5, now, -1, "X"),
                    Failure(ids[2], "boom", None, now, -1, "X"),
                ],
                released=[ids[3]],
            ),
            now=now,
        )
        assert store.replay_dead(now=now) == 1
        with psycopg.connect(postgres_url) as conn:
            found = conn.execute(
                f'SELECT id, ready_at, next_attempt_at, status FROM "{schema}".outbox ORDER BY id'
            ).fetchall()
        assert all(r <= n for _, r, n, _ in found), found
        assert {i for i, r, n, _ in found if r == n} == {ids[1], ids[2], ids[3]}  # not leased
        assert {i for i, r, n, _ in found if r < n} == {ids[4], ids[5], born[0]}  # leased
        assert [r.id for r in store.claim("o2", 10, 30.0, now=now + 2)] == [ids[2], ids[3]]
        assert [r.id for r in store.claim("o2", 10, 30.0, now=now + 31)] == [ids[1], ids[4], ids[5], born[0]]
    finally:
        store.close()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# -- the claim's rows, its lease, and the sweep of a short claim ---------------------------------


def test_claimed_rows_are_the_stored_messages_exactly(store: PostgresOutbox) -> None:
    """Claims build rows on their own path (the lone `outbox-id` header split without decoding):
    every shape of key, value and headers comes back as it was stored, and as `get` reads it."""
    shapes: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]]] = [
        (None, None, []),
        (b"", b"", [("outbox-id", b"m1")]),  # the producer's own: the id header alone
        (b"k", b"v", [("outbox-id", b"")]),
        (b"k", b"v" * 3000, [("outbox-id", b"m3"), ("trace", None)]),  # id header first, then more
        (b"k", b"v", [("outbox-idx", b"m4")]),  # a name the id header's bytes begin
        (b"k", b"v", [("trace", b"t"), ("outbox-id", b"m5"), ("trace", b"t")]),
        (b"\x00\xff", b"\x00", [("outbox-id", None)]),
    ]
    sent = [
        NewMessage("t", value, key, headers, i % 3, f"m{i}", timestamp=1_700_000_000_000 + i)
        for i, (key, value, headers) in enumerate(shapes)
    ]
    ids = store.enqueue(sent)
    now = time.time()
    rows = store.claim("o", 100, 30.0, now=now)
    assert [r.id for r in rows] == ids
    for m, r in zip(sent, rows, strict=True):
        assert (r.msg_id, r.topic, r.key, r.value, r.headers, r.partition, r.timestamp) == (
            m.msg_id, m.topic, m.key, m.value, m.headers, m.partition, m.timestamp,
        )
        assert r.status is Status.PENDING and r.attempts == 0
        assert r._replace(next_attempt_at=0.0) == store.get(r.id)._replace(next_attempt_at=0.0)
    assert store.stats(now=now).leased == len(sent)


def test_a_claim_takes_over_a_gone_owners_rows_and_those_behind_them_in_id_order(
    store: PostgresOutbox, pg_url: StoreURL
) -> None:
    """Rows 1-2 of key a leased by an owner that is gone, then 3-4 without a key, then 5-6 of key
    a (waiting behind 1-2). A fresh claimer's claim returns all six, in id order, and every row
    is leased to it."""
    ids = store.enqueue([
        NewMessage("t", b"1", b"a", [], -1, "m1"), NewMessage("t", b"2", b"a", [], -1, "m2"),
    ])
    o = parse_owner(new_owner("drain"))
    assert o is not None
    gone = str(OwnerId(o.role, "another-host", o.pid, o.start, o.boot, o.pidns, o.nonce))
    holder = PostgresOutbox(pg_url, pool_size=1)
    assert [r.id for r in holder.claim(gone, 2, 600.0, now=time.time())] == ids
    holder.close()  # its lock goes with its session: the owner is gone
    wait_until(lambda: store.owner_liveness([gone]) == {gone: Liveness.GONE}, 30, "the owner to be gone", every=0.05)
    ids += store.enqueue([
        NewMessage("t", b"3", None, [], -1, "m3"), NewMessage("t", b"4", None, [], -1, "m4"),
        NewMessage("t", b"5", b"a", [], -1, "m5"), NewMessage("t", b"6", b"a", [], -1, "m6"),
    ])
    me = new_owner("drain")
    rows = store.claim(me, 100, 60.0, now=time.time())
    assert [r.id for r in rows] == ids
    with psycopg.connect(**_conninfo(pg_url)) as conn:
        owners = conn.execute(
            f'SELECT lease_owner FROM "{pg_url.schema}"."{pg_url.table}" ORDER BY id'
        ).fetchall()
    assert owners == [(me,)] * 6


def test_a_candidate_changed_before_its_lease_holds_back_the_rest_of_its_key(
    store: PostgresOutbox, pg_url: StoreURL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows 1-3 of key k and row 4 without a key are read as candidates; before the lease, an
    acknowledging writer reschedules row 1 (another session, committed). The lease skips row 1,
    so rows 2-3 must not leave before it: the claim returns row 4 alone, rows 2-3 are given
    back due and unleased, and row 1 keeps its new schedule."""
    ids = store.enqueue([
        NewMessage("t", b"1", b"k", [], -1, "m1"), NewMessage("t", b"2", b"k", [], -1, "m2"),
        NewMessage("t", b"3", b"k", [], -1, "m3"), NewMessage("t", b"4", None, [], -1, "m4"),
    ])
    table = f'"{pg_url.schema}"."{pg_url.table}"'
    now = time.time()
    keep_key_order = store._keep_key_order

    def reschedule_first_then_check(conn: Any, rows: list[tuple[Any, ...]], in_flight: Any) -> Any:
        with psycopg.connect(**_conninfo(pg_url), autocommit=True) as other:
            other.execute(
                f"UPDATE {table} SET next_attempt_at = %s, ready_at = %s WHERE id = %s", [now + 100, now + 100, ids[0]]
            )
        return keep_key_order(conn, rows, in_flight)

    monkeypatch.setattr(store, "_keep_key_order", reschedule_first_then_check)
    assert [r.id for r in store.claim("o", 10, 60.0, now=now)] == [ids[3]]
    with psycopg.connect(**_conninfo(pg_url)) as conn:
        found = conn.execute(f"SELECT id, lease_owner, next_attempt_at FROM {table} ORDER BY id").fetchall()
    assert found == [(ids[0], None, now + 100), (ids[1], None, now), (ids[2], None, now), (ids[3], "o", now + 60)]


def test_a_claims_resends_are_what_resending_each_of_its_messages_gives(store: PostgresOutbox) -> None:
    # `ClaimedRows.resends` reads the common row's re-send straight from the row: the same topic,
    # value, key, partition, timestamp and re-send headers as `resend` of each claimed message.
    now = 1_000_000.0
    stamp = 1_795_634_888_790
    common = [
        NewMessage("t", b"c-%d" % i, b"k" if i % 2 else None, [("outbox-id", b"c-%d" % i)], i % 3 - 1, f"c-{i}",
                   0, None, "_TRANSPORT (-195): down" if i % 2 else None, 0.0, None, None, stamp + i)
        for i in range(4)
    ]
    odd = odd_messages(now, stamp)  # off the common path
    store.enqueue(common + odd)
    claimed = store.claim("w", 100, 60.0, now=now + 10)
    assert isinstance(claimed, ClaimedRows)
    expected = [resend(m) for m in claimed]
    assert list(claimed.resends(resend)) == expected
    assert [m.msg_id for m in claimed] == [m.msg_id for m in common + odd]
    assert claimed.ids() == [m.id for m in claimed] and claimed[-1] == list(claimed)[-1]
    assert expected[0] == ("t", b"c-0", None, -1, stamp, [("outbox-id", b"c-0"), ("outbox-attempt", b"1")])
    assert expected[1][5] == [
        ("outbox-id", b"c-1"), ("outbox-attempt", b"1"), ("outbox-last-error", b"_TRANSPORT (-195): down"),
    ]
    assert expected[4][5] == [
        ("app", b"1"), ("outbox-id", b"odd-0"), ("outbox-attempt", b"3"),
        ("outbox-first-failed-at", str(int((now - 9) * 1000)).encode()),
        ("outbox-last-error", b"_MSG_TIMED_OUT (-192): slow"),
    ]


def test_a_candidate_changed_before_the_lease_is_left_out_and_its_keys_later_rows_given_back(
    store: PostgresOutbox, pg_url: StoreURL, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between the claim's read and its lease, another connection pushes row a-1 into the future
    # (as an acknowledging writer's reschedule would). The lease misses it, so the claim keeps
    # neither it nor a-2 behind it (given back at once, not leased), and keeps the unkeyed row.
    now = time.time()
    a1, a2, free = store.enqueue([
        NewMessage("t", b"1", b"a", [], -1, "a-1"), NewMessage("t", b"2", b"a", [], -1, "a-2"),
        NewMessage("t", b"3", None, [], -1, "free"),
    ])
    keep_key_order = store._keep_key_order

    def meanwhile(conn: Any, rows: list[tuple[Any, ...]], in_flight: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(**_conninfo(pg_url), autocommit=True) as other:
            other.execute(f"UPDATE {store._t} SET next_attempt_at = %s WHERE id = %s", [now + 20, a1])
        return keep_key_order(conn, rows, in_flight)

    monkeypatch.setattr(store, "_keep_key_order", meanwhile)
    claimed = store.claim("o", 10, 30.0, now=now)
    assert [m.id for m in claimed] == [free]
    monkeypatch.undo()
    with psycopg.connect(**_conninfo(pg_url)) as conn:
        leases = dict(conn.execute(f"SELECT id, lease_owner FROM {store._t} ORDER BY id").fetchall())
    assert leases == {a1: None, a2: None, free: "o"}
    assert [m.id for m in store.claim("o2", 10, 30.0, now=now + 21)] == [a1, a2]  # "free" still leased


def test_a_batch_whose_ids_are_not_one_run_is_stored_one_row_per_message(store: PostgresOutbox) -> None:
    """A group needs consecutive ids; when another writer's ids land among a batch's (here: a
    sequence that steps by 2), the batch is stored one row per message, in order, and drains
    as any rows do."""
    with store._conn() as conn:
        conn.execute(f"ALTER SEQUENCE {store._id_seq} INCREMENT BY 2")
    new = [NewMessage("t", b"%d" % i, b"k%d" % (i % 3), [], -1, f"m{i}") for i in range(40)]
    got = store.enqueue(new)
    assert got == sorted(got) and len(set(got)) == 40
    assert store._read(f"SELECT count(*), max(n) FROM {store._t}") == [(40, 1)]
    assert [m.msg_id for m in store.messages()] == [m.msg_id for m in new]
    with store._conn() as conn:
        conn.execute(f"ALTER SEQUENCE {store._id_seq} INCREMENT BY 1")
    claimed = store.claim("w", 100, 60, now=time.time())
    assert [m.id for m in claimed] == got
    assert store.mark_delivered(got) == 40 and store.messages() == []
    # With one run of ids again, the next batch is one group row.
    again = store.enqueue(new)
    assert store._read(f"SELECT count(*), max(n) FROM {store._t}") == [(1, 40)]
    assert again == list(range(again[0], again[0] + 40))
