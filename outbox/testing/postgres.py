"""Throw-away PostgreSQL databases for tests."""

from __future__ import annotations

import os
import uuid
from urllib.parse import urlsplit, urlunsplit

__all__ = ["DEFAULT_POSTGRES_URL", "create_database", "drop_database", "server_url"]

DEFAULT_POSTGRES_URL = "postgresql://outbox:outbox@127.0.0.1:5432/postgres"
"""Server used when ``OUTBOX_TEST_POSTGRES`` is not set (``make services`` sets it up)."""


def server_url() -> str:
    """URL of the PostgreSQL server (and a role with CREATEDB) that tests may create databases on.

    Returns:
        ``$OUTBOX_TEST_POSTGRES`` if set, else :data:`DEFAULT_POSTGRES_URL`.
    """
    return os.environ.get("OUTBOX_TEST_POSTGRES") or DEFAULT_POSTGRES_URL


def _with_db(url: str, db: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + db, parts.query, parts.fragment))


def create_database(base_url: str | None = None, prefix: str = "outbox_test_") -> str:
    """Create a fresh, uniquely named database and return a URL to it.

    Args:
        base_url: Server URL (default :func:`server_url`); its role needs CREATEDB.
        prefix: Name prefix of the new database.

    Returns:
        ``base_url`` with its database replaced by the new one.

    Raises:
        psycopg.Error: The server is unreachable or the role may not create databases.
    """
    import psycopg

    base_url = base_url or server_url()
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return _with_db(base_url, name)


def drop_database(url: str, base_url: str | None = None) -> None:
    """Drop the database ``url`` points at (forcing other sessions off), via ``base_url``'s server."""
    import psycopg

    base_url = base_url or server_url()
    name = urlsplit(url).path.lstrip("/")
    with psycopg.connect(base_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
