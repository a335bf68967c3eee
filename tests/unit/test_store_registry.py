"""The store registry: a backend a package registers by entry point is found by its URL scheme,
and the SDK's callers (open_outbox, transaction=, the Spark job's driver lookup) ask it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import open_outbox
from outbox.errors import ConfigError
from outbox.stores import registry
from outbox.stores.memory import MemoryOutbox
from outbox.stores.urls import parse_url
from outbox.transactions import dbapi_connection

PLUGIN = """
from outbox.stores.location import StoreURL, parse_server_url
from outbox.stores.memory import MemoryOutbox
from outbox.stores.registry import Backend, Jdbc

class Connection:  # a DB-API driver's connection class, as the transaction= lookup sees it
    pass

OPENED = []

def _open(url, create):
    OPENED.append((url, create))
    return MemoryOutbox()

BACKEND = Backend(
    name="toy",
    prefixes=("toy:",),
    examples=("toy://host/db",),
    parse=lambda url: parse_server_url(url, kind="toy", label="Toy", port=7777),
    open=_open,
    connections=("toydriver",),
    jdbc=Jdbc(driver="org.toy.Driver", package="org.toy:toy-jdbc:1.2", url=lambda u: f"jdbc:toy://{u.host}"),
)
"""


@pytest.fixture
def toy_plugin(tmp_path: Path) -> Iterator[None]:
    """A package on sys.path that registers the backend `toy` by its distribution's entry point."""
    (tmp_path / "toydriver").mkdir()
    (tmp_path / "toydriver" / "__init__.py").write_text(PLUGIN)
    info = tmp_path / "toydriver-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toydriver\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\ntoy = toydriver:BACKEND\n")
    sys.path.insert(0, str(tmp_path))
    registry.backends.cache_clear()
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("toydriver", None)
        registry.backends.cache_clear()


def test_a_registered_backend_is_found_by_its_scheme_and_opened(toy_plugin: None) -> None:
    u = parse_url("toy://app:s3cr3t@db.example/orders?table=ob")
    assert (u.kind, u.host, u.port, u.database, u.table) == ("toy", "db.example", 7777, "orders", "ob")
    assert u.redacted() == "toy://app:***@db.example:7777/orders"
    store = open_outbox("toy://db.example/orders", create=False)
    import toydriver  # type: ignore[import-not-found]

    assert isinstance(store, MemoryOutbox) and toydriver.OPENED[0][1] is False
    assert registry.jdbc_of(u).jar == "toy-jdbc-1.2.jar"
    assert registry.jdbc_of(u).properties(u) == {"driver": "org.toy.Driver", "user": "app", "password": "s3cr3t"}
    conn = toydriver.Connection()
    assert dbapi_connection(conn) is conn


def test_the_unknown_scheme_error_lists_the_registered_backends_too(toy_plugin: None) -> None:
    with pytest.raises(
        ConfigError, match=r"unknown outbox URL scheme 'nope': use .*postgresql://host/db.* or toy://host/db"
    ):
        parse_url("nope://x")


def test_a_backend_that_does_not_load_is_named(tmp_path: Path) -> None:
    info = tmp_path / "broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\nbroken = no_such_module:BACKEND\n")
    sys.path.insert(0, str(tmp_path))
    registry.backends.cache_clear()
    try:
        named = r"outbox store backend 'broken' \(no_such_module:BACKEND\) does not load"
        with pytest.raises(ConfigError, match=named):
            parse_url("broken://x")
        assert parse_url("x.db").kind == "sqlite"  # the built-in backends need no entry point
    finally:
        sys.path.remove(str(tmp_path))
        registry.backends.cache_clear()


def test_an_unknown_connection_names_the_drivers_the_backends_take() -> None:
    with pytest.raises(ConfigError, match="transaction must be a sqlite3, psycopg or pymysql connection"):
        dbapi_connection(object())


def test_an_unknown_backend_name_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="no outbox store backend is named 'nothing'"):
        registry.backend("nothing")
