"""`python -m spark_drain.bundle DIR`: the job packed for `spark-submit` on a cluster.

A cluster's executors run their own Python. Rather than installing kafka-outbox on every node, the
driver ships this version's code with the job: `--py-files` puts a zip of the pure-Python
packages on the driver's and every executor's `sys.path` (Spark takes `.zip`, `.egg` and `.py`
there, not wheels). What cannot travel in a zip, the compiled dependencies (confluent-kafka's
librdkafka, pyarrow, psycopg), must be installed in the executors' Python: `requirements.txt`
lists them. The JDBC driver comes from Maven through `--packages`.

Writes into DIR (created if missing):

* ``kafka_outbox-<version>.zip``: the ``outbox`` and ``spark_drain`` packages, ``.py`` files only,
  byte-identical for the same code (sorted entries, fixed timestamps);
* ``spark_drain_job.py``: the script `spark-submit` runs (a plain file: Spark cannot start a
  module inside a zip);
* ``requirements.txt``: what the executors' Python must have (kafka-outbox's dependencies with
  the ``spark``, ``postgres`` and ``encryption`` extras, without kafka-outbox itself).

and prints the `spark-submit` command line that uses them.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import outbox
import spark_drain
from spark_drain.jars import JDBC_DRIVER_PACKAGES

DISTRIBUTION = "kafka-outbox"
LAUNCHER = "spark_drain_job.py"
REQUIREMENTS = "requirements.txt"
#: The extras whose dependencies an executor imports: the Spark side itself, the PostgreSQL store,
#: and the codec of an encrypted outbox.
EXECUTOR_EXTRAS = ("spark", "postgres", "encryption")
#: A zip entry's timestamp: the earliest a zip can hold, so a bundle's bytes depend on the code only.
EPOCH = (1980, 1, 1, 0, 0, 0)

LAUNCHER_SOURCE = '''\
"""The kafka-outbox Spark job's entry point for spark-submit; ship the bundle's zip with --py-files."""

import sys

from spark_drain.job import main

sys.exit(main())
'''


def version() -> str:
    """The installed kafka-outbox's version (`0+unknown` for a checkout that was never installed)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def executor_requirements() -> list[str]:
    """kafka-outbox's own dependencies and those of `EXECUTOR_EXTRAS`, as requirement lines."""
    try:
        declared = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    lines: list[str] = []
    for requirement in declared:
        spec, _, marker = requirement.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if extra is None or extra.group(1) in EXECUTOR_EXTRAS:
            lines.append(spec.strip())
    return sorted(set(lines))


def write_zip(path: Path) -> int:
    """Zip the ``outbox`` and ``spark_drain`` packages' ``.py`` files into `path`; the file count."""
    sources: list[tuple[str, Path]] = []
    for package in (outbox, spark_drain):
        root = Path(package.__file__ or "").parent
        for file in root.rglob("*.py"):
            if "__pycache__" not in file.parts:
                sources.append(((Path(root.name) / file.relative_to(root)).as_posix(), file))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as bundle:
        for name, file in sorted(sources):
            entry = zipfile.ZipInfo(name, date_time=EPOCH)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = 0o644 << 16
            bundle.writestr(entry, file.read_bytes())
    return len(sources)


def write_bundle(directory: Path) -> tuple[Path, Path, Path]:
    """Write the zip, the launcher and the requirements into `directory`; their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    archive = directory / f"kafka_outbox-{version()}.zip"
    write_zip(archive)
    launcher = directory / LAUNCHER
    launcher.write_text(LAUNCHER_SOURCE)
    requirements = directory / REQUIREMENTS
    requirements.write_text("".join(f"{line}\n" for line in executor_requirements()))
    return archive, launcher, requirements


def submit_command(archive: Path, launcher: Path) -> str:
    """The `spark-submit` line for a PostgreSQL outbox on a standalone cluster, as a template."""
    return (
        "spark-submit --master spark://MASTER:7077 \\\n"
        f"    --py-files {archive} \\\n"
        f"    --packages {JDBC_DRIVER_PACKAGES['postgresql']} \\\n"
        "    --conf spark.pyspark.python=/path/to/python-with-requirements \\\n"
        f"    {launcher} --outbox 'jdbc:postgresql://DB/APP?user=USER' --bootstrap-servers BROKERS"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spark_drain.bundle",
        description="Pack the Spark job for spark-submit: a zip for --py-files, the script to "
        "submit, and the executors' requirements.",
    )
    parser.add_argument("directory", type=Path, help="where to write the bundle (created if missing)")
    args = parser.parse_args(argv)
    try:
        archive, launcher, requirements = write_bundle(args.directory)
    except OSError as exc:
        print(f"spark_drain.bundle: error: cannot write the bundle into {args.directory}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {archive}\nwrote {launcher}\nwrote {requirements}")
    print(f"\nInstall {requirements.name} in the executors' Python, then:\n\n{submit_command(archive, launcher)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
