"""The `Outbox` contract (`outbox.testing.contract`) run against every backend of this package:
memory, SQLite file, real PostgreSQL, each store opened as an application opens it, through the
store registry from its URL.

Each PostgreSQL test gets its own schema in the session database (creating a schema and a table
is much faster than creating a database); it is dropped afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox.stores import registry
from outbox.stores.base import Capabilities, Outbox
from outbox.stores.memory import MemoryOutbox
from outbox.stores.mysql import MySQLOutbox
from outbox.stores.postgres import PostgresOutbox
from outbox.stores.sqlite import SQLiteOutbox
from outbox.stores.urls import StoreURL, parse_url
from outbox.testing.contract import DurableStoreContract, Factory, StoreContract

#: What the durable stores of this package declare.
DURABLE = Capabilities(
    transactional_enqueue=True, owner_liveness=True, grouped_rows=True, bulk_read=True, durable=True, shared=True
)


@contextlib.contextmanager
def opened_stores(url: StoreURL, each: Any) -> Iterator[Factory]:
    """A factory of stores opened through the registry, the n-th at `each(url, n)`; closed after."""
    opened: list[Outbox] = []
    counter = itertools.count()
    backend = registry.backend(url.kind)

    def factory() -> Outbox:
        store = backend.open(each(url, next(counter)), True)
        opened.append(store)
        return store

    try:
        yield factory
    finally:
        for s in opened:
            s.close()


class TestMemoryStore(StoreContract):
    state_machine_examples = 60

    @pytest.fixture
    def make_store(self) -> Iterator[Factory]:
        yield MemoryOutbox

    def test_declares_its_capabilities(self, store: Outbox) -> None:
        assert store.capabilities == Capabilities(durable=False, shared=False)


class TestSQLiteStore(DurableStoreContract):
    state_machine_examples = 60

    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Iterator[Factory]:
        at = lambda url, n: dataclasses.replace(url, path=str(tmp_path / f"outbox-{n}.db"))  # noqa: E731
        with opened_stores(parse_url(str(tmp_path / "outbox.db")), at) as factory:
            yield factory

    def reopen(self, store: Outbox) -> Outbox:
        assert isinstance(store, SQLiteOutbox)
        return SQLiteOutbox(store.path, create=False)

    def run_sql(self, store: Outbox, sql: str) -> list[tuple[Any, ...]]:
        assert isinstance(store, SQLiteOutbox)
        with contextlib.closing(sqlite3.connect(store.path)) as conn:
            return conn.execute(sql).fetchall()

    def test_declares_its_capabilities(self, store: Outbox) -> None:
        assert store.capabilities == DURABLE


class TestPostgresStore(DurableStoreContract):
    @pytest.fixture
    def make_store(self, postgres_url: str) -> Iterator[Factory]:
        import psycopg

        schema = f"contract_{uuid.uuid4().hex[:10]}"
        at = lambda url, n: dataclasses.replace(url, table=f"outbox_{n}")  # noqa: E731
        try:
            with opened_stores(dataclasses.replace(parse_url(postgres_url), schema=schema), at) as factory:
                yield factory
        finally:
            with psycopg.connect(postgres_url, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    def reopen(self, store: Outbox) -> Outbox:
        assert isinstance(store, PostgresOutbox)
        return PostgresOutbox(store.url, create=False)

    def run_sql(self, store: Outbox, sql: str) -> list[tuple[Any, ...]]:
        import psycopg

        assert isinstance(store, PostgresOutbox)
        with psycopg.connect(**store.url.psycopg_kwargs()) as conn:
            return conn.execute(sql).fetchall()

    def table(self, store: Outbox) -> str:
        assert isinstance(store, PostgresOutbox)
        return store._t

    def test_declares_its_capabilities(self, store: Outbox) -> None:
        assert store.capabilities == DURABLE


class TestMySQLStore(DurableStoreContract):
    """On a real MariaDB server (the test bed's), each test's tables apart in the session database."""

    state_machine_examples = 20  # each example makes its tables: a second each on this server

    @pytest.fixture
    def make_store(self, mysql_url: str) -> Iterator[Factory]:
        prefix = f"contract_{uuid.uuid4().hex[:10]}"
        made: list[str] = []

        def at(url: StoreURL, n: int) -> StoreURL:
            made.append(f"{prefix}_{n}")
            return dataclasses.replace(url, table=made[-1])

        try:
            with opened_stores(parse_url(mysql_url), at) as factory:
                yield factory
        finally:
            with contextlib.closing(_mysql(mysql_url)) as conn, conn.cursor() as cur:
                for table in made:
                    cur.execute(f"DROP TABLE IF EXISTS `{table}`, `{table}_audit`, `{table}_meta`")

    def reopen(self, store: Outbox) -> Outbox:
        assert isinstance(store, MySQLOutbox)
        return MySQLOutbox(store.url, create=False)

    def run_sql(self, store: Outbox, sql: str) -> list[tuple[Any, ...]]:
        assert isinstance(store, MySQLOutbox)
        with contextlib.closing(_mysql(store.url.redacted(), store.url)) as conn, conn.cursor() as cur:
            cur.execute(sql)
            return list(cur.fetchall())

    def table(self, store: Outbox) -> str:
        assert isinstance(store, MySQLOutbox)
        return f'"{store.url.table}"'

    def test_declares_its_capabilities(self, store: Outbox) -> None:
        assert store.capabilities == Capabilities(transactional_enqueue=True, owner_liveness=True, bulk_read=True)


def _mysql(url: str, parsed: StoreURL | None = None) -> Any:
    """A PyMySQL connection of its own to the database of `url`, in ANSI quotes (as the store's SQL is)."""
    import pymysql

    u = parsed or parse_url(url)
    return pymysql.connect(
        host=u.host,
        port=u.port,
        user=u.user or "",
        password=u.password or "",
        database=u.database,
        autocommit=True,
        sql_mode="ANSI_QUOTES",
    )
