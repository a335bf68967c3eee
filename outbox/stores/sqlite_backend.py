"""The SQLite backend as the store registry knows it (`outbox.stores.registry`): its URLs, its
opener, its DB-API connections and its JDBC driver.

Accepted forms:
    sqlite:///relative/or/abs.db   sqlite:////abs/path.db   (SQLAlchemy style)
    jdbc:sqlite:/abs/path.db       jdbc:sqlite:relative.db  (the sqlite-jdbc driver's form)
    /plain/path.db or ./x.db       (a bare path means SQLite)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from urllib.parse import unquote

from outbox.errors import ConfigError
from outbox.stores.location import StoreURL
from outbox.stores.registry import Backend, Jdbc

if TYPE_CHECKING:
    from outbox.stores.base import Outbox


def parse(url: str) -> StoreURL:
    """A SQLite URL or a bare path."""
    lower = url.lower()
    if lower.startswith("jdbc:sqlite:"):
        path = url[len("jdbc:sqlite:") :]
        return _file(path[2:] if path.startswith("//") else path, url)
    if lower.startswith("sqlite:"):
        rest = url[len("sqlite:") :]
        if rest.startswith("///"):
            path = rest[3:]
        elif rest.startswith("//"):
            raise ConfigError(f"SQLite URL needs three slashes: sqlite:///path.db (got {url!r})")
        else:
            path = rest
        return _file(unquote(path.split("?", 1)[0]), url)
    return _file(url, url)


def _file(path: str, original: str) -> StoreURL:
    if not path or path == ":memory:":
        raise ConfigError(f"SQLite outbox URL needs a file path (got {original!r})")
    return StoreURL(kind="sqlite", path=path)


def _open(url: StoreURL, create: bool) -> Outbox:
    from outbox.stores.sqlite import SQLiteOutbox

    return SQLiteOutbox(url.path, create=create)


def _files(url: StoreURL) -> dict[str, str]:
    """The database file and its write-ahead log (which can hold much of the data between checkpoints)."""
    path = os.path.abspath(url.path)
    return {"file": path, "wal": path + "-wal"}


BACKEND = Backend(
    name="sqlite",
    prefixes=("sqlite:", "jdbc:sqlite:"),
    examples=("sqlite:///path.db", "jdbc:sqlite:/path.db"),
    parse=parse,
    open=_open,
    connections=("sqlite3",),
    jdbc=Jdbc(
        driver="org.sqlite.JDBC",
        package="org.xerial:sqlite-jdbc:3.54.1.0",
        url=lambda url: f"jdbc:sqlite:{os.path.abspath(url.path)}",
        os_jars=("/usr/share/java/sqlite-jdbc.jar", "/usr/share/java/xerial-sqlite-jdbc.jar"),
    ),
    bare_paths=True,
    files=_files,
)
