"""produce(..., transaction=...) with the application's own transaction: a sqlite3 connection to the
outbox's file, a SQLAlchemy Connection or Session (SQLite and PostgreSQL), Django's connection inside
transaction.atomic() (PostgreSQL, in a subprocess: django.setup() is process-wide). A rolled-back
transaction leaves no row and nothing in Kafka after the drain; a committed one is delivered."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import ConfigError, ResilientProducer
from outbox.headers import ID_HEADER
from outbox.stores.urls import parse_url
from outbox.testing.consume import consume_to_end

from .. import waiting


def producer(bootstrap: str, outbox: str) -> ResilientProducer:
    return ResilientProducer(
        {"bootstrap.servers": bootstrap, "acks": "all"}, outbox=outbox, drain_workers=1, drain_poll_interval=0.2
    )


def delivered_ids(bootstrap: str, topic: str, p: ResilientProducer, committed: int) -> list[str]:
    """Wait for the drain to deliver `committed` messages, then every outbox-id the topic holds."""
    waiting.wait_until(lambda: p.stats()["delivered_from_outbox"] >= committed, 60, "the drain delivered")
    out = []
    for m in consume_to_end(bootstrap, topic):
        out += [v.decode() for k, v in m.headers() or [] if k == ID_HEADER]
    return out


def test_sqlite3_connection_of_the_outbox_file(tmp_path: Path, kafka_bootstrap: str, topic: str) -> None:
    db = tmp_path / "app.db"
    with producer(kafka_bootstrap, f"sqlite:///{db}") as p:
        app = sqlite3.connect(db)  # default isolation_level: the first write begins a transaction
        app.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        app.execute("INSERT INTO orders VALUES ('o-1')")
        rolled_back = p.produce(topic, b"o-1", transaction=app)
        app.rollback()
        app.execute("INSERT INTO orders VALUES ('o-2')")
        committed = p.produce(topic, b"o-2", transaction=app)
        app.commit()
        got = delivered_ids(kafka_bootstrap, topic, p, 1)
        assert p.store.stats(now=time.time()).pending == 0
    assert got == [committed] and rolled_back not in got
    assert app.execute("SELECT id FROM orders").fetchall() == [("o-2",)]


def test_refusals_name_the_problem(tmp_path: Path, kafka_bootstrap: str, topic: str) -> None:
    with producer(kafka_bootstrap, f"sqlite:///{tmp_path / 'outbox.db'}") as p:
        other = sqlite3.connect(tmp_path / "other.db")
        with pytest.raises(ConfigError, match="other.db.*but the outbox is"):
            p.produce(topic, b"x", transaction=other)
        same = sqlite3.connect(tmp_path / "outbox.db", isolation_level=None)
        with pytest.raises(ConfigError, match="autocommit mode outside a transaction"):
            p.produce(topic, b"x", transaction=same)
        with pytest.raises(ConfigError, match="SQLAlchemy Connection or Session"):
            p.produce(topic, b"x", transaction=object())
        assert p.store.stats(now=time.time()).pending == 0


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_sqlalchemy_session_and_connection(
    kind: str, tmp_path: Path, kafka_bootstrap: str, topic: str, request: pytest.FixtureRequest
) -> None:
    if kind == "sqlite":
        outbox = f"sqlite:///{tmp_path / 'app.db'}"
        engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    else:
        outbox = request.getfixturevalue("fresh_postgres_url")
        kw = parse_url(outbox).psycopg_kwargs()
        engine = sa.create_engine(
            sa.URL.create(
                "postgresql+psycopg", username=str(kw.get("user", "")) or None, password=str(kw.get("password", ""))
                or None, host=str(kw["host"]), port=int(kw["port"]), database=str(kw["dbname"]),
            )
        )
    with producer(kafka_bootstrap, outbox) as p:
        with engine.begin() as c:
            c.execute(sa.text("CREATE TABLE orders (id TEXT PRIMARY KEY)"))
        with Session(engine) as s:  # a Session rolled back
            s.execute(sa.text("INSERT INTO orders VALUES ('s-1')"))
            rolled_back = p.produce(topic, b"s-1", transaction=s)
            s.rollback()
        aborted = ""
        with pytest.raises(LookupError), engine.begin() as c:  # a Connection left by an exception
            c.execute(sa.text("INSERT INTO orders VALUES ('c-1')"))
            aborted = p.produce(topic, b"c-1", transaction=c)
            raise LookupError("business rule failed after the enqueue")
        with Session(engine) as s, s.begin():
            s.execute(sa.text("INSERT INTO orders VALUES ('s-2')"))
            by_session = p.produce(topic, b"s-2", transaction=s)
        with engine.begin() as c:
            c.execute(sa.text("INSERT INTO orders VALUES ('c-2')"))
            by_connection = p.produce(topic, b"c-2", transaction=c)
        got = delivered_ids(kafka_bootstrap, topic, p, 2)
        assert p.store.stats(now=time.time()).pending == 0
    assert sorted(got) == sorted([by_session, by_connection])
    assert rolled_back not in got and aborted not in got
    with engine.connect() as c:
        assert sorted(r[0] for r in c.execute(sa.text("SELECT id FROM orders"))) == ["c-2", "s-2"]
    engine.dispose()


def test_async_session_with_async_resilient_producer(fresh_postgres_url: str, kafka_bootstrap: str, topic: str) -> None:
    """An AsyncSession on psycopg's asyncio driver: the row is written in the session's transaction
    on the event loop; a rolled-back session leaves nothing, a committed one is delivered."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from outbox.producer.aio import AsyncResilientProducer

    kw = parse_url(fresh_postgres_url).psycopg_kwargs()
    url = sa.URL.create(
        "postgresql+psycopg", username=str(kw.get("user", "")) or None, password=str(kw.get("password", "")) or None,
        host=str(kw["host"]), port=int(kw["port"]), database=str(kw["dbname"]),
    )

    async def app() -> tuple[str, str, str, list[str], int]:
        engine = create_async_engine(url)
        async with AsyncResilientProducer(
            {"bootstrap.servers": kafka_bootstrap, "acks": "all"}, outbox=fresh_postgres_url,
            drain_workers=1, drain_poll_interval=0.2, drain_in="threads",
        ) as p:
            async with engine.begin() as c:
                await c.execute(sa.text("CREATE TABLE orders (id TEXT PRIMARY KEY)"))
            async with AsyncSession(engine) as s:  # rolled back
                await s.execute(sa.text("INSERT INTO orders VALUES ('a-1')"))
                rolled_back = await p.produce(topic, b"a-1", transaction=s)
                await s.rollback()
            async with AsyncSession(engine) as s, s.begin():
                await s.execute(sa.text("INSERT INTO orders VALUES ('a-2')"))
                by_session = await p.produce(topic, b"a-2", key=b"a", transaction=s)
            async with engine.begin() as c:
                await c.execute(sa.text("INSERT INTO orders VALUES ('a-3')"))
                by_connection = await p.produce(topic, b"a-3", key=b"a", transaction=c)
            got = await asyncio.get_running_loop().run_in_executor(
                None, delivered_ids, kafka_bootstrap, topic, p.producer, 2
            )
            pending = (await p.stats())["pending"]
        async with engine.connect() as c:
            orders = sorted(r[0] for r in await c.execute(sa.text("SELECT id FROM orders")))
        await engine.dispose()
        assert orders == ["a-2", "a-3"]
        return rolled_back, by_session, by_connection, got, pending

    rolled_back, by_session, by_connection, got, pending = asyncio.run(app())
    assert got == [by_session, by_connection]  # one key: in commit order
    assert rolled_back not in got and pending == 0


