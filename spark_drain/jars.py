"""Where the JDBC driver jars Spark needs to read an outbox are on this machine (no download here).

The pinned drivers (``org.postgresql:postgresql``, ``org.xerial:sqlite-jdbc``,
``org.mariadb.jdbc:mariadb-java-client``) are fetched from
Maven Central once by ``python -m outbox.testing fetch`` into
``${XDG_CACHE_HOME:-~/.cache}/kafka-outbox/<set>-<version>/libs``; Debian's packages are the
fallback. Which driver an outbox needs is its backend's (`outbox.stores.registry.Jdbc`).
`spark_drain` looks its default ``--jars`` up here; the fetching itself (Maven) is
`outbox.testing.maven`'s business.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from outbox.stores.registry import Jdbc, backend, backends

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


JDBC = ArtifactSet("jdbc", "2", "jdbc-pom.xml", "mariadb-java-client-*.jar")


def _drivers() -> dict[str, Jdbc]:
    return {b.name: b.jdbc for b in backends() if b.jdbc is not None}


#: The Maven coordinates of each outbox kind's JDBC driver (the store registry's; the built-in
#: backends' are pinned in ``jdbc-pom.xml`` too): what `spark-submit --packages` takes on a cluster.
JDBC_DRIVER_PACKAGES: dict[str, str] = {kind: jdbc.package for kind, jdbc in _drivers().items()}

#: The driver jar of each outbox kind inside the ``jdbc`` set (Maven's ``artifact-version.jar``).
JDBC_DRIVER_JARS: dict[str, str] = {kind: jdbc.jar for kind, jdbc in _drivers().items()}


def cached_jdbc_jar(kind: str) -> str | None:
    """The JDBC driver jar for an outbox ``kind`` (a backend's name: ``postgresql``, ``sqlite``)
    on this machine.

    The Maven-fetched copy wins; the operating system's package is used when that is all there
    is. None when neither exists (nothing is downloaded here), or the backend has no JDBC driver.
    """
    jdbc = backend(kind).jdbc
    if jdbc is None:
        return None
    if JDBC.is_cached():
        jar = JDBC.libs / jdbc.jar
        if jar.is_file():
            return str(jar)
    return next((p for p in jdbc.os_jars if Path(p).is_file()), None)
