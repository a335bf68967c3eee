"""The store registry: every backend, found by the URL schemes it declares.

A backend is a `Backend`: its name (the `StoreURL.kind` of its URLs), the URL beginnings it
takes, its parser and opener, and what other parts ask of it: which DB-API connections
`produce(..., transaction=...)` takes for it, and the JDBC driver a Spark job reads it with.
The SDK, the CLI, the console and the Spark job ask the registry, never a scheme of their own.

The built-in backends (SQLite, PostgreSQL) are always there. A package adds one with an entry
point of the group ``kafka_outbox.stores`` naming its `Backend`::

    [project.entry-points."kafka_outbox.stores"]
    mystore = "mypackage.store:BACKEND"

Entry points are read the first time a URL no built-in backend takes is parsed, or when every
backend is asked for (`backends()`); a backend that does not load is a `ConfigError` naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from outbox.errors import ConfigError
from outbox.stores.location import StoreURL

if TYPE_CHECKING:
    from outbox.stores.base import Outbox

#: The entry-point group a package registers its backends in.
ENTRY_POINT_GROUP = "kafka_outbox.stores"

#: The modules of the built-in backends, each with a `BACKEND`.
_BUILT_IN = ("outbox.stores.sqlite_backend", "outbox.stores.postgres_backend")


@dataclass(frozen=True)
class Jdbc:
    """How a JDBC reader (the Spark job) reads a backend's table.

    Attributes:
        driver: the driver's class.
        package: its Maven coordinates (``group:artifact:version``), what `spark-submit --packages` takes.
        url: the JDBC URL of a store's URL (credentials go in `properties`).
        os_jars: where the operating system's package puts the driver's jar, when there is one.
    """

    driver: str
    package: str
    url: Callable[[StoreURL], str]
    os_jars: tuple[str, ...] = ()

    @property
    def jar(self) -> str:
        """The jar's file name as Maven stores it (``artifact-version.jar``)."""
        _group, artifact, version = self.package.split(":")
        return f"{artifact}-{version}.jar"

    def properties(self, url: StoreURL) -> dict[str, str]:
        """Driver class and credentials for a JDBC reader."""
        props = {"driver": self.driver}
        if url.user:
            props["user"] = url.user
        if url.password:
            props["password"] = url.password
        return props


@dataclass(frozen=True)
class Backend:
    """One kind of store, as the registry knows it.

    Attributes:
        name: the `StoreURL.kind` of its URLs ("sqlite", "postgresql").
        prefixes: the URL beginnings it takes, lower case ("postgresql:", "jdbc:postgresql:").
        examples: the URL forms the "unknown scheme" error lists.
        parse: a URL (beginning with one of `prefixes`) to its `StoreURL`; `ConfigError` if bad.
        open: the store of a `StoreURL`; `create`: make a missing database's tables (False: a
            mistyped location is an error, the CLI's choice).
        connections: the top-level modules whose DB-API connections `produce(..., transaction=...)`
            takes as they are ("sqlite3", "psycopg").
        extra: what to install for it ("kafka-outbox[postgres]"), for a missing driver's message.
        jdbc: its JDBC driver for the Spark job; None: no JDBC reads.
        bare_paths: a location without a scheme is this backend's file path.
        files: a file-backed store's files by role ("file", "wal"), for `outbox status`.
    """

    name: str
    prefixes: tuple[str, ...]
    examples: tuple[str, ...]
    parse: Callable[[str], StoreURL]
    open: Callable[[StoreURL, bool], Outbox]
    connections: tuple[str, ...] = ()
    extra: str | None = None
    jdbc: Jdbc | None = None
    bare_paths: bool = False
    files: Callable[[StoreURL], dict[str, str]] | None = None


@functools.cache
def built_in() -> tuple[Backend, ...]:
    """The backends that come with kafka-outbox."""
    return tuple(_checked(import_module(m).BACKEND, m) for m in _BUILT_IN)


@functools.cache
def backends() -> tuple[Backend, ...]:
    """Every backend: the built-in ones, then those of the entry points (a name already taken is
    left out)."""
    found = {b.name: b for b in built_in()}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            loaded: Any = ep.load()
        except Exception as exc:
            raise ConfigError(f"outbox store backend {ep.name!r} ({ep.value}) does not load: {exc}") from exc
        backend = _checked(loaded, ep.value)
        found.setdefault(backend.name, backend)
    return tuple(found.values())


def _checked(obj: object, where: str) -> Backend:
    if not isinstance(obj, Backend):
        raise ConfigError(f"outbox store backend {where} is not an outbox.stores.registry.Backend")
    return obj


def backend(kind: str) -> Backend:
    """The backend of a `StoreURL.kind`.

    Raises:
        ConfigError: no backend has that name.
    """
    for b in (*built_in(), *backends()):
        if b.name == kind:
            return b
    raise ConfigError(f"no outbox store backend is named {kind!r}")


def parse_url(url: str) -> StoreURL:
    """Parse any outbox URL a backend takes; a bare path is the file of the backend that takes those.

    Raises:
        ConfigError: the URL is empty, its scheme is no backend's, or its backend finds it bad.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("outbox URL is empty")
    url = url.strip()
    lower = url.lower()
    for group in (built_in, backends):
        # The longest beginning first: "jdbc:postgresql:" before any "jdbc:" a backend may take.
        taken = sorted(((p, b) for b in group() for p in b.prefixes), key=lambda pb: -len(pb[0]))
        for prefix, b in taken:
            if lower.startswith(prefix):
                return b.parse(url)
        if "://" not in url and not (":" in url.split("/", 1)[0] and not url.startswith((".", "/"))):
            for b in group():
                if b.bare_paths:
                    return b.parse(url)
    scheme = url.split(":", 1)[0]
    forms = [f for b in backends() for f in b.examples]
    accepted = ", ".join(forms[:-1]) + f" or {forms[-1]}" if len(forms) > 1 else "".join(forms)
    raise ConfigError(f"unknown outbox URL scheme {scheme!r}: use {accepted}")


def transaction_backend(module: str) -> Backend | None:
    """The backend whose DB-API connections are of `module` (a connection type's ``__module__``)."""
    top = module.split(".", 1)[0]
    for group in (built_in, backends):
        for b in group():
            if top in b.connections:
                return b
    return None


def connection_modules() -> list[str]:
    """The DB-API modules whose connections `produce(..., transaction=...)` takes, for a message."""
    return [m for b in backends() for m in b.connections]


def jdbc_of(url: StoreURL) -> Jdbc:
    """The JDBC driver a reader reads `url`'s store with.

    Raises:
        ConfigError: its backend has none.
    """
    jdbc = backend(url.kind).jdbc
    if jdbc is None:
        raise ConfigError(f"outbox {url.redacted()} has no JDBC driver: a Spark job cannot read it")
    return jdbc
