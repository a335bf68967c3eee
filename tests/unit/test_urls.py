"""The one outbox URL parser: every accepted form, the errors, and that passwords never leak."""

from __future__ import annotations

import os

import pytest

from outbox.errors import ConfigError
from outbox.stores.registry import jdbc_of
from outbox.stores.urls import DEFAULT_TABLE, StoreURL, parse_url

SECRET = "s3cr3t-pw"


def _no_secret(u: StoreURL) -> None:
    for text in (str(u), repr(u), u.redacted(), u.where(), jdbc_of(u).url(u)):
        assert SECRET not in text


# -- PostgreSQL ---------------------------------------------------------------------------------


def test_jdbc_postgresql_with_query_credentials_and_schema() -> None:
    u = parse_url(f"jdbc:postgresql://db.example:6543/orders?user=app&password={SECRET}&currentSchema=ob")
    assert u.kind == "postgresql"
    assert (u.host, u.port, u.database) == ("db.example", 6543, "orders")
    assert (u.user, u.password, u.schema, u.table) == ("app", SECRET, "ob", DEFAULT_TABLE)
    assert u.where() == "db.example:6543/orders"
    _no_secret(u)


def test_jdbc_postgresql_drops_jdbc_only_options_but_keeps_libpq_ones() -> None:
    u = parse_url("jdbc:postgresql://h/db?loginTimeout=5&sslmode=require&connect_timeout=3&table=my_outbox")
    assert dict(u.options) == {"sslmode": "require", "connect_timeout": "3"}
    assert u.table == "my_outbox"
    assert u.port == 5432


def test_plain_postgresql_url() -> None:
    u = parse_url(f"postgresql://app:{SECRET}@10.0.0.5:5433/orders?application_name=x&schema=s1")
    assert (u.host, u.port, u.database, u.user, u.password) == ("10.0.0.5", 5433, "orders", "app", SECRET)
    assert u.schema == "s1"
    assert dict(u.options) == {"application_name": "x"}
    assert u.psycopg_kwargs() == {
        "host": "10.0.0.5",
        "port": 5433,
        "dbname": "orders",
        "user": "app",
        "password": SECRET,
        "application_name": "x",
    }
    _no_secret(u)


def test_postgres_scheme_alias_and_percent_encoded_credentials() -> None:
    u = parse_url("postgres://us%40er:p%3Aw%40d@host/db%2Dx")
    assert (u.user, u.password, u.database) == ("us@er", "p:w@d", "db-x")
    assert "p:w@d" not in str(u) and "p%3Aw" not in str(u)


def test_scheme_is_case_insensitive() -> None:
    assert parse_url("JDBC:PostgreSQL://h/db").kind == "postgresql"
    assert parse_url("JDBC:SQLITE:/tmp/x.db").path == "/tmp/x.db"


def test_redacted_shows_user_but_never_password() -> None:
    u = parse_url(f"postgresql://app:{SECRET}@h:5432/db")
    assert u.redacted() == "postgresql://app:***@h:5432/db"
    assert str(u) == u.redacted()
    assert SECRET not in repr(u)
    assert parse_url("postgresql://app@h/db").redacted() == "postgresql://app@h:5432/db"


def test_jdbc_url_and_properties_for_spark() -> None:
    u = parse_url(f"postgresql://app:{SECRET}@h:5432/db?currentSchema=s")
    assert jdbc_of(u).url(u) == "jdbc:postgresql://h:5432/db"
    assert jdbc_of(u).properties(u) == {"driver": "org.postgresql.Driver", "user": "app", "password": SECRET}
    bare = parse_url("postgresql://h/db")
    assert jdbc_of(bare).properties(bare) == {"driver": "org.postgresql.Driver"}


@pytest.mark.parametrize(
    "url, needle",
    [
        (f"jdbc:postgresql:///db?user=u&password={SECRET}", "needs a host"),
        (f"postgresql://u:{SECRET}@h/", "needs a database"),
        (f"postgresql://u:{SECRET}@h:notaport/db", "bad port"),
        (f"jdbc:postgresql://h:99999/db?password={SECRET}", "bad port"),
        (f"postgresql://u:{SECRET}@\x80/db", "invalid host name '\\x80'"),
        (f"postgresql://u:{SECRET}@{'a' * 64}.example/db", "invalid host name"),
    ],
)
def test_postgres_errors_never_show_the_password(url: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    assert needle in str(info.value)
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value)


@pytest.mark.parametrize("bad", ["a-b", "x;drop", 'q"uote', "sp ace"])
def test_schema_and_table_names_are_restricted(bad: str) -> None:
    from urllib.parse import quote

    with pytest.raises(ConfigError, match="schema and table names"):
        parse_url(f"postgresql://h/db?currentSchema={quote(bad)}")
    with pytest.raises(ConfigError, match="schema and table names"):
        parse_url(f"postgresql://h/db?table={quote(bad)}")


