"""A private MariaDB server for tests, and throw-away databases on it.

Where the server comes from (:func:`ensure_server`):

1. ``$OUTBOX_TEST_MYSQL``: a ``mysql://`` URL of a user that may create databases. Nothing is started.
2. Otherwise the operating system's ``mariadbd`` (Debian's ``mariadb-server``), never its system
   service: a data directory of its own (``mariadb-install-db``) in a temporary directory, on a free
   port of 127.0.0.1 and a socket of its own, stopped and deleted at interpreter exit.

The server's user ``outbox`` (password ``outbox``) may do anything; :class:`MariaDB` can be stopped
and started again on the same data and port (a restart test), or killed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
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
    "MariaDB",
    "MariaDBSetupError",
    "create_database",
    "drop_database",
    "ensure_server",
    "mariadbd",
    "stop_server",
]

USER = "outbox"
"""User (and password) the tests connect as."""


class MariaDBSetupError(RuntimeError):
    """No MariaDB server could be found or started for the tests."""


def mariadbd() -> str | None:
    """The server binary (Debian puts it in /usr/sbin, often not on a user's PATH), or None."""
    return shutil.which("mariadbd") or next((p for p in ("/usr/sbin/mariadbd",) if os.access(p, os.X_OK)), None)


class MariaDB:
    """A mariadbd of our own: its data directory, port and socket; `url` connects as `outbox`."""

    def __init__(self) -> None:
        binary = mariadbd()
        install = shutil.which("mariadb-install-db")
        if binary is None or install is None:
            raise MariaDBSetupError(
                "MariaDB is not installed (mariadbd or mariadb-install-db not found): apt-get install mariadb-server"
            )
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-mariadb-"))
        self.data = self.dir / "data"
        self.socket = self.dir / "sock"
        self.port = free_port()
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.proc: subprocess.Popen[bytes] | None = None
        self._run(
            [
                install,
                "--no-defaults",
                f"--datadir={self.data}",
                f"--user={self.user}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--skip-name-resolve",
            ]
        )
        self.url = f"mysql://{USER}:{USER}@127.0.0.1:{self.port}/mysql"
        self._made_user = False

    def _run(self, argv: list[str]) -> None:
        try:
            subprocess.run(argv, check=True, capture_output=True, cwd=self.dir, timeout=120)
        except subprocess.CalledProcessError as exc:
            out = (exc.stderr or exc.stdout or b"").decode(errors="replace").strip().splitlines()[-3:]
            raise MariaDBSetupError(f"`{' '.join(argv[:1])}` exited {exc.returncode}: {' / '.join(out)}") from None

    def start(self, timeout: float = 60.0) -> None:
        """Start the server (again, on the same data and port) and wait until it takes connections."""
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - kept open by the child
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--no-defaults",
                f"--datadir={self.data}",
                f"--user={self.user}",
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                f"--socket={self.socket}",
                f"--pid-file={self.dir / 'pid'}",
                "--skip-name-resolve",
                "--skip-log-bin",
                "--innodb-buffer-pool-size=64M",
                "--innodb-log-file-size=32M",
                # A commit reaches the OS at once and the disk within a second: a killed server keeps it.
                "--innodb-flush-log-at-trx-commit=2",
                "--max-connections=200",
                f"--log-error={self.dir / 'error.log'}",
            ],
            stdout=log,
            stderr=log,
            cwd=self.dir,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MariaDBSetupError(f"mariadbd exited {self.proc.returncode}: {self._log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                break
            time.sleep(0.1)
        else:
            raise MariaDBSetupError(f"mariadbd did not take connections in {timeout:.0f} s: {self._log_tail()}")
        if not self._made_user:
            self._root_sql(
                f"CREATE USER IF NOT EXISTS '{USER}'@'%' IDENTIFIED BY '{USER}'; "
                f"GRANT ALL ON *.* TO '{USER}'@'%' WITH GRANT OPTION"
            )
            self._made_user = True

    def _root_sql(self, sql: str) -> None:
        import pymysql

        conn = pymysql.connect(unix_socket=str(self.socket), user="root", autocommit=True)
        try:
            with conn.cursor() as cur:
                for statement in sql.split("; "):
                    cur.execute(statement)
        finally:
            conn.close()

    def _log_tail(self) -> str:
        try:
            lines = (self.dir / "error.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return " / ".join(lines[-3:])

    def stop(self, timeout: float = 60.0) -> None:
        """A clean shutdown (SIGTERM), waited for."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """kill -9 of the server."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def remove(self) -> None:
        """Stop the server and delete its files."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


_lock = threading.Lock()
_server: MariaDB | None = None


def ensure_server() -> str:
    """The URL of the tests' MariaDB server (``$OUTBOX_TEST_MYSQL``, else one started here).

    Raises:
        MariaDBSetupError: MariaDB is not installed, or the server did not start.
    """
    global _server
    given = os.environ.get("OUTBOX_TEST_MYSQL")
    if given:
        return given
    with _lock:
        if _server is None:
            server = MariaDB()
            try:
                server.start()
            except BaseException:
                server.remove()
                raise
            _server = server
            atexit.register(stop_server)
        return _server.url


def stop_server() -> None:
    """Stop and delete the server :func:`ensure_server` started (if it did)."""
    global _server
    with _lock:
        if _server is not None:
            _server.remove()
            _server = None


def _with_database(url: str, database: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, f"/{database}", p.query, p.fragment))


def _admin(url: str, sql: str) -> None:
    import pymysql

    from outbox.stores.urls import parse_url

    u = parse_url(url)
    conn = pymysql.connect(host=u.host, port=u.port, user=u.user or "", password=u.password or "", autocommit=True)
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
    finally:
        conn.close()


def create_database(server: str) -> str:
    """A new, empty database on the server; its URL."""
    name = f"outbox_test_{uuid.uuid4().hex[:12]}"
    _admin(server, f"CREATE DATABASE `{name}`")
    return _with_database(server, name)


def drop_database(url: str, server: str) -> None:
    """Drop the database `url` names."""
    name = urlsplit(url).path.lstrip("/")
    _admin(server, f"DROP DATABASE IF EXISTS `{name}`")
