"""Where an outbox is: `StoreURL`, and the pieces every backend's URL parser shares.

A backend parses its own URLs (`outbox.stores.registry.Backend.parse`); a database server's URL
(``scheme://user:password@host:port/database?options``) goes through `parse_server_url`, a file's
is a `StoreURL` with a `path`. Neither a password nor a URL holding one reaches a message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from outbox.errors import ConfigError

DEFAULT_TABLE = "outbox"


@dataclass(frozen=True)
class StoreURL:
    """A parsed outbox location. `str()` and `repr()` never show a password.

    `kind` is the backend's name (`outbox.stores.registry`), and the scheme `redacted()` writes.
    A file-backed store has a `path`; a server's store the rest.
    """

    kind: str
    path: str = ""  # a file-backed store's file
    host: str = ""
    port: int = 0
    database: str = ""
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    schema: str = ""
    table: str = DEFAULT_TABLE
    options: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return self.redacted()

    def redacted(self) -> str:
        """The URL for logs and messages: the password replaced by ***."""
        if self.path:
            return f"{self.kind}:///{self.path}"
        auth = ""
        if self.user:
            auth = quote(self.user, safe="") + (":***" if self.password else "") + "@"
        return f"{self.kind}://{auth}{self.host}:{self.port}/{self.database}"

    def where(self) -> str:
        """Names the database for an error message: its file, or host and database, never credentials."""
        if self.path:
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


def parse_server_url(
    url: str,
    *,
    kind: str,
    label: str,
    port: int,
    schema: str = "",
    option: Callable[[str], bool] = lambda name: True,
) -> StoreURL:
    """A database server's URL: ``scheme://user:password@host:port/database?options``.

    Query options: ``user`` and ``password`` (credentials), ``currentSchema`` / ``schema`` (the
    schema, default `schema`), ``table``; any other option is kept for the driver when
    `option(name)` says so, else dropped. `label` names the database in errors ("PostgreSQL").

    Raises:
        ConfigError: no host, no database, a bad port, or a schema or table name that is not
            letters, digits and _ (never echoing a password).
    """
    example = f"{kind}://user@host:port/db"
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed "[" (IPv6 host); not echoed: it may hold a password
        raise ConfigError(f"{label} outbox URL is malformed ({exc}): use {example}") from None
    if not parts.hostname:
        raise ConfigError(f"{label} outbox URL needs a host: {safe_url(url)}")
    check_host(parts.hostname, url, label)
    database = unquote(parts.path.lstrip("/"))
    if not database:
        raise ConfigError(f"{label} outbox URL needs a database name: {safe_url(url)}")
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    table = DEFAULT_TABLE
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
        elif option(name):
            options.append((name, value))
    for ident in (schema, table) if schema else (table,):
        if not ident.replace("_", "").isalnum():
            raise ConfigError(f"schema and table names must be letters, digits and _: {ident!r}")
    try:
        number = parts.port or port
    except ValueError as exc:
        raise ConfigError(f"{label} outbox URL has a bad port: {safe_url(url)}") from exc
    return StoreURL(
        kind=kind,
        host=parts.hostname,
        port=number,
        database=database,
        user=user,
        password=password,
        schema=schema,
        table=table,
        options=tuple(options),
    )


def check_host(host: str, url: str, label: str) -> None:
    """A host name the resolver can take: the name lookup IDNA-encodes it, and a name it cannot
    encode (a control character, an empty or over-long label) raised UnicodeError out of the
    first connection. A Unix-socket directory is not a name."""
    if host.startswith(("/", "%2f")):
        return
    try:
        host.encode("idna")
    except UnicodeError:
        raise ConfigError(f"{label} outbox URL has an invalid host name {host!r}: {safe_url(url)}") from None


def safe_url(url: str) -> str:
    """The URL with any password removed, for error messages."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password:
        netloc = netloc.replace(":" + parts.password + "@", ":***@")
    query = "&".join(
        f"{k}=***" if k.lower() == "password" else f"{k}={v}" for k, v in parse_qsl(parts.query, keep_blank_values=True)
    )
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