# -- SQLite -------------------------------------------------------------------------------------


def test_jdbc_sqlite_absolute_is_an_alias_of_four_slash_sqlite() -> None:
    a = parse_url("jdbc:sqlite:/var/lib/app/outbox.db")
    b = parse_url("sqlite:////var/lib/app/outbox.db")
    assert a == b
    assert a.kind == "sqlite" and a.path == "/var/lib/app/outbox.db"
    assert jdbc_of(a).url(a) == "jdbc:sqlite:/var/lib/app/outbox.db"
    assert jdbc_of(a).properties(a) == {"driver": "org.sqlite.JDBC"}
    assert a.where() == "/var/lib/app/outbox.db"


def test_sqlite_three_slashes_is_relative() -> None:
    u = parse_url("sqlite:///data/outbox.db")
    assert u.path == "data/outbox.db"
    assert jdbc_of(u).url(u) == "jdbc:sqlite:" + os.path.abspath("data/outbox.db")
    assert parse_url("jdbc:sqlite:rel.db").path == "rel.db"


def test_sqlite_redacted_round_trips() -> None:
    for url in ("sqlite:////abs/x.db", "sqlite:///rel/x.db"):
        u = parse_url(url)
        assert parse_url(u.redacted()) == u


def test_sqlite_two_slashes_is_an_error() -> None:
    with pytest.raises(ConfigError, match="three slashes"):
        parse_url("sqlite://host/x.db")


@pytest.mark.parametrize("path", ["outbox.db", "./outbox.db", "/tmp/outbox.db", "dir/sub/outbox.db"])
def test_bare_path_means_sqlite(path: str) -> None:
    u = parse_url(path)
    assert u.kind == "sqlite" and u.path == path


@pytest.mark.parametrize("url", ["", "   ", "sqlite:///", "jdbc:sqlite:", "sqlite::memory:"])
def test_empty_or_memory_sqlite_is_an_error(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_url(url)


@pytest.mark.parametrize("url", ["oracle://h/db", "redis://h:6379", "jdbc:oracle:thin:@h:1521/db", "http://x/y"])
def test_unknown_scheme_names_it_and_lists_the_accepted_forms(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    text = str(info.value)
    assert "unknown outbox URL scheme" in text
    assert repr(url.split(":", 1)[0]) in text
    for form in ("sqlite:///", "jdbc:sqlite:", "postgresql://", "jdbc:postgresql://", "mysql://"):
        assert form in text


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_url("nope://x")


# -- MySQL / MariaDB (a backend of the registry's entry point) ----------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"mysql://app:{SECRET}@db.example:3307/orders?table=ob",
        f"MariaDB://app:{SECRET}@db.example:3307/orders?table=ob",
        f"jdbc:mysql://db.example:3307/orders?user=app&password={SECRET}&table=ob&useSSL=false",
        f"jdbc:mariadb://db.example:3307/orders?user=app&password={SECRET}&table=ob",
    ],
)
def test_mysql_urls(url: str) -> None:
    u = parse_url(url)
    assert (u.kind, u.host, u.port, u.database, u.user, u.password) == (
        "mysql", "db.example", 3307, "orders", "app", SECRET
    )
    assert (u.table, u.options) == ("ob", ())  # the JDBC driver's own options are not read
    assert u.redacted() == "mysql://app:***@db.example:3307/orders"
    assert (str(u), u.where()) == ("mysql://app:***@db.example:3307/orders", "db.example:3307/orders")
    assert SECRET not in repr(u)
    assert jdbc_of(u).url(u) == "jdbc:mariadb://db.example:3307/orders?sessionVariables=sql_mode=ANSI_QUOTES"
    assert jdbc_of(u).properties(u) == {"driver": "org.mariadb.jdbc.Driver", "user": "app", "password": SECRET}


def test_mysql_defaults_and_errors_never_show_the_password() -> None:
    u = parse_url("mysql://db/app")
    assert (u.port, u.table, u.user, u.password) == (3306, DEFAULT_TABLE, None, None)
    for url, needle in [
        (f"mysql://u:{SECRET}@h/", "MySQL outbox URL needs a database"),
        (f"mysql://u:{SECRET}@h:notaport/db", "MySQL outbox URL has a bad port"),
        (f"mysql://u:{SECRET}@h/db?table=a-b", "schema and table names must be letters"),
    ]:
        with pytest.raises(ConfigError, match=needle) as info:
            parse_url(url)
        assert SECRET not in str(info.value)
