"""A real, throw-away Apache Kafka cluster for tests.

:class:`KafkaCluster` runs a pinned Apache Kafka (KRaft mode, no ZooKeeper) as
local JVM processes: one dedicated controller plus ``N`` brokers, all listening
on free ports of ``127.0.0.1``, with their data and logs in a temporary
directory. Brokers can be stopped (SIGTERM), killed (SIGKILL), frozen (SIGSTOP)
and restarted, so tests can exercise real failure modes. With ``proxied=True``
every client connection passes through a :class:`~outbox.testing.netfaults.FaultProxy`
that can delay, throttle, black-hole or reset the traffic to each broker.

The Kafka jars are fetched from Maven Central on first use with ``mvn`` (the
``pom.xml`` shipped next to this module) and cached under
``${XDG_CACHE_HOME:-~/.cache}/kafka-outbox/kafka-<version>/libs``. Setting
``KAFKA_HOME`` to an existing Kafka installation uses ``$KAFKA_HOME/libs``
instead. ``python -m outbox.testing fetch`` pre-fetches the jars.

Every process the cluster starts is cleaned up on :meth:`KafkaCluster.close`,
on exceptions inside a ``with`` block, at interpreter exit (``atexit``), and,
on Linux, by the kernel if the Python process itself dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from confluent_kafka.admin import AdminClient, ClusterMetadata, NewTopic  # type: ignore[attr-defined]

from outbox.testing.maven import KAFKA, KAFKA_VERSION, MavenFetchError
from outbox.testing.maven import fetch as maven_fetch
from outbox.testing.netfaults import FaultProxy
from outbox.testing.ports import free_port

if TYPE_CHECKING:
    from outbox.testing.certs import Certificates

__all__ = [
    "KAFKA_VERSION",
    "KafkaCluster",
    "KafkaSetupError",
    "create_topic",
    "fetch_kafka",
    "kafka_libs_dir",
    "wait_for_isr",
]

CONTROLLER_NODE_ID = 1000

#: The protocols a test cluster's clients' listener speaks (`KafkaCluster(security=...)`).
SECURITY_PROTOCOLS = ("PLAINTEXT", "SASL_PLAINTEXT", "SSL", "SASL_SSL")
#: The SASL users of a secured test cluster and their passwords (PLAIN and SCRAM-SHA-512 alike).
USERS = {"admin": "admin-secret", "alice": "alice-secret"}
"""Node id of the dedicated KRaft controller (brokers use ``0..N-1``)."""

_log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("outbox.testing.rdkafka")


class KafkaSetupError(RuntimeError):
    """Kafka could not be fetched or started (missing java/mvn, failed download, broker crash)."""


# ---------------------------------------------------------------------------
# Fetching the Kafka jars
# ---------------------------------------------------------------------------


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("java")
    if not found:
        raise KafkaSetupError(
            "Java was not found (no `java` on PATH and no usable $JAVA_HOME). The Kafka test cluster "
            "needs a JRE >= 17: on Debian/Ubuntu run `apt-get install openjdk-17-jdk-headless`."
        )
    return found


def kafka_libs_dir(*, fetch: bool = True) -> Path:
    """Return the directory holding the Kafka jars, fetching them if needed.

    Args:
        fetch: When the jars are not cached yet, download them (``True``) or
            raise (``False``).

    Returns:
        ``$KAFKA_HOME/libs`` if ``KAFKA_HOME`` is set, else the cache directory.

    Raises:
        KafkaSetupError: ``KAFKA_HOME`` has no ``libs``, or the jars are not
            cached and could not be (or were not allowed to be) fetched.
    """
    kafka_home = os.environ.get("KAFKA_HOME")
    if kafka_home:
        libs = Path(kafka_home) / "libs"
        if not any(libs.glob("kafka_*.jar")):
            raise KafkaSetupError(f"KAFKA_HOME={kafka_home} has no Kafka jars in {libs}")
        return libs
    if KAFKA.is_cached():
        return KAFKA.libs
    if not fetch:
        raise KafkaSetupError(f"Kafka {KAFKA_VERSION} is not fetched yet; run `python -m outbox.testing fetch`")
    return fetch_kafka()


def fetch_kafka(*, force: bool = False) -> Path:
    """Download the Kafka broker jars with Maven into the user's cache (see :mod:`outbox.testing.maven`).

    Raises:
        KafkaSetupError: ``mvn`` or ``java`` is missing or the fetch failed (the message
            ends with the tail of Maven's output).
    """
    _java()  # fail early with a clear message if there is no JVM at all
    try:
        return maven_fetch(KAFKA, force=force)
    except MavenFetchError as exc:
        raise KafkaSetupError(f"{exc} Alternatively point KAFKA_HOME at an existing Kafka installation.") from exc


# ---------------------------------------------------------------------------
# Process helpers
# ---------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform == "linux" else None
except OSError:  # pragma: no cover - non-glibc Linux
    _libc = None


def _child_preexec(parent_pid: int | None, niceness: int = 0) -> None:
    """Runs in the forked child: lower its priority by `niceness`, and die with SIGKILL when the
    parent goes away (`parent_pid`; None: not asked)."""
    if niceness:
        os.nice(niceness)
    if _libc is not None and parent_pid is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # parent died before prctl took effect
            os._exit(1)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _new_cluster_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def _props(values: Mapping[str, object]) -> str:
    return "".join(f"{k}={v}\n" for k, v in values.items())


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _admin(bootstrap: str, **extra: Any) -> AdminClient:
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": _rdkafka_log}
    conf.update(extra)
    return AdminClient(conf)


def _metadata(admin: AdminClient, topic: str | None = None, timeout: float = 5.0) -> ClusterMetadata:
    return admin.list_topics(topic=topic, timeout=timeout)


def create_topic(
    bootstrap: str,
    name: str,
    partitions: int = 3,
    replication_factor: int | None = None,
    config: Mapping[str, str] | None = None,
    *,
    timeout: float = 60.0,
) -> str:
    """Create a topic and wait until every partition has a leader.

    Args:
        bootstrap: ``bootstrap.servers`` of the cluster.
        name: Topic name.
        partitions: Number of partitions.
        replication_factor: Replicas per partition; ``None`` means
            ``min(3, number of live brokers)``.
        config: Topic configuration, e.g. ``{"min.insync.replicas": "2"}``.
        timeout: Seconds to wait for creation and leaders.

    Returns:
        The topic name.

    Raises:
        TimeoutError: The topic did not get leaders for all partitions in time.
        confluent_kafka.KafkaException: The broker rejected the creation.
    """
    deadline = time.monotonic() + timeout
    admin = _admin(bootstrap)  # keep a reference until the futures resolve (else: _DESTROY)
    if replication_factor is None:
        replication_factor = min(3, max(1, len(_metadata(admin, timeout=timeout).brokers)))
    new = NewTopic(
        name,
        num_partitions=partitions,
        replication_factor=replication_factor,
        config={k: str(v) for k, v in (config or {}).items()},
    )
    futures = admin.create_topics([new], operation_timeout=timeout, request_timeout=timeout)
    futures[name].result(timeout=timeout)
    while True:
        md = _metadata(admin, name).topics.get(name)
        if (
            md is not None
            and md.error is None
            and len(md.partitions) == partitions
            and all(p.leader >= 0 and p.error is None for p in md.partitions.values())
        ):
            return name
        if time.monotonic() > deadline:
            raise TimeoutError(f"topic {name!r} has no leader for every partition after {timeout}s: {md}")
        time.sleep(0.1)


def _full_isr(md: Any, min_isr: int | None = None) -> bool:
    """Whether a topic's metadata shows a leader and `min_isr` in-sync replicas (default: all)
    for every partition."""
    return md.error is None and bool(md.partitions) and all(
        p.leader >= 0 and len(p.isrs) >= (len(p.replicas) if min_isr is None else min_isr)
        for p in md.partitions.values()
    )


def wait_for_isr(bootstrap: str, topic: str, min_isr: int | None = None, *, timeout: float = 60.0) -> None:
    """Wait until every partition of ``topic`` has a leader and enough in-sync replicas.

    Args:
        bootstrap: ``bootstrap.servers`` of the cluster.
        topic: Topic name.
        min_isr: Required ISR size per partition; ``None`` means all replicas.
        timeout: Seconds to wait.

    Raises:
        TimeoutError: The ISR did not grow back in time.
    """
    admin = _admin(bootstrap)
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            md = _metadata(admin, topic).topics.get(topic)
            last = md
            if md is not None and _full_isr(md, min_isr):
                return
        except Exception as exc:  # noqa: BLE001 - metadata errors while brokers restart are transient
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"ISR of topic {topic!r} not >= {min_isr or 'all replicas'} after {timeout}s: {last}")
        time.sleep(0.2)


# ---------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------

_live_clusters: set[KafkaCluster] = set()
_live_lock = threading.Lock()


@atexit.register
def _close_all_at_exit() -> None:
    with _live_lock:
        clusters = list(_live_clusters)
    for cluster in clusters:
        with contextlib.suppress(Exception):
            cluster.close()


DEFAULT_JVM_OPTS: tuple[str, ...] = (
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:CICompilerCount=1",
    "-Xss512k",
    "-Djava.awt.headless=true",
    "-Djava.net.preferIPv4Stack=true",
)
"""JVM flags for every Kafka process: small footprint and fast start on a 2-core machine."""

_LOG4J2 = """\
status = warn
name = outbox-testing
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = STDOUT
logger.state.name = state.change.logger
logger.state.level = warn
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.log.name = org.apache.kafka.storage.internals.log
logger.log.level = warn
logger.logcls.name = kafka.log
logger.logcls.level = warn
"""


class KafkaCluster:
    """A local Apache Kafka cluster in KRaft mode: one controller and N brokers.

    Example::

        with KafkaCluster(brokers=3) as cluster:
            cluster.create_topic("orders", partitions=3, config={"min.insync.replicas": "2"})
            producer = Producer({"bootstrap.servers": cluster.bootstrap_servers})
            cluster.kill_broker(1)
            ...
            cluster.start_broker(1)
            cluster.wait_for_isr("orders")

    Faults short of a crash: :meth:`freeze_broker` / :meth:`freeze_all` stop a
    broker's JVM with SIGSTOP (it holds its connections and answers nothing, as a
    long GC pause or a hung host would) until :meth:`thaw_broker` / :meth:`thaw_all`.
    With ``proxied=True`` each broker has two listeners: ``CLIENT``, advertised
    at a port of :attr:`network` (a :class:`~outbox.testing.netfaults.FaultProxy`,
    so every client connection, metadata included, goes through it), and
    ``INTERNAL``, for replication between brokers, which the proxy does not
    touch: a network fault cuts clients off from a broker, not the broker from
    its peers::

        with KafkaCluster(brokers=3, proxied=True) as cluster:
            cluster.network.blackhole(0)   # clients of broker 0 time out
            cluster.network.heal(0)

    Broker ``i`` (``0 <= i < brokers``) has node id ``i``; the controller has
    node id :data:`CONTROLLER_NODE_ID`. Ports are picked once at
    :meth:`start` and kept across broker restarts.

    Leaving the ``with`` block because of an exception (not ``KeyboardInterrupt``)
    keeps the cluster directory (process logs and data) and prints where it is.

    Args:
        brokers: Number of broker processes.
        base_dir: Parent directory of the cluster's temporary directory
            (default: the system temp dir).
        keep_logs: Keep the cluster directory on :meth:`close` even on success.
        broker_config: Extra/overriding ``server.properties`` entries for brokers.
        controller_config: Extra/overriding entries for the controller.
        broker_heap: ``-Xmx`` of each broker JVM.
        controller_heap: ``-Xmx`` of the controller JVM.
        jvm_opts: JVM flags (default :data:`DEFAULT_JVM_OPTS`).
        startup_timeout: Seconds to wait for a process to serve.
        proxied: Route every client connection through a fault proxy
            (:attr:`network`); replication between brokers stays direct.
        niceness: Run the JVMs at this ``nice`` increment (0..19). On a machine
            whose cores the cluster shares with what is measured, a JVM starting
            up otherwise delays every other process's wake-ups by tens of ms.
        security: The clients' listener's protocol (:data:`SECURITY_PROTOCOLS`):
            ``"PLAINTEXT"`` (the default), ``"SASL_PLAINTEXT"``, ``"SSL"`` (client
            certificates required) or ``"SASL_SSL"``. SASL offers PLAIN and
            SCRAM-SHA-512 for the users of :data:`USERS`, and OAUTHBEARER with Kafka's
            unsecured JWTs; TLS uses a throw-away authority (:mod:`outbox.testing.certs`).
            :meth:`client_config` gives a client's settings. The brokers replicate, and
            the cluster's own operations run, over a PLAINTEXT listener of their own.
    """

    def __init__(
        self,
        brokers: int = 3,
        *,
        base_dir: str | os.PathLike[str] | None = None,
        keep_logs: bool = False,
        broker_config: Mapping[str, object] | None = None,
        controller_config: Mapping[str, object] | None = None,
        broker_heap: str = "512m",
        controller_heap: str = "256m",
        jvm_opts: tuple[str, ...] | list[str] = DEFAULT_JVM_OPTS,
        startup_timeout: float = 90.0,
        proxied: bool = False,
        niceness: int = 0,
        security: str = "PLAINTEXT",
    ) -> None:
        if brokers < 1:
            raise ValueError("brokers must be >= 1")
        if security not in SECURITY_PROTOCOLS:
            raise ValueError(f"security must be one of {SECURITY_PROTOCOLS}, got {security!r}")
        self.security = security
        #: The TLS files of an ``SSL`` / ``SASL_SSL`` cluster, once started.
        self.certificates: Certificates | None = None
        self.num_brokers = brokers
        self.keep_logs = keep_logs
        self.startup_timeout = startup_timeout
        self._base_dir = base_dir
        self._broker_overrides = dict(broker_config or {})
        self._controller_overrides = dict(controller_config or {})
        self._broker_heap = broker_heap
        self._controller_heap = controller_heap
        self._jvm_opts = list(jvm_opts)
        self._dir: Path | None = None
        self._cluster_id = _new_cluster_id()
        self._controller_port = 0
        self._broker_ports: list[int] = []
        self._internal_ports: list[int] = []
        self._proxied = proxied
        if not 0 <= niceness <= 19:
            raise ValueError(f"niceness must be 0..19, got {niceness}")
        self._niceness = niceness
        self._network: FaultProxy | None = None
        self._frozen: set[int] = set()
        self._controller: subprocess.Popen[bytes] | None = None
        self._brokers: list[subprocess.Popen[bytes] | None] = [None] * brokers
        self._log_files: list[IO[bytes]] = []
        self._closed = False
        self._owner_pid = os.getpid()

    # -- properties ---------------------------------------------------------

    @property
    def cluster_id(self) -> str:
        """The KRaft cluster id (22-character base64url UUID)."""
        return self._cluster_id

    @property
    def dir(self) -> Path:
        """The cluster's directory (configs, data, logs)."""
        if self._dir is None:
            raise RuntimeError("cluster not started")
        return self._dir

    @property
    def log_dir(self) -> Path:
        """Directory holding one ``<process>.log`` (stdout+stderr) per Kafka process."""
        return self.dir / "logs"

    def broker_log(self, i: int) -> Path:
        """Path of broker ``i``'s process log."""
        return self.log_dir / f"broker-{i}.log"

    @property
    def controller_log(self) -> Path:
        """Path of the controller's process log."""
        return self.log_dir / "controller.log"

    @property
    def broker_ports(self) -> list[int]:
        """Port clients reach each broker at on 127.0.0.1, by broker index.

        The broker's own listener, or with ``proxied=True`` the proxy's port in front of it.
        """
        if self._network is not None:
            return self._network.ports
        return list(self._broker_ports)

    @property
    def proxied(self) -> bool:
        """Whether client connections go through the fault proxy (:attr:`network`)."""
        return self._proxied

    @property
    def network(self) -> FaultProxy:
        """The fault proxy between clients and brokers; target ``i`` is broker ``i``.

        Raises:
            RuntimeError: The cluster was not made with ``proxied=True``, or is not started.
        """
        if self._network is None:
            raise RuntimeError("network faults need KafkaCluster(proxied=True), started")
        return self._network

    @property
    def frozen_brokers(self) -> list[int]:
        """Indices of brokers frozen with SIGSTOP (:meth:`freeze_broker`), sorted."""
        return sorted(self._frozen)

    @property
    def controller_port(self) -> int:
        """Port of the controller's listener on 127.0.0.1."""
        return self._controller_port

    @property
    def bootstrap_servers(self) -> str:
        """Comma-separated ``127.0.0.1:port`` of all brokers (running or not); the proxy's ports if proxied."""
        return ",".join(f"127.0.0.1:{p}" for p in self.broker_ports)

    @property
    def _direct_bootstrap(self) -> str:
        # The cluster's own start-up checks bypass the proxy, so a fault left on cannot stall them;
        # on a secured cluster they use the brokers' own PLAINTEXT listener, needing no credentials.
        ports = self._internal_ports if self._secured else self._broker_ports
        return ",".join(f"127.0.0.1:{p}" for p in ports)

    @property
    def _admin_bootstrap(self) -> str:
        """Where the cluster's own operations (topics, ISR waits) connect: the clients' listener,
        or on a secured cluster the brokers' PLAINTEXT one."""
        return self._direct_bootstrap if self._secured else self.bootstrap_servers

    @property
    def _secured(self) -> bool:
        return self.security != "PLAINTEXT"

    def set_password(self, user: str, password: str, timeout: float = 30.0) -> None:
        """Change a SCRAM-SHA-512 user's password, as an operator's rotation does (PLAIN users are
        fixed). A client keeps its connections until they re-authenticate: give the brokers
        ``connections.max.reauth.ms`` (``broker_config``) to make that soon."""
        from confluent_kafka.admin import (  # type: ignore[attr-defined]
            ScramCredentialInfo,
            ScramMechanism,
            UserScramCredentialUpsertion,
        )

        credential = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192)
        admin = _admin(self._direct_bootstrap)
        done = admin.alter_user_scram_credentials([UserScramCredentialUpsertion(user, credential, password.encode())])
        for future in done.values():
            future.result(timeout)

    def client_config(self, user: str = "alice", mechanism: str = "SCRAM-SHA-512") -> dict[str, str]:
        """A client's settings for this cluster: ``bootstrap.servers`` and its security.

        Args:
            user: A user of :data:`USERS` (SASL), whose password is given.
            mechanism: ``"SCRAM-SHA-512"``, ``"PLAIN"`` or ``"OAUTHBEARER"`` (librdkafka's
                unsecured JWT with ``sub`` = `user`, unless the client sets ``oauth_cb``).
        """
        config = {"bootstrap.servers": self.bootstrap_servers, "security.protocol": self.security}
        if "SASL" in self.security:
            config["sasl.mechanism"] = mechanism
            if mechanism == "OAUTHBEARER":
                config["enable.sasl.oauthbearer.unsecure.jwt"] = "true"
                config["sasl.oauthbearer.config"] = f"principal={user}"
            else:
                config["sasl.username"] = user
                config["sasl.password"] = USERS[user]
        if "SSL" in self.security:
            certs = self.certificates
            assert certs is not None, "the cluster is not started"
            config["ssl.ca.location"] = str(certs.ca)
            if self.security == "SSL":
                config["ssl.certificate.location"] = str(certs.client_cert)
                config["ssl.key.location"] = str(certs.client_key)
        return config

    def pids(self) -> list[int]:
        """Process ids of all live Kafka processes of this cluster (controller first)."""
        procs = [self._controller, *self._brokers]
        return [p.pid for p in procs if p is not None and p.poll() is None]

    def running_brokers(self) -> list[int]:
        """Indices of brokers whose process is alive."""
        return [i for i, p in enumerate(self._brokers) if p is not None and p.poll() is None]

    # -- lifecycle ----------------------------------------------------------

    def __enter__(self) -> KafkaCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        failed = exc_type is not None and issubclass(exc_type, Exception)
        self.close(keep=True if failed else None)

    def start(self) -> KafkaCluster:
        """Fetch Kafka if needed, format storage, start controller and brokers, wait until all serve.

        Returns:
            ``self``.

        Raises:
            KafkaSetupError: Java/Maven missing, fetch failed, or a process did
                not come up (the message has the tail of its log).
        """
        if self._dir is not None:
            raise RuntimeError("cluster already started")
        java = _java()
        libs = kafka_libs_dir()
        self._classpath = str(libs / "*")
        self._javabin = java
        self._dir = Path(tempfile.mkdtemp(prefix="kafka-outbox-", dir=self._base_dir))
        with _live_lock:
            _live_clusters.add(self)
        try:
            self.log_dir.mkdir()
            (self.dir / "log4j2.properties").write_text(_LOG4J2)
            self._controller_port = free_port()
            self._broker_ports = [free_port() for _ in range(self.num_brokers)]
            if self._proxied or self._secured:
                self._internal_ports = [free_port() for _ in range(self.num_brokers)]
            if "SSL" in self.security:
                from outbox.testing.certs import make_certificates

                self.certificates = make_certificates(self.dir / "certs")
            if self._proxied:
                self._network = FaultProxy()
                for port in self._broker_ports:
                    self._network.add(port)
            self._write_configs()
            self._format_all()
            self._controller = self._spawn("controller", self._controller_heap)
            for i in range(self.num_brokers):
                self._brokers[i] = self._spawn(f"broker-{i}", self._broker_heap)
            self._wait_port("controller", self._controller, self._controller_port, self.controller_log)
            self._wait_brokers_serving(range(self.num_brokers))
        except BaseException:
            self.close(keep=True)
            raise
        return self

    def close(self, keep: bool | None = None) -> None:
        """Stop every process of the cluster and remove its directory.

        Args:
            keep: Keep the directory (logs, data). ``None`` means
                :attr:`keep_logs`. When kept, its location is printed to stderr.
        """
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._owner_pid:  # forked child: the processes are not ours
            return
        try:
            # A stopped JVM would hold SIGTERM pending until it is killed after the timeout.
            self.thaw_all()
            for i in range(self.num_brokers):
                p = self._brokers[i]
                if p is not None and p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(signal.SIGTERM)
            for i in range(self.num_brokers):
                self._reap(self._brokers[i], timeout=10.0)
            if self._controller is not None:
                if self._controller.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        self._controller.send_signal(signal.SIGTERM)
                self._reap(self._controller, timeout=10.0)
        finally:
            if self._network is not None:
                self._network.close()
            for f in self._log_files:
                with contextlib.suppress(Exception):
                    f.close()
            with _live_lock:
                _live_clusters.discard(self)
            if self._dir is not None:
                if keep if keep is not None else self.keep_logs:
                    print(f"[outbox.testing] Kafka cluster logs kept in {self.log_dir}", file=sys.stderr)
                else:
                    shutil.rmtree(self._dir, ignore_errors=True)

    # -- broker control -----------------------------------------------------

    def stop_broker(self, i: int, timeout: float = 20.0) -> None:
        """Stop broker ``i`` gracefully (SIGTERM); SIGKILL it if it has not exited after ``timeout``."""
        p = self._broker(i)
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
        self.thaw_broker(i)  # a frozen JVM acts on the pending SIGTERM only once continued
        self._reap(p, timeout)

    def kill_broker(self, i: int) -> None:
        """Kill broker ``i`` with SIGKILL (a crash) and wait until it is gone."""
        p = self._broker(i)
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.kill()  # SIGKILL ends a stopped process too
        p.wait()
        self._frozen.discard(i)

    def freeze_broker(self, i: int) -> None:
        """Freeze broker ``i`` with SIGSTOP: its JVM stops, its sockets stay open and answer nothing.

        Clients see requests time out rather than connections refused; after
        ``broker.session.timeout.ms`` (5 s here) the controller fences it and
        moves its partition leaderships. No-op if it is not running or already frozen.
        """
        p = self._broker(i)
        if p is None or p.poll() is not None or i in self._frozen:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGSTOP)
            self._frozen.add(i)

    def thaw_broker(self, i: int) -> None:
        """Continue broker ``i`` after :meth:`freeze_broker` (SIGCONT). No-op if it is not frozen."""
        p = self._broker(i)
        if i not in self._frozen:
            return
        self._frozen.discard(i)
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)

    def freeze_all(self) -> None:
        """Freeze every running broker (SIGSTOP). The controller keeps running.

        The controller is left up so the cluster keeps its metadata quorum: the
        brokers come back on :meth:`thaw_all` by re-registering, as after a long
        pause, instead of waiting for a controller election.
        """
        for i in self.running_brokers():
            self.freeze_broker(i)

    def thaw_all(self) -> None:
        """Continue every frozen broker (SIGCONT)."""
        for i in sorted(self._frozen):
            p = self._brokers[i]
            self._frozen.discard(i)
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)

    def start_broker(self, i: int, timeout: float | None = None) -> None:
        """Start broker ``i`` (no-op if running) and wait until it serves.

        "Serves" means its port accepts connections and it is listed as a live
        broker in the cluster metadata a client sees.

        Raises:
            KafkaSetupError: The broker exited or did not serve within ``timeout``
                (default :attr:`startup_timeout`).
        """
        p = self._broker(i)
        if p is not None and p.poll() is None:
            return
        self._brokers[i] = self._spawn(f"broker-{i}", self._broker_heap)
        self._wait_brokers_serving([i], timeout)

    def stop_all(self, timeout: float = 20.0) -> None:
        """Stop all brokers (SIGTERM, in parallel). The controller keeps running."""
        procs = [p for p in self._brokers if p is not None and p.poll() is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        self.thaw_all()
        for p in procs:
            self._reap(p, timeout)

    def start_all(self, timeout: float | None = None) -> None:
        """Start every broker that is not running and wait until all serve."""
        down = [i for i in range(self.num_brokers) if i not in self.running_brokers()]
        for i in down:
            self._brokers[i] = self._spawn(f"broker-{i}", self._broker_heap)
        if down:
            self._wait_brokers_serving(down, timeout)

    # -- topics -------------------------------------------------------------

    def create_topic(
        self,
        name: str,
        partitions: int = 3,
        replication_factor: int | None = None,
        config: Mapping[str, str] | None = None,
        *,
        timeout: float = 60.0,
    ) -> str:
        """Create a topic and wait until all partitions have leaders.

        Args:
            name: Topic name.
            partitions: Number of partitions.
            replication_factor: ``None`` means ``min(3, brokers)``.
            config: Topic configuration overrides.
            timeout: Seconds to wait.

        Returns:
            The topic name.
        """
        rf = min(3, self.num_brokers) if replication_factor is None else replication_factor
        return create_topic(self._admin_bootstrap, name, partitions, rf, config, timeout=timeout)

    def delete_topic(self, name: str, *, timeout: float = 60.0) -> None:
        """Delete a topic and wait until the cluster no longer lists it. A long-lived cluster that a
        test run fills with topics restarts slower after each kill: a broker recovers every
        partition it holds."""
        deadline = time.monotonic() + timeout
        admin = _admin(self._direct_bootstrap)
        admin.delete_topics([name], operation_timeout=timeout)[name].result(timeout)
        # The controller has accepted it; until the brokers have applied it, the topic is still
        # listed, and a wait for every topic's ISR (`wait_until_healthy`) would wait on it.
        while name in _metadata(admin, timeout=max(1.0, deadline - time.monotonic())).topics:
            if time.monotonic() > deadline:
                raise TimeoutError(f"topic {name!r} still listed {timeout}s after its deletion")
            time.sleep(0.2)

    def wait_for_isr(self, topic: str, min_isr: int | None = None, timeout: float = 60.0) -> None:
        """Wait until every partition of ``topic`` has ``>= min_isr`` in-sync replicas (default: all)."""
        wait_for_isr(self._admin_bootstrap, topic, min_isr, timeout=timeout)

    def wait_until_healthy(self, timeout: float = 90.0) -> None:
        """Start stopped brokers, then wait until every partition of every topic has its full ISR."""
        deadline = time.monotonic() + timeout
        self.start_all(timeout=timeout)
        # One client and one metadata request for all topics a round: a session cluster holds
        # hundreds of topics, and a client per topic cost a connection and a metadata round each.
        admin = _admin(self._admin_bootstrap)
        names = set(_metadata(admin, timeout=max(1.0, deadline - time.monotonic())).topics)
        while True:
            try:
                topics = _metadata(admin, timeout=5.0).topics
                short = sorted(name for name in names if name in topics and not _full_isr(topics[name]))
            except Exception as exc:  # noqa: BLE001 - metadata errors while brokers restart are transient
                short = [f"metadata: {exc}"]
            if not short:  # a topic deleted meanwhile needs no replicas
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every partition has its full ISR after {timeout}s: {short[:5]}")
            time.sleep(0.2)

    # -- internals ----------------------------------------------------------

    def _broker(self, i: int) -> subprocess.Popen[bytes] | None:
        if not 0 <= i < self.num_brokers:
            raise IndexError(f"broker index {i} out of range 0..{self.num_brokers - 1}")
        if self._dir is None or self._closed:
            raise RuntimeError("cluster is not running")
        return self._brokers[i]

    def _common_config(self) -> dict[str, object]:
        return {
            "controller.quorum.voters": f"{CONTROLLER_NODE_ID}@127.0.0.1:{self._controller_port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": (
                f"CONTROLLER:PLAINTEXT,CLIENT:{self.security},INTERNAL:PLAINTEXT"
                if self._proxied or self._secured
                else "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
            ),
            "broker.session.timeout.ms": 5000,
            "broker.heartbeat.interval.ms": 500,
            "num.network.threads": 2,
            "num.io.threads": 2,
            "background.threads": 2,
        }

    def _write_configs(self) -> None:
        rf = min(3, self.num_brokers)
        controller_dir = self.dir / "controller"
        controller = {
            **self._common_config(),
            "process.roles": "controller",
            "node.id": CONTROLLER_NODE_ID,
            "listeners": f"CONTROLLER://127.0.0.1:{self._controller_port}",
            "log.dirs": controller_dir / "data",
            **self._controller_overrides,
        }
        controller_dir.mkdir()
        (controller_dir / "server.properties").write_text(_props(controller))
        for i, port in enumerate(self._broker_ports):
            bdir = self.dir / f"broker-{i}"
            broker = {
                **self._common_config(),
                "process.roles": "broker",
                "node.id": i,
                **self._listeners(i, port),
                **self._security_config(),
                "log.dirs": bdir / "data",
                "num.partitions": 3,
                "default.replication.factor": rf,
                "min.insync.replicas": 1,
                "offsets.topic.replication.factor": rf,
                "offsets.topic.num.partitions": 6,
                "transaction.state.log.replication.factor": rf,
                "transaction.state.log.min.isr": 1,
                "transaction.state.log.num.partitions": 6,
                "share.coordinator.state.topic.replication.factor": rf,
                "share.coordinator.state.topic.min.isr": 1,
                "group.initial.rebalance.delay.ms": 0,
                # Groups of group.protocol=consumer (KIP-848, on by default since Kafka 4.0) take
                # their session and heartbeat from the broker, 45 s and 5 s by default: the same
                # 6 s and 0.5 s as the tests give classic groups, so a dead member is noticed as soon.
                "group.consumer.min.session.timeout.ms": 6000,
                "group.consumer.session.timeout.ms": 6000,
                "group.consumer.min.heartbeat.interval.ms": 500,
                "group.consumer.heartbeat.interval.ms": 500,
                "replica.lag.time.max.ms": 5000,
                "replica.socket.timeout.ms": 5000,
                "num.replica.fetchers": 1,
                "num.recovery.threads.per.data.dir": 1,
                "log.cleaner.threads": 1,
                "log.cleaner.dedupe.buffer.size": 8 * 1024 * 1024,
                "unclean.leader.election.enable": "false",
                "auto.create.topics.enable": "true",
                **self._broker_overrides,
            }
            bdir.mkdir()
            (bdir / "server.properties").write_text(_props(broker))

    def _security_config(self) -> dict[str, object]:
        """The clients' listener's SASL and TLS settings (none for PLAINTEXT)."""
        config: dict[str, object] = {}
        if "SASL" in self.security:
            plain_users = " ".join(f'user_{name}="{password}"' for name, password in USERS.items())
            config.update({
                "sasl.enabled.mechanisms": "PLAIN,SCRAM-SHA-512,OAUTHBEARER",
                "listener.name.client.plain.sasl.jaas.config": (
                    "org.apache.kafka.common.security.plain.PlainLoginModule required "
                    f'username="admin" password="{USERS["admin"]}" {plain_users};'
                ),
                "listener.name.client.scram-sha-512.sasl.jaas.config": (
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;"
                ),
                "listener.name.client.oauthbearer.sasl.jaas.config": (
                    "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required "
                    'unsecuredLoginStringClaim_sub="admin";'
                ),
            })
        if "SSL" in self.security:
            certs = self.certificates
            assert certs is not None
            config.update({
                "listener.name.client.ssl.keystore.type": "PEM",
                "listener.name.client.ssl.keystore.location": certs.broker,
                "listener.name.client.ssl.truststore.type": "PEM",
                "listener.name.client.ssl.truststore.location": certs.ca,
                "listener.name.client.ssl.client.auth": "required" if self.security == "SSL" else "none",
            })
        return config

    def _listeners(self, i: int, port: int) -> dict[str, object]:
        if self._network is None and self._secured:
            internal = self._internal_ports[i]
            return {
                "listeners": f"CLIENT://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal}",
                "advertised.listeners": f"CLIENT://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal}",
                "inter.broker.listener.name": "INTERNAL",
            }
        if self._network is None:
            return {
                "listeners": f"PLAINTEXT://127.0.0.1:{port}",
                "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
                "inter.broker.listener.name": "PLAINTEXT",
            }
        internal = self._internal_ports[i]
        # Clients learn the proxy's port from metadata; the brokers replicate over INTERNAL, direct.
        return {
            "listeners": f"CLIENT://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal}",
            "advertised.listeners": f"CLIENT://127.0.0.1:{self._network.port(i)},INTERNAL://127.0.0.1:{internal}",
            "inter.broker.listener.name": "INTERNAL",
        }

    def _config_path(self, name: str) -> Path:
        return self.dir / name / "server.properties"

    def _java_cmd(self, heap: str, main: str, *args: str) -> list[str]:
        return [
            self._javabin,
            "-Xms64m",
            f"-Xmx{heap}",
            *self._jvm_opts,
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.log_dir}",
            "-cp",
            self._classpath,
            main,
            *args,
        ]

    def _format_all(self) -> None:
        names = ["controller", *[f"broker-{i}" for i in range(self.num_brokers)]]
        procs = []
        for name in names:
            cmd = self._java_cmd(
                "256m",
                "kafka.tools.StorageTool",
                "format",
                # "=" form: a base64url id may start with "-", which argparse would take for an option
                f"--cluster-id={self._cluster_id}",
                f"--config={self._config_path(name)}",
                *self._scram_users(),
            )
            log = self.log_dir / f"format-{name}.log"
            with open(log, "wb") as out:
                procs.append((name, log, self._popen(cmd, out)))
        for name, log, p in procs:
            try:
                rc = p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            if rc != 0:
                raise KafkaSetupError(f"formatting storage of {name} failed (exit {rc}):\n{_tail(log)}")

    def _scram_users(self) -> list[str]:
        """The storage tool's arguments that create the SCRAM users in the cluster's first metadata."""
        if "SASL" not in self.security:
            return []
        return [f"--add-scram=SCRAM-SHA-512=[name={name},password={password}]" for name, password in USERS.items()]

    def _popen(self, cmd: list[str], out: IO[bytes]) -> subprocess.Popen[bytes]:
        parent, niceness = os.getpid(), self._niceness
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so only use it from the main thread.
        on_main = threading.current_thread() is threading.main_thread()
        preexec = (lambda: _child_preexec(parent if on_main else None, niceness)) if on_main or niceness else None
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            start_new_session=True,
            preexec_fn=preexec,
        )

    def _spawn(self, name: str, heap: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in close()
        self._log_files.append(log)
        log.write(f"\n===== [outbox.testing] starting {name} at {time.strftime('%H:%M:%S')} =====\n".encode())
        log.flush()
        return self._popen(self._java_cmd(heap, "kafka.Kafka", str(self._config_path(name))), log)

    @staticmethod
    def _reap(p: subprocess.Popen[bytes] | None, timeout: float) -> None:
        if p is None:
            return
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()

    def _wait_port(self, name: str, proc: subprocess.Popen[bytes] | None, port: int, log: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not _port_open(port):
            if proc is None or proc.poll() is not None:
                raise KafkaSetupError(f"{name} exited during start-up; log {log}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise KafkaSetupError(
                    f"{name} not listening on port {port} after {self.startup_timeout}s:\n{_tail(log)}"
                )
            time.sleep(0.1)

    def _wait_brokers_serving(self, indices: Iterator[int] | range | list[int], timeout: float | None = None) -> None:
        wanted = list(indices)
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        for i in wanted:
            self._wait_port(f"broker-{i}", self._brokers[i], self._broker_ports[i], self.broker_log(i))
        while True:
            seen: set[int] = set()
            # A client of its own each time: its first metadata request goes to a bootstrap
            # address, the broker's own port. A client kept across requests would send the next
            # ones to the addresses the brokers advertise, the fault proxy's, which a black hole
            # left on during a restart would stall.
            with contextlib.suppress(Exception):
                seen = set(_metadata(_admin(self._direct_bootstrap), timeout=2.0).brokers)
            if all(i in seen for i in wanted):
                return
            for i in wanted:
                p = self._brokers[i]
                if p is None or p.poll() is not None:
                    raise KafkaSetupError(f"broker-{i} exited during start-up:\n{_tail(self.broker_log(i))}")
            if time.monotonic() > deadline:
                missing = [i for i in wanted if i not in seen]
                raise KafkaSetupError(
                    f"brokers {missing} not in cluster metadata after {timeout}s; "
                    f"last log lines of broker-{missing[0]}:\n{_tail(self.broker_log(missing[0]))}"
                )
            time.sleep(0.2)

    def __repr__(self) -> str:
        proxied = ", proxied=True" if self._proxied else ""
        return (
            f"KafkaCluster(brokers={self.num_brokers}{proxied}, bootstrap={self.bootstrap_servers!r}, dir={self._dir})"
        )
