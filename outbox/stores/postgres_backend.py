"""The PostgreSQL backend as the store registry knows it (`outbox.stores.registry`): its URLs,
its opener, its DB-API connections and its JDBC driver. psycopg is imported only to open a store.

Accepted forms:
    postgresql://user:pass@host:port/db?options     postgres://...
    jdbc:postgresql://host:port/db?user=..&password=..&currentSchema=..
Query options understood: currentSchema / schema, table; the rest of the libpq parameters
(sslmode, connect_timeout, ...) pass through to psycopg.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outbox.stores.location import StoreURL, parse_server_url
from outbox.stores.registry import Backend, Jdbc

if TYPE_CHECKING:
    from outbox.stores.base import Outbox

#: The options a JDBC URL may carry that mean something to libpq too (the rest are the driver's).
_LIBPQ_IN_JDBC = ("sslmode", "connect_timeout", "application_name", "sslrootcert")


def parse(url: str) -> StoreURL:
    """A ``postgresql://``, ``postgres://`` or ``jdbc:postgresql://`` URL."""
    jdbc = url.lower().startswith("jdbc:")
    return parse_server_url(
        url[len("jdbc:") :] if jdbc else url,
        kind="postgresql",
        label="PostgreSQL",
        port=5432,
        schema="public",
        option=lambda name: not jdbc or name.lower() in _LIBPQ_IN_JDBC,
    )


def _open(url: StoreURL, create: bool) -> Outbox:
    from outbox.stores.postgres import PostgresOutbox  # psycopg is an optional extra

    return PostgresOutbox(url, create=create)


BACKEND = Backend(
    name="postgresql",
    prefixes=("postgresql:", "postgres:", "jdbc:postgresql:"),
    examples=("postgresql://host/db", "jdbc:postgresql://host/db"),
    parse=parse,
    open=_open,
    connections=("psycopg",),
    extra="kafka-outbox[postgres]",
    jdbc=Jdbc(
        driver="org.postgresql.Driver",
        package="org.postgresql:postgresql:42.7.14",
        url=lambda url: f"jdbc:postgresql://{url.host}:{url.port}/{url.database}",
        os_jars=("/usr/share/java/postgresql.jar",),
    ),
)
