"""Java artifacts from Maven Central, fetched once with ``mvn`` and cached per user.

Two sets are pinned here, each a ``pom.xml`` shipped beside this module:

* ``kafka``: the Apache Kafka broker jars the test cluster runs (``pom.xml``);
* ``jdbc``: the PostgreSQL, SQLite and MariaDB JDBC drivers Spark needs to read an outbox
  (``jdbc-pom.xml``), for the Spark tests, the benchmarks and ``spark-submit --jars``.

Each set is copied into ``${XDG_CACHE_HOME:-~/.cache}/kafka-outbox/<set>-<version>/libs``; a
marker file is written only once a copy is complete, so an interrupted fetch is redone next
time. ``python -m outbox.testing fetch`` fetches both.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from spark_drain.jars import JDBC, JDBC_DRIVER_JARS, MARKER, ArtifactSet, cached_jdbc_jar

__all__ = [
    "JDBC",
    "JDBC_DRIVER_JARS",
    "KAFKA",
    "KAFKA_VERSION",
    "ArtifactSet",
    "MavenFetchError",
    "cached_jdbc_jar",
    "fetch",
    "jdbc_jar",
]

KAFKA_VERSION = "4.1.1"
"""The Apache Kafka version the test cluster runs (pinned in ``pom.xml``)."""

_log = logging.getLogger(__name__)


class MavenFetchError(RuntimeError):
    """An artifact set could not be fetched (no ``mvn``, no ``java``, or Maven failed)."""


KAFKA = ArtifactSet("kafka", KAFKA_VERSION, "pom.xml", "kafka_*.jar")


def fetch(artifacts: ArtifactSet, *, force: bool = False) -> Path:
    """Download ``artifacts`` with Maven into the user's cache (once) and return the jar directory.

    Concurrent callers (several pytest runs, a benchmark beside a test) are serialised with a
    file lock.

    Raises:
        MavenFetchError: ``mvn`` or ``java`` is missing, or the fetch failed (the message ends
            with the tail of Maven's output).
    """
    import fcntl  # POSIX only: imported here so that importing the test bed works everywhere

    root = artifacts.root
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if artifacts.is_cached() and not force:
            return artifacts.libs
        mvn = shutil.which("mvn")
        if not mvn:
            raise MavenFetchError(
                f"Maven (`mvn`) was not found on PATH; it is needed once to download the {artifacts.name} "
                "jars from Maven Central (on Debian/Ubuntu: `apt-get install maven`)."
            )
        if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
            raise MavenFetchError(
                "Java was not found on PATH; Maven needs a JDK 17 (`apt-get install openjdk-17-jdk-headless`)."
            )
        (root / MARKER).unlink(missing_ok=True)
        work = root / "fetch"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        shutil.copyfile(Path(__file__).with_name(artifacts.pom), work / "pom.xml")
        tmp_libs = work / "libs"
        cmd = [
            mvn,
            "-q",
            "-B",
            "-Dstyle.color=never",
            "-f",
            str(work / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={tmp_libs}",
            "-DincludeScope=runtime",
        ]
        _log.info("fetching %s jars: %s", artifacts.name, " ".join(cmd))
        proc = subprocess.run(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0 or not any(tmp_libs.glob(artifacts.probe)):
            tail = "\n".join(proc.stdout.strip().splitlines()[-40:])
            raise MavenFetchError(
                f"Fetching the {artifacts.name} jars with Maven failed (exit {proc.returncode}). "
                f"Command: {' '.join(cmd)}\n--- mvn output (tail) ---\n{tail}"
            )
        shutil.rmtree(artifacts.libs, ignore_errors=True)
        tmp_libs.rename(artifacts.libs)
        shutil.rmtree(work, ignore_errors=True)
        (root / MARKER).write_text(f"{artifacts.name} {artifacts.version}\n")
        return artifacts.libs


def jdbc_jar(kind: str) -> str:
    """The JDBC driver jar for ``kind``, fetching the pinned drivers from Maven Central if needed."""
    found = cached_jdbc_jar(kind)
    if found is not None:
        return found
    return str(fetch(JDBC) / JDBC_DRIVER_JARS[kind])