def test_an_async_session_given_to_the_synchronous_producer_is_refused_by_name(
    fresh_postgres_url: str, kafka_bootstrap: str, topic: str
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    kw = parse_url(fresh_postgres_url).psycopg_kwargs()
    engine = create_async_engine(sa.URL.create(
        "postgresql+psycopg", username=str(kw.get("user", "")) or None, password=str(kw.get("password", "")) or None,
        host=str(kw["host"]), port=int(kw["port"]), database=str(kw["dbname"]),
    ))
    with producer(kafka_bootstrap, fresh_postgres_url) as p:
        with pytest.raises(ConfigError, match="AsyncSession from AsyncResilientProducer.produce"):
            p.produce(topic, b"x", transaction=AsyncSession(engine))
        assert p.store.stats(now=time.time()).pending == 0
    asyncio.run(engine.dispose())


DJANGO_APP = textwrap.dedent(
    """
    import sys, json
    import django
    from django.conf import settings
    from outbox import ResilientProducer
    from outbox.stores.urls import parse_url

    url, bootstrap, topic = sys.argv[1:4]
    kw = parse_url(url).psycopg_kwargs()
    settings.configure(DATABASES={"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": kw["dbname"], "USER": kw.get("user", ""),
        "PASSWORD": kw.get("password", ""), "HOST": kw["host"], "PORT": kw["port"],
    }})
    django.setup()
    from django.db import connection, transaction

    out = {}
    with ResilientProducer({"bootstrap.servers": bootstrap}, outbox=url, drain_workers=0) as p:
        with connection.cursor() as cur:
            cur.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        try:
            p.produce(topic, b"outside", transaction=connection)
        except Exception as exc:
            out["outside"] = f"{type(exc).__name__}: {exc}"
        try:
            with transaction.atomic():
                with connection.cursor() as cur:
                    cur.execute("INSERT INTO orders VALUES ('d-1')")
                out["rolled_back"] = p.produce(topic, b"d-1", transaction=connection)
                raise LookupError("business rule failed")
        except LookupError:
            pass
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("INSERT INTO orders VALUES ('d-2')")
            out["committed"] = p.produce(topic, b"d-2", transaction=connection)
    print(json.dumps(out))
    """
)


def test_django_atomic_on_postgresql(fresh_postgres_url: str, kafka_bootstrap: str, topic: str) -> None:
    import json

    run = subprocess.run(
        [sys.executable, "-c", DJANGO_APP, fresh_postgres_url, kafka_bootstrap, topic],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["outside"].startswith("ConfigError: transaction: Django's connection is in autocommit mode")
    # The Django process had no drain worker: this one delivers what its transactions committed.
    with producer(kafka_bootstrap, fresh_postgres_url) as p:
        got = delivered_ids(kafka_bootstrap, topic, p, 1)
    assert got == [out["committed"]] and out["rolled_back"] not in got
