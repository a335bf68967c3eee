"""When the outbox itself fails: SQLite full, locked, read-only or deleted; PostgreSQL restarted,
killed, or its pool's connections all terminated; MariaDB (the MySQL store) restarted or killed.

Each test runs a produce() stream during an outage (every broker stopped, so every message must
go to the outbox) while the store fails, then brings the store and the brokers back, and checks:
what produce() did meanwhile (it returned: the messages waited in memory), and that every
message whose produce() returned is delivered, without restarting the producer, and nothing
else is: the outbox-ids read back are exactly those produce() returned. Delivery is at least
once: a drain cut off between Kafka's acknowledgement and the store's delete sends again, so
duplicates are counted by outbox-id and printed, not forbidden. The small file system is a real
tmpfs mounted for the test (root only, as in CI).

Read-only: a file system with a file open for writing cannot be remounted read-only (EBUSY), and
root ignores file modes, so the test makes the live outbox's files immutable (`chattr +i`, ext4):
then every write through the producer's open descriptors fails (EPERM), as on a file system the
kernel remounted read-only after an error (EROFS). The test checks that root really cannot write.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox import ResilientProducer, RetryPolicy
from outbox.testing import KafkaCluster

from ..waiting import wait_until
from .delivery import read_topic


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs of our own, which `fill` fills to the last byte."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path) -> Path:
    """Take every free byte of the file system; return the filler file."""
    filler = mnt / "filler"
    # Unbuffered: a buffered file's close() flushes what the failed write left in its buffer and
    # raises ENOSPC again, outside any try (a fresh-machine run failed so).
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)  # a short write when nearly full; ENOSPC once full
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


class Stream:
    """produce() in a thread, recording the id of every call that returned."""

    def __init__(self, p: ResilientProducer, topic: str) -> None:
        self.p, self.topic = p, topic
        self.returned: list[str] = []
        self.errors: list[BaseException] = []
        self.max_unsaved = 0  # the most messages seen waiting in memory for the store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                self.returned.append(self.p.produce(self.topic, b"%d:" % i + b"x" * 500, key=b"k%d" % (i % 7)))
            except Exception as exc:  # the test reports what produce() raised, if anything
                self.errors.append(exc)
            i += 1
            if i % 50 == 0:
                self.max_unsaved = max(self.max_unsaved, self.p.writer.pending())
            time.sleep(0.002)

    def start(self) -> Stream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        start = len(self.returned)
        while len(self.returned) < start + n:
            assert time.monotonic() < deadline, f"produce() stalled at {len(self.returned)}"
            time.sleep(0.05)


def producer(url: str, bootstrap: str) -> ResilientProducer:
    return ResilientProducer(
        {"bootstrap.servers": bootstrap, "message.timeout.ms": 2000},
        outbox=url, drain_workers=1, drain_poll_interval=0.2, circuit_reset_timeout=1.0,
        retry=RetryPolicy(max_attempts=1000, initial_delay=0.5, max_delay=2.0),
    )


def pending_below(p: ResilientProducer, limit: int) -> bool:
    """Fewer than `limit` rows pending. Read through `stats()`, which answers while the store
    fails (its store fields read None): a session the server terminated fails the one call that
    takes it from the pool, and the pool then replaces it."""
    pending = p.stats()["pending"]
    return pending is not None and pending < limit


def recover_and_check(cluster: KafkaCluster, p: ResilientProducer, stream: Stream, topic: str) -> None:
    cluster.start_all()
    cluster.wait_until_healthy()
    stream.wait_for(200)  # still producing, now through a healthy store and cluster
    stream.stop()
    wait_until(lambda: p.flush(5) == 0 and pending_below(p, 1), 120, "the outbox to drain")
    got = read_topic(cluster.bootstrap_servers, topic, len(stream.returned))
    missing = set(stream.returned) - set(got.by_id)
    print(
        f"\n{len(stream.returned)} produce() returned, {len(stream.errors)} raised; at most "
        f"{stream.max_unsaved} waited in memory; store errors survived by the drain: "
        f"{p.stats()['store_errors']}; delivered unique {got.unique}, duplicates {got.duplicates}, "
        f"lost {len(missing)}"
    )
    p.close(timeout=10)
    assert not stream.errors, stream.errors[:3]
    assert not missing, f"{len(missing)} of {len(stream.returned)} returned messages lost"
    strays = set(got.by_id) - set(stream.returned)
    assert not strays, f"{len(strays)} delivered messages no produce() returned"


def test_disk_full_during_spill(chaos_cluster: KafkaCluster, topic: str, small_fs: Path) -> None:
    chaos_cluster.stop_all()
    p = producer(f"sqlite:///{small_fs / 'o.db'}", chaos_cluster.bootstrap_servers)
    stream = Stream(p, topic).start()
    stream.wait_for(300)
    filler = fill(small_fs)
    committed = p.writer.committed_rows
    stream.wait_for(1000)  # produce() goes on returning: the messages wait in memory
    assert p.writer.pending() > 0  # and the writer says they are not safe yet
    time.sleep(3)
    assert p.writer.committed_rows <= committed + 200  # nothing more fits on the disk
    filler.unlink()  # space again: the writer commits what waited
    recover_and_check(chaos_cluster, p, stream, topic)


LOCKER = textwrap.dedent(
    """
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    conn.execute("COMMIT")
    """
)


def test_file_locked_by_another_process_for_30s(chaos_cluster: KafkaCluster, topic: str, tmp_path: Path) -> None:
    chaos_cluster.stop_all()
    path = tmp_path / "o.db"
    p = producer(f"sqlite:///{path}", chaos_cluster.bootstrap_servers)
    stream = Stream(p, topic).start()
    stream.wait_for(300)
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(path), "30"], stdout=subprocess.PIPE, text=True)
    assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
    stream.wait_for(500)
    # produce() did not wait for the lock: those 500 calls returned while it was still held.
    assert locker.poll() is None, "the lock was released before 500 produce() calls returned"
    assert locker.wait(60) == 0
    recover_and_check(chaos_cluster, p, stream, topic)
    assert os.path.exists(path)


def test_postgresql_restarted_and_killed_during_spill_and_drain(chaos_cluster: KafkaCluster, topic: str) -> None:
    """A private server (the shared one is never restarted): fast restart and kill -9 while
    spilling, another restart while draining; the producer is never restarted."""
    from .private_pg import PrivatePostgres

    pg = PrivatePostgres("faults-pw")
    pg.start()
    try:
        chaos_cluster.stop_all()
        p = producer(pg.url, chaos_cluster.bootstrap_servers)
        stream = Stream(p, topic).start()
        stream.wait_for(300)
        pg.restart("fast")  # pg_ctl -m fast: connections terminated by the administrator
        stream.wait_for(300)
        pg.restart("kill")  # kill -9 of the postmaster, then crash recovery
        stream.wait_for(300)
        chaos_cluster.start_all()
        chaos_cluster.wait_until_healthy()
        wait_until(lambda: pending_below(p, len(stream.returned)), 120, "draining to start")
        pg.restart("fast")  # while the drain workers send the backlog
        recover_and_check(chaos_cluster, p, stream, topic)
    finally:
        pg.close()


def test_mariadb_restarted_and_killed_during_spill_and_drain(chaos_cluster: KafkaCluster, topic: str) -> None:
    """The MySQL store on a MariaDB server of its own (the session's serves other tests): a clean
    restart and a kill -9 while spilling, another restart while draining; the producer is never
    restarted, and its pool replaces the connections the server dropped."""
    from outbox.testing.mariadb import MariaDB, create_database

    db = MariaDB()
    db.start()
    try:
        url = create_database(db.url)
        chaos_cluster.stop_all()
        p = producer(url, chaos_cluster.bootstrap_servers)
        stream = Stream(p, topic).start()
        stream.wait_for(300)
        db.stop()  # a clean shutdown: every connection closed by the server
        stream.wait_for(100)  # produce() goes on meanwhile: the messages wait in memory
        db.start()
        stream.wait_for(300)
        db.kill()  # kill -9 of mariadbd, then crash recovery at the start
        db.start()
        stream.wait_for(300)
        chaos_cluster.start_all()
        chaos_cluster.wait_until_healthy()
        wait_until(lambda: pending_below(p, len(stream.returned)), 120, "draining to start")
        db.stop()  # while the drain workers send the backlog
        db.start()
        recover_and_check(chaos_cluster, p, stream, topic)
    finally:
        db.remove()


def _can_write(path: Path) -> bool:
    try:
        with open(path, "r+b"):
            return True
    except PermissionError:
        return False


def test_file_made_read_only_during_spill(
    chaos_cluster: KafkaCluster, topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    chaos_cluster.stop_all()
    path = tmp_path / "o.db"
    p = producer(f"sqlite:///{path}", chaos_cluster.bootstrap_servers)
    stream = Stream(p, topic).start()
    stream.wait_for(300)
    files = [path, Path(f"{path}-wal")]  # not -shm: it is mmapped, and a write fault there is SIGBUS
    subprocess.run(["chattr", "+i", *map(str, files)], check=True)
    try:
        assert not any(_can_write(f) for f in files), "chattr +i did not make the outbox read-only"
        committed = p.writer.committed_rows
        stream.wait_for(500)  # produce() goes on returning: the messages wait in memory
        assert p.writer.pending() > 0
        time.sleep(3)
        assert p.writer.committed_rows <= committed + 200  # nothing more reaches the file
    finally:
        subprocess.run(["chattr", "-i", *map(str, files)], check=True)
    errors = [r.getMessage() for r in caplog.records if r.name == "outbox.producer.writer" and r.levelname == "ERROR"]
    assert errors, "the writer never failed"
    print(f"\nthe writer's first error: {errors[0][:300]}")
    recover_and_check(chaos_cluster, p, stream, topic)


def _rows_in(path: Path) -> int:
    """Pending messages in the file at `path`, read by a connection of its own (as another process would)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        # n: a row may hold several messages (a group, outbox.stores.grouped).
        return int(conn.execute("SELECT COALESCE(SUM(n), 0) FROM outbox WHERE status = 0").fetchone()[0])
    finally:
        conn.close()


def test_file_deleted_underneath_is_recreated_with_its_rows(
    chaos_cluster: KafkaCluster, topic: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`rm o.db` (the log and shm files stay), later `rm o.db-wal o.db-shm o.db`, while a producer
    spills into it; then `rm o.db` again while its drain workers send the backlog.

    SQLite would go on writing to the deleted file, which dies with the process. The store sees
    the path no longer names its file before its next write and re-creates it with every row:
    what is in the file at the path, read by another connection, is everything outboxed."""
    def recreated() -> int:
        return sum("deleted while in use; re-created" in r.getMessage() for r in caplog.records)

    chaos_cluster.stop_all()
    path = tmp_path / "o.db"
    p = producer(f"sqlite:///{path}", chaos_cluster.bootstrap_servers)
    stream = Stream(p, topic).start()
    for n, victims in enumerate(([path], [Path(f"{path}-wal"), Path(f"{path}-shm"), path]), 1):
        stream.wait_for(300)
        for f in victims:
            f.unlink()
        stream.wait_for(300)
        wait_until(lambda: recreated() == n, 120, "the outbox file to be re-created")  # noqa: B023
        # Only the store's rescue can bring the path back: its connections never create the file.
        assert path.exists()
        # Kafka is down, so no row leaves: every row the writer ever committed must be in the
        # new file, readable by any process.
        wait_until(lambda: p.writer.flush(5) == 0, 120, "the writer to commit")
        committed = p.writer.committed_rows
        assert _rows_in(path) >= committed >= 600
    # Once more while the drain workers send the backlog: rows they hold in flight are copied
    # with their leases, and their acknowledgements then delete the copies.
    chaos_cluster.start_all()
    chaos_cluster.wait_until_healthy()
    wait_until(lambda: pending_below(p, len(stream.returned) - 300), 120, "draining to start")
    path.unlink()
    # The drain may empty the outbox and free every key before the unlink, and then nothing
    # writes the store again. A message too large for any broker (librdkafka refuses it in
    # produce()) is dead-lettered: one write the store makes after the unlink in every case, with
    # the drain's rows still in flight copied if there are any.
    p.produce(topic, b"x" * 2_000_000)
    wait_until(lambda: recreated() == 3, 120, "the outbox file to be re-created while draining")
    wait_until(lambda: p.store.count_dead() == 1, 60, "the too-large message to be dead-lettered in the new file")
    assert not stream.errors, stream.errors[:3]
    recover_and_check(chaos_cluster, p, stream, topic)


def _terminate_backends(admin_url: str) -> int:
    """pg_terminate_backend() every other client session of the server: the whole pool at once,
    and the lease owners' advisory-lock sessions with it."""
    with psycopg.connect(admin_url, autocommit=True) as c:
        rows = c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchall()
    return sum(1 for (ok,) in rows if ok)


def test_postgresql_pool_loses_all_its_connections_during_spill_and_drain(
    chaos_cluster: KafkaCluster, topic: str
) -> None:
    """Every session of the producer terminated by the server, 5 times while spilling and 5 times
    while draining (a private server: the shared one serves other tests)."""
    from .private_pg import PrivatePostgres

    pg = PrivatePostgres("pool-pw")
    pg.start()
    try:
        chaos_cluster.stop_all()
        p = producer(pg.url, chaos_cluster.bootstrap_servers)
        stream = Stream(p, topic).start()
        stream.wait_for(300)
        for _ in range(5):
            assert _terminate_backends(pg.url) > 0
            stream.wait_for(200)
        chaos_cluster.start_all()
        chaos_cluster.wait_until_healthy()
        wait_until(lambda: pending_below(p, len(stream.returned)), 120, "draining to start")
        for _ in range(5):
            assert _terminate_backends(pg.url) > 0
            time.sleep(0.5)
        recover_and_check(chaos_cluster, p, stream, topic)
    finally:
        pg.close()
