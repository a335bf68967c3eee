"""A full disk for tests: a directory whose SQLite files run out of space for real.

:func:`small_disk` gives a test a directory on a size-limited filesystem, a ``tmpfs`` mounted with
``size=``: a SQLite database in it that outgrows the size fails its write with ``SQLITE_FULL``
(``sqlite3.OperationalError: database or disk is full``), the same error a full disk gives in
production, because the kernel answers a write with ``ENOSPC``. :func:`resize_disk` remounts it
with another size, so a test can free the disk mid-run and watch the code recover.

Mounting needs Linux and root (``CAP_SYS_ADMIN``). Where it is not permitted, :func:`small_disk`
falls back to SQLite's own size limit: while the context is open, every ``sqlite3.connect()`` of a
file in the directory gets ``PRAGMA max_page_count`` for the size, which makes SQLite refuse to
grow the database with the same ``SQLITE_FULL``. That limit covers the database pages only (not
its journal or WAL, nor other files), and reaches only connections made through the
:mod:`sqlite3` module while the context is open.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sqlite3
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

__all__ = ["resize_disk", "small_disk"]

_MS_REMOUNT = 32
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform == "linux" else None
except OSError:  # pragma: no cover - non-glibc Linux
    _libc = None


@dataclass(eq=False)
class _Disk:
    path: Path
    size: int
    mounted: bool
    conns: list[sqlite3.Connection] = field(default_factory=list)


_disks: dict[Path, _Disk] = {}
_lock = threading.Lock()
_real_connect = sqlite3.connect


def _mount(target: Path, size: int, *, remount: bool) -> None:
    if _libc is None:
        raise OSError(errno.ENOSYS, "mounting a tmpfs needs Linux with glibc")
    flags = _MS_REMOUNT if remount else 0
    # tmpfs rounds the size up to whole pages; nr_inodes is left at its default.
    rc = _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", flags, f"size={size}".encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs size={size} on {target}: {os.strerror(err)}")


def _unmount(target: Path) -> None:
    if _libc is None:
        return
    if _libc.umount2(os.fsencode(target), 0) != 0 and ctypes.get_errno() == errno.EBUSY:
        # A file still open in it (a connection the test leaked): detach now, freed when closed.
        _libc.umount2(os.fsencode(target), 2)  # MNT_DETACH


def _db_path(database: Any, uri: bool) -> Path | None:
    if not isinstance(database, (str, bytes, os.PathLike)):
        return None
    name = os.fsdecode(database)
    if uri or name.startswith("file:"):
        if not name.startswith("file:"):
            return None
        name = unquote(name[len("file:") :].split("?", 1)[0])
    if name in ("", ":memory:"):
        return None
    return Path(name).resolve()


def _limit(conn: sqlite3.Connection, size: int) -> None:
    page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
    # SQLite keeps the limit at the current page count if the size is already exceeded.
    conn.execute(f"PRAGMA max_page_count = {max(1, size // page_size)}")


def _connect(database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
    conn: sqlite3.Connection = _real_connect(database, *args, **kwargs)
    path = _db_path(database, bool(kwargs.get("uri", False)))
    if path is None:
        return conn
    with _lock:
        disk = next((d for d in _disks.values() if not d.mounted and d.path in path.parents), None)
        if disk is not None:
            _limit(conn, disk.size)
            disk.conns.append(conn)
    return conn


@contextlib.contextmanager
def small_disk(
    size_bytes: int, *, mount: bool | None = None, base_dir: str | os.PathLike[str] | None = None
) -> Iterator[Path]:
    """A directory on a filesystem of ``size_bytes``, removed (unmounted) afterwards.

    Example::

        with small_disk(256 * 1024) as disk:
            producer = ResilientProducer(conf, outbox=f"sqlite:///{disk / 'outbox.db'}")
            ...                                  # writes fail: database or disk is full
            resize_disk(disk, 64 * 1024 * 1024)  # free the disk
            ...                                  # writes succeed again

    Args:
        size_bytes: The filesystem's size (a tmpfs rounds it up to whole pages).
        mount: ``True``: mount a tmpfs or raise; ``False``: use the SQLite page limit;
            ``None``: a tmpfs where mounting is permitted, else the page limit.
        base_dir: Where to make the directory (default: the system temp dir).

    Yields:
        The directory.

    Raises:
        OSError: ``mount=True`` and the tmpfs could not be mounted.
    """
    if size_bytes <= 0:
        raise ValueError("size_bytes must be > 0")
    path = Path(tempfile.mkdtemp(prefix="outbox-small-disk-", dir=base_dir)).resolve()
    mounted = False
    try:
        if mount is not False:
            try:
                _mount(path, size_bytes, remount=False)
                mounted = True
            except OSError as exc:
                if mount or exc.errno not in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                    raise
        disk = _Disk(path, size_bytes, mounted)
        with _lock:
            _disks[path] = disk
            if not mounted:
                # Patched on the module, so code that calls sqlite3.connect() (the outbox's store) is covered.
                sqlite3.connect = _connect  # type: ignore[assignment]
        yield path
    finally:
        with _lock:
            _disks.pop(path, None)
            if not any(not d.mounted for d in _disks.values()):
                sqlite3.connect = _real_connect
        if mounted:
            _unmount(path)
        shutil.rmtree(path, ignore_errors=True)


def resize_disk(path: str | os.PathLike[str], size_bytes: int) -> None:
    """Give a :func:`small_disk` directory a new size: grow it to free the disk, or shrink it.

    A tmpfs is remounted (shrinking below what it holds fails). Under the page-limit fallback
    the new limit applies to new connections and to the open ones this module can still reach
    (a connection that may only be used by the thread that made it keeps its old limit).

    Raises:
        KeyError: ``path`` is not an open :func:`small_disk`.
        OSError: The remount failed.
    """
    if size_bytes <= 0:
        raise ValueError("size_bytes must be > 0")
    with _lock:
        disk = _disks[Path(path).resolve()]
        if disk.mounted:
            _mount(disk.path, size_bytes, remount=True)
        else:
            for conn in disk.conns:
                with contextlib.suppress(sqlite3.ProgrammingError):  # closed, or bound to another thread
                    _limit(conn, size_bytes)
        disk.size = size_bytes
