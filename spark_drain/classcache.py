"""A class-data-sharing archive of the driver JVM's classes, so that later launches start faster.

Most of a SparkSession's start-up, and of its first action, is the JVM loading and verifying
Spark's classes. Since Java 13 a JVM can write the classes it loaded into an archive when it exits
(`-XX:ArchiveClassesAtExit`), and a later JVM maps that archive instead of loading them again
(`-XX:SharedArchiveFile`): on a 2-core machine the session starts about 3.5 s sooner, and the
first action about 2 s.

The command-line entry points (`python -m spark_drain`) do this for the driver JVM they launch:

* the first run writes the archive when its JVM exits, under a name of its own, and renames it
  into place once the JVM has exited cleanly, so that no run maps a half-written file;
* later runs map it. The archive's name is a digest of the JDK and PySpark it was made with; a
  JVM that finds the archive does not match its class path ignores it (`-Xshare:auto`, Java's
  default), so the worst case is the ordinary start-up.

The archive is about 150 MB, in ``${XDG_CACHE_HOME:-~/.cache}/kafka-outbox/spark-cds/``. It is
not used under spark-submit (its JVM is already running) nor when the Spark configuration already
sets the driver's Java options (the job does not override them); `--no-class-cache` turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from spark_drain.jars import cache_root

log = logging.getLogger(__name__)

#: The driver JVM's options that Spark prepends to `spark.driver.extraJavaOptions`: the user's
#: own extra options stay as they are.
DRIVER_JAVA_OPTIONS = "spark.driver.defaultJavaOptions"
#: Silence the JVM's CDS warnings: writing an archive lists every class it skips, on stdout.
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
_SUFFIX = ".jsa"


@dataclass(frozen=True)
class ClassCache:
    """The driver JVM's options for one launch, and where its archive goes when it is written."""

    java_options: str
    #: Set when this launch writes the archive: the JVM's own file, renamed to `archive` by `keep`.
    writing: Path | None
    archive: Path

    def keep(self, jvm: subprocess.Popen[bytes] | None, timeout: float = 120.0) -> None:
        """After the session stopped: let the driver JVM exit (it writes the archive as it does),
        then put the archive in place. Without a JVM to wait for, or a file written, nothing."""
        if self.writing is None or jvm is None:
            return
        # The one slow launch: say why the command has not returned yet.
        print(f"spark_drain: keeping Spark's classes in {self.archive.parent} for faster launches "
              "(once, takes a while)", file=sys.stderr, flush=True)
        if jvm.stdin is not None:
            jvm.stdin.close()  # the gateway JVM exits at end of input, writing the archive
        try:
            jvm.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the driver JVM did not exit in %.0f s: its class archive is not kept", timeout)
            return
        # A JVM stopped by a signal may have left its archive half-written: the JVM would ignore
        # such a file, and no later launch would write a whole one.
        if jvm.returncode == 0 and self.writing.is_file() and self.writing.stat().st_size > 0:
            os.replace(self.writing, self.archive)
        else:
            log.info("the driver JVM wrote no class archive (exit status %s)", jvm.returncode)
            self.writing.unlink(missing_ok=True)


def cache_dir() -> Path:
    """Where the archives are kept (beside the fetched jars)."""
    return cache_root() / "spark-cds"


def _digest() -> str:
    """What an archive depends on: the JDK (its binary) and Spark's jars (PySpark's version)."""
    import pyspark

    java_home = os.environ.get("JAVA_HOME")
    java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java") or "java"
    java = os.path.realpath(java)
    stamp = os.stat(java).st_mtime_ns if os.path.exists(java) else 0
    return hashlib.sha256(f"{java}\0{stamp}\0{pyspark.__version__}".encode()).hexdigest()[:16]


def class_cache(directory: Path | None = None) -> ClassCache | None:
    """The options for this launch: map the archive if there is one, else write it at exit.
    None when the cache directory cannot be made (the launch goes on without it)."""
    directory = directory or cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.info("no class archive: cannot make %s (%s)", directory, exc)
        return None
    archive = directory / f"{_digest()}{_SUFFIX}"
    if archive.is_file():
        return ClassCache(f"-XX:SharedArchiveFile={archive} {_QUIET}", None, archive)
    writing = directory / f"{archive.stem}.{os.getpid()}.writing"
    return ClassCache(f"-XX:ArchiveClassesAtExit={writing} {_QUIET}", writing, archive)


def driver_options_given(submit_args: str | None, conf_dir: Path | None) -> bool:
    """Whether the driver's Java options are already configured (`PYSPARK_SUBMIT_ARGS`, or
    spark-defaults.conf): then the job leaves them alone."""
    names = (DRIVER_JAVA_OPTIONS, "spark.driver.extraJavaOptions")
    if submit_args and any(name in submit_args for name in names):
        return True
    defaults = conf_dir / "spark-defaults.conf" if conf_dir is not None else None
    if defaults is not None and defaults.is_file():
        lines = defaults.read_text(errors="replace").splitlines()
        return any(line.split(maxsplit=1)[0] in names for line in lines if line.strip() and not line.startswith("#"))
    return False
