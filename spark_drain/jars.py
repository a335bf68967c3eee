"""Where the JDBC driver jars Spark needs to read an outbox are on this machine (no download here).

The pinned drivers (``org.postgresql:postgresql``, ``org.xerial:sqlite-jdbc``) are fetched from
Maven Central once by ``python -m outbox.testing fetch`` into
``${XDG_CACHE_HOME:-~/.cache}/kafka-outbox/<set>-<version>/libs``; Debian's packages are the
fallback. `spark_drain` looks its default ``--jars`` up here; the fetching itself (Maven) is
`outbox.testing.maven`'s business.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Written into a set's directory once a copy is complete, so an interrupted fetch is redone.
MARKER = ".complete"


def cache_root() -> Path:
    """kafka-outbox's cache on this machine: ``${XDG_CACHE_HOME:-~/.cache}/kafka-outbox``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kafka-outbox"


@dataclass(frozen=True)
class ArtifactSet:
    """A pinned set of jars: the pom that names them and where they are cached."""

    name: str
    version: str
    pom: str
    #: A glob that only a complete copy matches (checks the fetch really brought the jars).
    probe: str

    @property
    def root(self) -> Path:
        return cache_root() / f"{self.name}-{self.version}"

    @property
    def libs(self) -> Path:
        return self.root / "libs"

    def is_cached(self) -> bool:
        return (self.root / MARKER).is_file() and self.libs.is_dir()


JDBC = ArtifactSet("jdbc", "1", "jdbc-pom.xml", "postgresql-*.jar")

#: The Maven coordinates of each outbox kind's JDBC driver (the same as pinned in ``jdbc-pom.xml``):
#: what `spark-submit --packages` takes on a cluster.
JDBC_DRIVER_PACKAGES: dict[str, str] = {
    "postgresql": "org.postgresql:postgresql:42.7.14",
    "sqlite": "org.xerial:sqlite-jdbc:3.54.1.0",
}

#: The driver jar of each outbox kind inside the ``jdbc`` set (Maven's ``artifact-version.jar``).
JDBC_DRIVER_JARS: dict[str, str] = {
    kind: "{1}-{2}.jar".format(*coordinates.split(":")) for kind, coordinates in JDBC_DRIVER_PACKAGES.items()
}

#: Debian's copies (libpostgresql-jdbc-java, libxerial-sqlite-jdbc-java), used when present.
DEBIAN_JARS: dict[str, tuple[str, ...]] = {
    "postgresql": ("/usr/share/java/postgresql.jar",),
    "sqlite": ("/usr/share/java/sqlite-jdbc.jar", "/usr/share/java/xerial-sqlite-jdbc.jar"),
}


def cached_jdbc_jar(kind: str) -> str | None:
    """The JDBC driver jar for an outbox ``kind`` (``postgresql`` or ``sqlite``) on this machine.

    The Maven-fetched copy wins; Debian's package is used when that is all there is. None when
    neither exists (nothing is downloaded here).
    """
    if JDBC.is_cached():
        jar = JDBC.libs / JDBC_DRIVER_JARS[kind]
        if jar.is_file():
            return str(jar)
    return next((p for p in DEBIAN_JARS[kind] if Path(p).is_file()), None)
