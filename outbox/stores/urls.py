"""The one parser for outbox URLs, used by the SDK, the CLI and the Spark job.

Accepted forms:
    sqlite:///relative/or/abs.db   sqlite:////abs/path.db   (SQLAlchemy style)
    jdbc:sqlite:/abs/path.db       jdbc:sqlite:relative.db  (the sqlite-jdbc driver's form)
    /plain/path.db or ./x.db       (a bare path means SQLite)
    postgresql://user:pass@host:port/db?options     postgres://...
    jdbc:postgresql://host:port/db?user=..&password=..&currentSchema=..
Query options understood for PostgreSQL: currentSchema / schema, table; the rest of
the libpq parameters (sslmode, connect_timeout, ...) pass through to psycopg.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from outbox.errors import ConfigError

DEFAULT_TABLE = "outbox"
_OUR_OPTIONS = {"currentschema", "schema", "table"}


@dataclass(frozen=True)
class StoreURL:
    """A parsed outbox location. `str()` and `repr()` never show a password."""

    kind: str  # "sqlite" or "postgresql"
    path: str = ""  # SQLite file path
    host: str = ""
    port: int = 5432
    database: str = ""
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    schema: str = "public"
    table: str = DEFAULT_TABLE
    options: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return self.redacted()

    def redacted(self) -> str:
        """The URL for logs and messages: the password replaced by ***."""
        if self.kind == "sqlite":
            return f"sqlite:///{self.path}" if not self.path.startswith("/") else f"sqlite:///{self.path}"
        auth = ""
        if self.user:
            auth = quote(self.user, safe="") + (":***" if self.password else "") + "@"
        return f"postgresql://{auth}{self.host}:{self.port}/{self.database}"

    def where(self) -> str:
        """Names the database for an error message: host and database, never credentials."""
        if self.kind == "sqlite":
            return self.path
        return f"{self.host}:{self.port}/{self.database}"

    def psycopg_kwargs(self) -> dict[str, str | int]:
        """Connection keywords for psycopg (libpq parameter names)."""
        kw: dict[str, str | int] = {"host": self.host, "port": self.port, "dbname": self.database}
        if self.user:
            kw["user"] = self.user
        if self.password:
            kw["password"] = self.password
        kw.update(dict(self.options))
        return kw

    def jdbc_url(self) -> str:
        """The JDBC URL for Spark's reader (credentials go in `jdbc_properties`)."""
        if self.kind == "sqlite":
            return f"jdbc:sqlite:{os.path.abspath(self.path)}"
        return f"jdbc:postgresql://{self.host}:{self.port}/{self.database}"

    def jdbc_properties(self) -> dict[str, str]:
        """Driver class and credentials for Spark's JDBC reader."""
        if self.kind == "sqlite":
            return {"driver": "org.sqlite.JDBC"}
        props = {"driver": "org.postgresql.Driver"}
        if self.user:
            props["user"] = self.user
        if self.password:
            props["password"] = self.password
        return props


def parse_url(url: str) -> StoreURL:
    """Parse any accepted outbox URL.

    Raises:
        ConfigError: the scheme is unknown or the URL lacks a path or host.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("outbox URL is empty")
    url = url.strip()
    lower = url.lower()
    if lower.startswith("jdbc:sqlite:"):
        path = url[len("jdbc:sqlite:") :]
        if path.startswith("//"):
            path = path[2:]
        return _sqlite(path, url)
    if lower.startswith("sqlite:"):
        rest = url[len("sqlite:") :]
        if rest.startswith("///"):
            path = rest[3:]
        elif rest.startswith("//"):
            raise ConfigError(f"SQLite URL needs three slashes: sqlite:///path.db (got {url!r})")
        else:
            path = rest
        return _sqlite(unquote(path.split("?", 1)[0]), url)
    if lower.startswith("jdbc:postgresql:"):
        return _postgres(url[len("jdbc:") :], jdbc=True)
    if lower.startswith(("postgresql:", "postgres:")):
        return _postgres(url, jdbc=False)
    if "://" in url or (":" in url.split("/", 1)[0] and not url.startswith((".", "/"))):
        scheme = url.split(":", 1)[0]
        raise ConfigError(
            f"unknown outbox URL scheme {scheme!r}: use sqlite:///path.db, jdbc:sqlite:/path.db, "
            "postgresql://host/db or jdbc:postgresql://host/db"
        )
    return _sqlite(url, url)


def _sqlite(path: str, original: str) -> StoreURL:
    if not path or path == ":memory:":
        raise ConfigError(f"SQLite outbox URL needs a file path (got {original!r})")
    return StoreURL(kind="sqlite", path=path)


def _postgres(url: str, *, jdbc: bool) -> StoreURL:
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed "[" (IPv6 host); not echoed: it may hold a password
        raise ConfigError(f"PostgreSQL outbox URL is malformed ({exc}): use postgresql://user@host:port/db") from None
    if not parts.hostname:
        raise ConfigError(f"PostgreSQL outbox URL needs a host: {_safe(url)}")
    _check_host(parts.hostname, url)
    database = unquote(parts.path.lstrip("/"))
    if not database:
        raise ConfigError(f"PostgreSQL outbox URL needs a database name: {_safe(url)}")
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    schema, table = "public", DEFAULT_TABLE
    options: list[tuple[str, str]] = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        low = name.lower()
        if low == "user":
            user = value
        elif low == "password":
            password = value
        elif low in ("currentschema", "schema"):
            schema = value
        elif low == "table":
            table = value
        elif jdbc and low not in ("sslmode", "connect_timeout", "application_name", "sslrootcert"):
            continue  # JDBC-only driver options (loginTimeout, ...) mean nothing to libpq.
        else:
            options.append((name, value))
    for ident in (schema, table):
        if not ident.replace("_", "").isalnum():
            raise ConfigError(f"schema and table names must be letters, digits and _: {ident!r}")
    try:
        port = parts.port or 5432
    except ValueError as exc:
        raise ConfigError(f"PostgreSQL outbox URL has a bad port: {_safe(url)}") from exc
    return StoreURL(
        kind="postgresql",
        host=parts.hostname,
        port=port,
        database=database,
        user=user,
        password=password,
        schema=schema,
        table=table,
        options=tuple(options),
    )


def _check_host(host: str, url: str) -> None:
    """A host name the resolver can take: the name lookup IDNA-encodes it, and a name it cannot
    encode (a control character, an empty or over-long label) raised UnicodeError out of the
    first connection. A Unix-socket directory is not a name."""
    if host.startswith(("/", "%2f")):
        return
    try:
        host.encode("idna")
    except UnicodeError:
        raise ConfigError(f"PostgreSQL outbox URL has an invalid host name {host!r}: {_safe(url)}") from None


def _safe(url: str) -> str:
    """The URL with any password removed, for error messages."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password:
        netloc = netloc.replace(":" + parts.password + "@", ":***@")
    query = "&".join(
        f"{k}=***" if k.lower() == "password" else f"{k}={v}"
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    )
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
