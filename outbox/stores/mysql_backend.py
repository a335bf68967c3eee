"""The MySQL / MariaDB backend as the store registry knows it (`outbox.stores.registry`), added
by the entry point ``mysql`` of the group ``kafka_outbox.stores``. PyMySQL is imported only to
open a store.

Accepted forms:
    mysql://user:password@host:port/database?table=outbox     mariadb://...
    jdbc:mysql://host:port/database?user=..&password=..        jdbc:mariadb://...
The driver's own options are not read. The Spark job reads the table through MariaDB
Connector/J (it also reads MySQL), its session in ANSI quotes as the store's SQL is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outbox.stores.location import StoreURL, parse_server_url
from outbox.stores.registry import Backend, Jdbc

if TYPE_CHECKING:
    from outbox.stores.base import Outbox


def parse(url: str) -> StoreURL:
    """A ``mysql://``, ``mariadb://``, ``jdbc:mysql://`` or ``jdbc:mariadb://`` URL."""
    rest = url[len("jdbc:") :] if url.lower().startswith("jdbc:") else url
    return parse_server_url(
        "mysql" + rest[rest.index(":") :], kind="mysql", label="MySQL", port=3306, option=lambda name: False
    )


def _open(url: StoreURL, create: bool) -> Outbox:
    from outbox.stores.mysql import MySQLOutbox  # PyMySQL is the optional "mysql" extra

    return MySQLOutbox(url, create=create)


BACKEND = Backend(
    name="mysql",
    prefixes=("mysql:", "mariadb:", "jdbc:mysql:", "jdbc:mariadb:"),
    examples=("mysql://host/db",),
    parse=parse,
    open=_open,
    connections=("pymysql",),
    extra="kafka-outbox[mysql]",
    jdbc=Jdbc(
        driver="org.mariadb.jdbc.Driver",
        package="org.mariadb.jdbc:mariadb-java-client:3.5.6",
        url=lambda url: f"jdbc:mariadb://{url.host}:{url.port}/{url.database}?sessionVariables=sql_mode=ANSI_QUOTES",
    ),
)
