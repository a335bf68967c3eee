"""A fresh durable store of either backend for one test: a SQLite file in `tmp_path`, or a
PostgreSQL outbox in a schema of its own on the session database (dropped afterwards)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.stores.postgres import PostgresOutbox
from outbox.stores.sqlite import SQLiteOutbox
from outbox.stores.urls import parse_url


def durable_store(request: pytest.FixtureRequest, tmp_path: Path, name: str) -> Iterator[SQLiteOutbox | PostgresOutbox]:
    """Yield the store `request.param` names ("sqlite" or "postgres"), then close it.

    `name`: the SQLite file's stem, and the prefix of the PostgreSQL schema.
    """
    if request.param == "sqlite":
        s: SQLiteOutbox | PostgresOutbox = SQLiteOutbox(str(tmp_path / f"{name}.db"))
        yield s
        s.close()
        return
    import psycopg

    base: str = request.getfixturevalue("postgres_url")
    schema = f"{name}_{uuid.uuid4().hex[:10]}"
    s = PostgresOutbox(dataclasses.replace(parse_url(base), schema=schema), pool_size=2)
    yield s
    s.close()
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
