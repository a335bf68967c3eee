"""The application's own database transaction, whatever holds it, as the DB-API connection it runs on.

`produce(..., transaction=...)` writes the message into the outbox inside the caller's
transaction, so the message exists if and only if the business write commits. The caller may
hold that transaction as:

* a `psycopg.Connection` (PostgreSQL outbox);
* a `sqlite3.Connection` to the SQLite file the outbox is a table of;
* a SQLAlchemy `Connection` or `Session` (its current connection; a Session begins one);
* a SQLAlchemy `AsyncSession` or `AsyncConnection` on PostgreSQL through psycopg, given to
  `AsyncResilientProducer` (`run_in_async_transaction`);
* Django's `connection` (``django.db.connection`` or ``connections[alias]``) inside
  ``transaction.atomic()``.

`dbapi_connection` resolves each kind to the driver's connection; the store then checks that
connection is to its own database (`enqueue_in_transaction` of the SQLite and PostgreSQL stores).
SQLAlchemy and Django are optional: nothing here imports them, they are recognised by duck type.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from outbox.errors import ConfigError
from outbox.records import NewMessage
from outbox.stores import Outbox
from outbox.stores.registry import connection_modules, transaction_backend


def dbapi_connection(transaction: Any) -> Any:
    """The DB-API connection (a `sqlite3.Connection`, a `psycopg.Connection`, or the connection of
    another backend's driver: `outbox.stores.registry.Backend.connections`) `transaction` runs on.

    Raises:
        ConfigError: an async SQLAlchemy object, Django outside ``transaction.atomic()``, or a
            kind of object this does not know.
    """
    # A driver's connection class, or an application's subclass of one (a sqlite3 factory).
    if any(transaction_backend(c.__module__) is not None for c in type(transaction).__mro__[:-1]):
        return transaction
    module = type(transaction).__module__
    if module.startswith("sqlalchemy."):
        return _sqlalchemy(transaction)
    if module.startswith("django.") and hasattr(transaction, "in_atomic_block"):
        return _django(transaction)
    *others, last = connection_modules()
    drivers = f"{', '.join(others)} or {last}" if others else last
    raise ConfigError(
        f"transaction must be a {drivers} connection, a SQLAlchemy Connection or Session, or "
        f"Django's connection inside transaction.atomic() (got {type(transaction).__name__})"
    )


def is_async_sqlalchemy(transaction: Any) -> bool:
    """Is `transaction` a SQLAlchemy `AsyncSession` or `AsyncConnection`?"""
    return type(transaction).__module__.startswith("sqlalchemy.") and hasattr(transaction, "run_sync")


async def run_in_async_transaction(transaction: Any, write: Callable[[Any], str]) -> str:
    """Call ``write(sync)`` with the synchronous face of a SQLAlchemy `AsyncSession` or
    `AsyncConnection` (`run_sync`): each statement the outbox runs on it is awaited on the
    caller's event loop, inside the caller's transaction."""
    result: str = await transaction.run_sync(write)
    return result


def enqueue_in_transaction(store: Outbox, transaction: Any, messages: Sequence[NewMessage]) -> list[int]:
    """Write `messages` to `store` in the caller's open transaction; never commit (see the module doc)."""
    if not store.capabilities.transactional_enqueue:
        raise ConfigError(
            "transaction= needs an outbox that can enqueue in the application's transaction, in a database "
            f"it can reach (this outbox is a {type(store).__name__})"
        )
    ids: list[int] = store.enqueue_in_transaction(dbapi_connection(transaction), messages)
    return ids


def _sqlalchemy(obj: Any) -> Any:
    name = type(obj).__name__
    if is_async_sqlalchemy(obj):
        raise ConfigError(
            f"transaction= takes a SQLAlchemy {name} from AsyncResilientProducer.produce(), which "
            "awaits the write on the event loop; ResilientProducer takes a Connection or Session"
        )
    if hasattr(obj, "get_bind") and hasattr(obj, "connection"):  # a Session: its connection, begun now
        obj = obj.connection()
    raw = getattr(obj, "connection", None)  # Connection.connection: the pool's proxy of the driver's
    driver = getattr(raw, "driver_connection", None)
    if driver is None:
        raise ConfigError(f"transaction: SQLAlchemy {name} has no open driver connection")
    adapted = getattr(raw, "dbapi_connection", driver)
    # An asyncio driver under an AsyncSession's run_sync(): SQLAlchemy's adapter runs each of its
    # DB-API calls on the event loop; the store writes through it.
    return driver if adapted is driver else adapted


def _django(conn: Any) -> Any:
    if not conn.in_atomic_block:
        raise ConfigError(
            "transaction: Django's connection is in autocommit mode: call produce() inside transaction.atomic()"
        )
    conn.ensure_connection()
    return conn.connection


# -- the other way round: a consumer's transactional handler gets the inbox's DB-API connection ------

#: One engine per inbox connection (a consumer has one), kept with it: sqlite3 connections take no weak reference.
_engines: dict[int, tuple[Any, Any]] = {}


@contextmanager
def sqlalchemy_connection(tx: Any) -> Iterator[Any]:
    """A SQLAlchemy `Connection` on `tx`, the connection a ``handler(msg, tx)`` gets (dedup=True).

    Its statements run in the inbox's transaction: they commit with the message's mark after the
    handler returns, and roll back with it if the handler raises. Commit, rollback and close on it
    are left to the inbox (they do nothing here). Use it as ``with sqlalchemy_connection(tx) as c:``,
    or bind a Session to it: ``Session(bind=c)`` (flushed, not committed, before the handler returns).
    """
    held = _engines.get(id(tx))
    engine = None if held is None or held[0] is not tx else held[1]
    if engine is None:
        from sqlalchemy import create_engine
        from sqlalchemy.pool import StaticPool

        joined = _Joined(tx)
        options: dict[str, Any] = dict(creator=lambda: joined, poolclass=StaticPool, pool_reset_on_return=None)
        if isinstance(tx, sqlite3.Connection):
            engine = create_engine("sqlite://", **options)
        else:  # hstore's type lookup wants psycopg's own Connection class, not this stand-in
            engine = create_engine("postgresql+psycopg://", use_native_hstore=False, **options)
        _engines[id(tx)] = (tx, engine)
    conn = engine.connect()
    try:
        yield conn
    finally:
        conn.close()


class _Joined:
    """The inbox's connection as SQLAlchemy sees it: its transaction is the inbox's to end."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass
