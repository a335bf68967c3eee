"""Lease owners: who holds a row, and whether that process still lives.

A lease owner is one text column, so no schema change was needed to make it say who it is::

    drain@web-1:4242:8812345:c4f09df1:4026531836:9f3a2b

role ``@`` host ``:`` pid ``:`` process start time (clock ticks since boot, from
``/proc/<pid>/stat``: a reused pid has another one) ``:`` boot id (8 hex digits of
``/proc/sys/kernel/random/boot_id``) ``:`` pid namespace (inode of ``/proc/self/ns/pid``) ``:``
random part (two owners of one process never share a name).

The rule (one place: `local_liveness` here, and each store's `owner_liveness`):

* **same host** (same host name, boot and pid namespace): the owner is alive while a process
  with its pid *and* its start time exists and is not a zombie. A claimer releases a gone
  owner's leases at once.
* **same host name, another boot id**: the machine rebooted since the owner leased; it is gone.
* **PostgreSQL**: a live owner holds a session-level advisory lock on a dedicated connection
  (`PostgresOutbox` takes it before the owner's first lease); the lock dies with the owner's
  process or connection, and a claimer takes the leases of an owner whose lock is free.
* anything else (another host on SQLite, an owner name not in this format): unknown, and the
  lease runs until it expires (`lease_seconds`): the last resort, for hung processes too.
"""

from __future__ import annotations

import enum
import os
import socket
import time
from dataclasses import dataclass
from functools import lru_cache


class Liveness(enum.Enum):
    """What a claimer knows about a lease owner."""

    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class OwnerId:
    """A parsed lease owner name (see the module docstring)."""

    role: str
    host: str
    pid: int
    start: int
    boot: str
    pidns: int
    nonce: str

    def __str__(self) -> str:
        return f"{self.role}@{self.host}:{self.pid}:{self.start}:{self.boot}:{self.pidns}:{self.nonce}"

    def short(self) -> str:
        """The readable part, for people: ``drain@web-1 pid 4242``."""
        return f"{self.role}@{self.host} pid {self.pid}"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process, or None if gone."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and ")": split after
    # the last ")". Then field 3 is the state and field 22 the start time.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


_HAVE_PROC = os.path.exists("/proc/self/stat")


@lru_cache(maxsize=1)
def _this_boot() -> str:
    return (_read("/proc/sys/kernel/random/boot_id") or "").strip().replace("-", "")[:8] or "0"


@lru_cache(maxsize=1)
def _this_pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _this_host() -> str:
    # ":" and "@" separate the fields; host names never hold them, but be safe.
    return socket.gethostname().replace(":", "_").replace("@", "_") or "localhost"


def _start_time(pid: int) -> int:
    stat = _proc_stat(pid)
    return stat[1] if stat is not None else 0


def _kill_probe(pid: int) -> Liveness:
    """Without /proc (not Linux): signal 0 says whether the pid exists, not whether it was reused."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return Liveness.GONE
    except OSError:
        return Liveness.ALIVE  # exists, owned by another user
    return Liveness.ALIVE


def new_owner(role: str) -> str:
    """A fresh lease owner name for this process (`role`: "producer", "drain", "spark", …)."""
    role = role.replace("@", "_").replace(":", "_") or "owner"
    pid = os.getpid()
    return str(OwnerId(role, _this_host(), pid, _start_time(pid), _this_boot(), _this_pidns(), os.urandom(3).hex()))


def parse_owner(text: str) -> OwnerId | None:
    """The parts of an owner name made by `new_owner`; None for any other text."""
    role, at, rest = text.partition("@")
    if not at:
        return None
    parts = rest.rsplit(":", 5)
    if len(parts) != 6:
        return None
    host, pid, start, boot, pidns, nonce = parts
    try:
        return OwnerId(role, host, int(pid), int(start), boot, int(pidns), nonce)
    except ValueError:
        return None


def describe_owner(text: str) -> str:
    """An owner for people: ``drain@web-1 pid 4242``, or the text itself if not ours."""
    owner = parse_owner(text)
    return owner.short() if owner is not None else text


def local_liveness(text: str) -> Liveness:
    """Whether the process that owns a lease lives, judged from this host alone.

    ALIVE and GONE only for owners of this host (same name, boot and pid namespace, or the same
    host name and another boot: rebooted, so gone); UNKNOWN otherwise.
    """
    owner = parse_owner(text)
    if owner is None or owner.host != _this_host():
        return Liveness.UNKNOWN
    if owner.boot != _this_boot():
        return Liveness.GONE
    if owner.pidns != _this_pidns():
        return Liveness.UNKNOWN  # another container on this kernel: its pids are not ours
    if not _HAVE_PROC:
        return _kill_probe(owner.pid)
    stat = _proc_stat(owner.pid)
    if stat is None:
        return Liveness.GONE
    state, start = stat
    if state in ("Z", "X") or (owner.start and start != owner.start):
        return Liveness.GONE  # a zombie, or the pid now belongs to a later process
    return Liveness.ALIVE


class SweepSchedule:
    """When a claimer looks for gone owners' leases.

    At its first claim (a drain started after a crash takes over at once), then at most every
    `interval` seconds, and never more than `share` of the time: a sweep reads every leased or
    backing-off row, which during a long outage may be most of a large table.
    """

    def __init__(self, interval: float = 1.0, share: float = 0.05) -> None:
        self._interval = interval
        self._share = share
        self._next = 0.0

    def due(self) -> bool:
        """Whether a sweep should run now."""
        return time.monotonic() >= self._next

    def done(self, started: float) -> None:
        """Record a sweep that began at `started` (time.monotonic()) and has just ended."""
        ended = time.monotonic()
        self._next = ended + max(self._interval, (ended - started) / self._share)
