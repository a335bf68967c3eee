"""The PostgreSQL outbox's connections (a pool, autocommit, short explicit transactions), its
errors (naming host:port/database, never the password) and its schema migration."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from outbox.errors import ConfigError, MissingDependencyError, StoreError, StoreNotFoundError
from outbox.stores.owners import SweepSchedule
from outbox.stores.postgres_schema import SCHEMA_VERSION, migrations
from outbox.stores.urls import StoreURL, parse_url

if TYPE_CHECKING:  # psycopg is the optional "postgres" extra: imported lazily at run time.
    import psycopg
    from psycopg_pool import ConnectionPool

log = logging.getLogger("outbox.stores.postgres")

_DEFAULT_CONNECT_TIMEOUT = "10"  # libpq's default is to wait forever for an unreachable host

def _lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


def _configure(conn: psycopg.Connection[Any]) -> None:
    """Session settings of every pooled connection."""
    # JIT compiling is triggered by the cost *estimate* of the per-key check on a large table,
    # and took hundreds of times as long as that check's real run. Outbox statements are short
    # OLTP statements that never gain from JIT.
    conn.execute("SET jit = off")
    # COPY picks a column's dumper by type oid, and for bytea that is the DB-API `Binary` wrapper's
    # Python dumper (an isinstance check, then the plain one): a Python call per value, two values
    # a spilled row. The C dumper of `bytes` is registered again so that it is bytea's once more.
    from psycopg.adapt import PyFormat

    conn.adapters.register_dumper(bytes, conn.adapters.get_dumper(bytes, PyFormat.BINARY))


def _import_psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise MissingDependencyError("a PostgreSQL outbox needs psycopg: pip install 'kafka-outbox[postgres]'") from exc
    return psycopg


class PostgresConnection:
    """The table, its connections and its schema: what the hot path (`PostgresOutbox`) and the
    administration (`outbox.stores.postgres_admin`) of one PostgreSQL outbox share.

    Args: see `PostgresOutbox`.
    """

    def __init__(self, url: StoreURL | str, *, create: bool = True, pool_size: int = 4) -> None:
        if isinstance(url, str):
            url = parse_url(url)
        if url.kind != "postgresql":
            raise ConfigError(f"not a PostgreSQL outbox URL: {url.redacted()}")
        if pool_size < 1:
            raise ConfigError("pool_size must be at least 1")
        self.url = url
        self.location = url.redacted()
        self._where = url.where()
        self._schema = url.schema
        self._table_name = url.table
        self._t = f'"{url.schema}"."{url.table}"'
        self._version_t = f'"{url.schema}"."{url.table}_schema_version"'
        self._audit_t = f'"{url.schema}"."{url.table}_audit"'
        self._claim_lock = _lock_key(f"kafka-outbox:claim:{url.schema}.{url.table}")
        # Concurrent spills draw their ids one at a time, so that each group gets consecutive ids.
        self._id_lock = _lock_key(f"kafka-outbox:ids:{url.schema}.{url.table}")
        self._migrate_lock = _lock_key(f"kafka-outbox:migrate:{url.schema}.{url.table}")
        self._create = create
        self._psycopg = _import_psycopg()
        self._kwargs: dict[str, Any] = dict(url.psycopg_kwargs())
        self._kwargs.setdefault("connect_timeout", _DEFAULT_CONNECT_TIMEOUT)
        self._closed = False
        self._close_lock = threading.Lock()
        self._sweeps = SweepSchedule()
        #: The last claim walked a dense backlog and came back full (`PostgresOutbox.claim`).
        self._dense_backlog = False
        self._owner_lock = threading.Lock()
        self._owner_conns: dict[str, tuple[psycopg.Connection[Any], float]] = {}
        # One direct connection first: a pool hides the reason of a failed connect behind a
        # timeout, and the first connect is where wrong credentials and typos show up.
        with self._direct() as conn:
            self._migrate(conn)
            seq = conn.execute("SELECT pg_get_serial_sequence(%s, 'id')", [self._t]).fetchone()
        #: The identity sequence of `id`: writers draw a batch's ids from it before COPY.
        self._id_seq: str = seq[0] if seq is not None and seq[0] is not None else f"{url.table}_id_seq"
        from psycopg_pool import ConnectionPool

        self._pool: ConnectionPool[Any] = ConnectionPool(
            kwargs={**self._kwargs, "autocommit": True},
            min_size=1,
            max_size=pool_size,
            open=True,
            name=f"outbox-{url.table}",
            timeout=float(self._kwargs["connect_timeout"]) + 5.0,
            configure=_configure,
        )

    # -- connections and errors --------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        if self.url.password:
            text = text.replace(self.url.password, "***")
        return text.strip().replace("\n", " ")

    def _error(self, exc: BaseException, doing: str = "") -> StoreError:
        """A StoreError naming host:port/database, with the server's reason, never the password."""
        psycopg = self._psycopg
        reason = self._scrub(str(exc))
        sqlstate = getattr(exc, "sqlstate", None)
        if sqlstate == "42501" or "permission denied" in reason:
            text = f"permission denied ({reason})"
        elif sqlstate == "3D000" or ("database" in reason and "does not exist" in reason):
            text = f"database {self.url.database!r} does not exist"
        elif sqlstate == "28P01" or "password authentication failed" in reason:
            text = f"authentication failed for user {self.url.user!r} (wrong user or password)"
        elif isinstance(exc, psycopg.OperationalError) and "connection" in reason.lower():
            text = f"cannot connect to the PostgreSQL server ({reason})"
        else:
            text = reason or type(exc).__name__
        prefix = f"PostgreSQL outbox {self._where}"
        if doing:
            prefix += f" ({doing})"
        return StoreError(f"{prefix}: {text}")

    @contextmanager
    def _direct(self) -> Iterator[psycopg.Connection[Any]]:
        psycopg = self._psycopg
        try:
            conn = psycopg.connect(**self._kwargs, autocommit=True)
        except psycopg.Error as exc:
            raise self._error(exc) from None
        except UnicodeError:  # the resolver's IDNA encoding refused a label (empty, or over 63)
            raise StoreError(
                f"PostgreSQL outbox {self._where}: host {self._kwargs.get('host')!r} is not a valid host name"
            ) from None
        try:
            yield conn
        except psycopg.Error as exc:
            raise self._error(exc) from None
        finally:
            conn.close()

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection; psycopg and pool errors become StoreErrors."""
        from psycopg_pool import PoolTimeout

        if self._closed:
            raise StoreError(f"PostgreSQL outbox {self._where} is closed")
        try:
            with self._pool.connection() as conn:
                yield conn
        except PoolTimeout:
            raise StoreError(
                f"PostgreSQL outbox {self._where}: no connection to the server within "
                f"{self._pool.timeout:.0f} s (server down or unreachable?)"
            ) from None
        except self._psycopg.Error as exc:
            raise self._error(exc) from None

    @contextmanager
    def _tx(self) -> Iterator[psycopg.Connection[Any]]:
        """One short transaction on a pooled connection."""
        with self._conn() as conn, conn.transaction():
            yield conn

    # -- schema ------------------------------------------------------------------------------

    def migrate(self) -> None:
        with self._conn() as conn:
            self._migrate(conn)

    def _version(self, conn: psycopg.Connection[Any]) -> int | None:
        """The stored schema version; None when there is no version table yet."""
        exists = conn.execute(
            "SELECT to_regclass(%s)", [f'"{self._schema}"."{self._table_name}_schema_version"']
        ).fetchone()
        if exists is None or exists[0] is None:
            return None
        row = conn.execute(f"SELECT max(version) FROM {self._version_t}").fetchone()
        return int(row[0]) if row is not None and row[0] is not None else 0

    def _migrate(self, conn: psycopg.Connection[Any]) -> None:
        version = self._version(conn)
        if version == SCHEMA_VERSION:
            return  # the common case: no lock, no DDL
        if version is not None and version > SCHEMA_VERSION:
            raise StoreError(
                f"PostgreSQL outbox {self._where}: schema version {version} of {self._t} is newer "
                f"than this kafka-outbox ({SCHEMA_VERSION}); upgrade the library"
            )
        if not self._create:
            table = conn.execute("SELECT to_regclass(%s)", [self._t]).fetchone()
            if table is None or table[0] is None:
                raise StoreNotFoundError(
                    f"PostgreSQL outbox {self._where}: table {self._schema}.{self._table_name} does not exist"
                )
        try:
            with conn.transaction():
                # Two processes starting at once must not both run the DDL.
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [self._migrate_lock])
                has_schema = conn.execute(
                    "SELECT 1 FROM pg_namespace WHERE nspname = %s", [self._schema]
                ).fetchone()
                if not has_schema:
                    # Only when missing: CREATE SCHEMA IF NOT EXISTS checks the CREATE privilege
                    # first, and a user with rights on an existing schema need not have it.
                    conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self._schema}"')
                conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {self._version_t} "
                    "(version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
                )
                version = self._version(conn) or 0
                steps = migrations(self._schema, self._table_name)
                for v in range(version + 1, SCHEMA_VERSION + 1):
                    for stmt in steps[v]:
                        conn.execute(stmt)
                    conn.execute(
                        f"INSERT INTO {self._version_t} (version, applied_at) VALUES (%s, %s)",
                        [v, time.time()],
                    )
                    log.info("outbox %s: schema migrated to version %d", self.location, v)
        except self._psycopg.Error as exc:
            raise self._error(exc, f"creating {self._schema}.{self._table_name}") from None

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._conn() as conn:
            return conn.execute(sql, args).fetchall()

