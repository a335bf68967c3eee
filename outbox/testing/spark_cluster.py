"""A Spark standalone cluster on this machine: one master and its workers, from pyspark's own jars.

The same cluster manager a production Spark cluster runs (`spark://` master, executors in other
JVMs with their own Python workers), started with `bin/spark-class` of the installed pyspark
package: `org.apache.spark.deploy.master.Master` and `org.apache.spark.deploy.worker.Worker`, on
127.0.0.1 and free ports, with small memory. Executors run `python` (default: this interpreter),
so they import the same kafka-outbox. `close()` kills every process it started.

    with SparkStandalone(workers=2) as cluster:
        spark = SparkSession.builder.master(cluster.master_url).getOrCreate()
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from outbox.testing.ports import free_port


class SparkSetupError(RuntimeError):
    """The standalone cluster could not be started (Java or pyspark missing, a process died)."""


def spark_home() -> Path:
    """The installed pyspark package: its `bin/spark-class` and `jars/` are a Spark distribution.

    Raises:
        SparkSetupError: pyspark is not installed.
    """
    try:
        import pyspark
    except ImportError:
        raise SparkSetupError("pyspark is not installed: pip install 'kafka-outbox[spark]'") from None
    return Path(pyspark.__file__).resolve().parent


class SparkStandalone:
    """A master and `workers` workers (`cores` and `memory` each), killed by `close()`.

    A worker must offer an executor's memory (`spark.executor.memory`, 1g unless the job says
    otherwise), or the master never places the application and its jobs wait for ever.

    Attributes:
        master_url: `spark://127.0.0.1:PORT`, for `--master` / `SparkSession.builder.master`.
        web_url: the master's web UI (its `/json` lists the workers).
        log_dir: the processes' output, for a failure's post-mortem.
    """

    def __init__(
        self, workers: int = 2, cores: int = 1, memory: str = "1g", python: str = sys.executable,
        start_timeout: float = 120.0,
    ) -> None:
        self.workers, self.cores, self.memory, self.python = workers, cores, memory, python
        self.start_timeout = start_timeout
        self.work = Path(tempfile.mkdtemp(prefix="outbox-spark-standalone-"))
        self.log_dir = self.work / "logs"
        self.log_dir.mkdir()
        self._procs: list[subprocess.Popen[bytes]] = []
        port, web = free_port(), free_port()
        self.master_url = f"spark://127.0.0.1:{port}"
        self.web_url = f"http://127.0.0.1:{web}"
        self._master_args = ["--host", "127.0.0.1", "--port", str(port), "--webui-port", str(web)]

    def _env(self) -> dict[str, str]:
        home = spark_home()
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(home),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_LOG_DIR=str(self.log_dir),
            SPARK_WORKER_DIR=str(self.work / "worker"),
            SPARK_LOCAL_DIRS=str(self.work / "local"),
            SPARK_DAEMON_MEMORY="256m",
            # Executors start Python workers with this interpreter (also spark.pyspark.python).
            PYSPARK_PYTHON=self.python,
        )
        return env

    def _spawn(self, name: str, cls: str, args: list[str]) -> None:
        if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
            raise SparkSetupError("Spark needs Java 17: apt-get install openjdk-17-jdk-headless")
        spark_class = spark_home() / "bin" / "spark-class"
        out = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - the process writes it until killed
        try:
            self._procs.append(
                subprocess.Popen(
                    [str(spark_class), cls, *args], stdout=out, stderr=subprocess.STDOUT, env=self._env(),
                    start_new_session=True,  # its own process group: close() kills the JVM and its children
                )
            )
        finally:
            out.close()

    def start(self) -> SparkStandalone:
        """Start the master, then the workers; return once every worker is registered ALIVE.

        Raises:
            SparkSetupError: a process exited, or the workers did not register in time.
        """
        try:
            self._spawn("master", "org.apache.spark.deploy.master.Master", self._master_args)
            for i in range(self.workers):
                self._spawn(
                    f"worker{i + 1}", "org.apache.spark.deploy.worker.Worker",
                    ["--host", "127.0.0.1", "--port", str(free_port()), "--webui-port", str(free_port()),
                     "--cores", str(self.cores), "--memory", self.memory,
                     "--work-dir", str(self.work / f"worker{i + 1}"), self.master_url],
                )
            self._wait_for_workers()
        except BaseException:
            self.close()
            raise
        return self

    def alive_workers(self) -> int:
        """Workers the master lists as ALIVE (0 while it does not answer)."""
        try:
            with urllib.request.urlopen(f"{self.web_url}/json/", timeout=2) as r:
                state = json.load(r)
        except OSError:
            return 0
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def _wait_for_workers(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            for p, name in zip(self._procs, ["master", *(f"worker{i + 1}" for i in range(self.workers))], strict=True):
                if p.poll() is not None:
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise SparkSetupError(f"the Spark {name} exited with {p.returncode}:\n{tail}")
            if self.alive_workers() >= self.workers:
                return
            time.sleep(0.5)
        raise SparkSetupError(
            f"{self.workers} Spark workers did not register with {self.master_url} within "
            f"{self.start_timeout:g}s (logs: {self.log_dir})"
        )

    def close(self) -> None:
        """Kill the workers and the master (each process group), and remove the work directory."""
        for p in reversed(self._procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        self._procs.clear()
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> SparkStandalone:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
