"""Dead lease owners lose their leases at once; live owners never do.

Leases here are long (10 minutes, or the producer's default 120 s) so that nothing in these
tests can pass by a lease expiring: a takeover happens because the owner is known to be gone.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from outbox import NewMessage, SQLiteOutbox
from outbox.stores import Outbox, open_outbox
from outbox.stores.owners import Liveness, OwnerId, describe_owner, new_owner, parse_owner
from outbox.stores.postgres import PostgresOutbox
from outbox.testing import KafkaCluster

from ..waiting import wait_until
from .delivery import read_topic
from .test_cli_kafka import outbox_cli

LONG_LEASE = 600.0

# Leases rows through its own store and stays alive until its stdin closes or it is killed.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from outbox.stores.owners import new_owner, OwnerId, parse_owner
    from outbox.stores import open_outbox
    url, limit, remote = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "remote"
    owner = new_owner("drain")
    if remote:  # a name this host cannot judge by its process: liveness comes from the store
        o = parse_owner(owner)
        owner = str(OwnerId(o.role, "another-host", o.pid, o.start, o.boot, o.pidns, o.nonce))
    store = open_outbox(url)
    rows = store.claim(owner, limit, 600.0, now=time.time())
    print(owner, len(rows), flush=True)
    sys.stdin.read()
    """
)


def fill(store: Outbox, topic: str, n: int, keys: int) -> None:
    """n messages as n rows: enqueued one by one, so a SQLite store does not group them (a group
    is leased whole, and these tests count leases per message)."""
    for i in range(n):
        store.enqueue([NewMessage(topic, b"k%d:%d" % (i % keys, i // keys), b"k%d" % (i % keys), [], -1, f"m{i}")])


def start_holder(url: str, limit: int, *, remote: bool = False) -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, str(limit), "remote" if remote else "local"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None
    owner, claimed = child.stdout.readline().split()
    assert int(claimed) == limit
    return child, owner


def kill(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL


def takeover(url: str, remote: bool) -> None:
    """8 rows leased by a live holder, 32 more of the same keys waiting behind them."""
    store = open_outbox(url)
    fill(store, "t", 40, keys=4)
    child, owner = start_holder(url, 8, remote=remote)
    try:
        # A fresh claimer (its first claim sweeps): the live owner keeps every lease, and the
        # other rows wait behind them in key order.
        claimer = open_outbox(url)
        assert claimer.owner_liveness([owner]) == {owner: Liveness.ALIVE}
        assert claimer.claim(new_owner("drain"), 100, 60.0, now=time.time()) == []
        assert claimer.release_gone_owners(now=time.time()) == 0
        assert claimer.stats(now=time.time()).leased == 8
        claimer.close()
    finally:
        kill(child)
    # The owner is gone (for PostgreSQL: once its server session has ended and freed the lock).
    wait_until(lambda: store.owner_liveness([owner]) == {owner: Liveness.GONE}, 30, "the owner to be gone", every=0.05)
    claimer = open_outbox(url)
    rows = claimer.claim(new_owner("drain"), 100, 60.0, now=time.time())
    assert [r.msg_id for r in rows] == [f"m{i}" for i in range(40)]  # all at once, in order
    claimer.close()
    store.close()


def test_sqlite_dead_owner_loses_leases_at_once_live_owner_never(tmp_path: Path) -> None:
    takeover(f"sqlite:///{tmp_path / 'o.db'}", remote=False)


def test_postgres_dead_owner_loses_leases_at_once_live_owner_never(fresh_postgres_url: str) -> None:
    # remote: the owner claims to be on another host, so only its advisory lock says it lives.
    takeover(fresh_postgres_url, remote=True)


def test_postgres_same_host_owner_is_judged_by_its_process(fresh_postgres_url: str) -> None:
    takeover(fresh_postgres_url, remote=False)


def test_mysql_dead_owner_loses_leases_at_once_live_owner_never(fresh_mysql_url: str) -> None:
    # remote: the owner claims to be on another host, so only its named lock says it lives.
    takeover(fresh_mysql_url, remote=True)


def test_mysql_same_host_owner_is_judged_by_its_process(fresh_mysql_url: str) -> None:
    takeover(fresh_mysql_url, remote=False)


def test_postgres_owner_lock_is_held_on_its_own_connection(fresh_postgres_url: str) -> None:
    """The lock lives as long as the store, not as long as a pooled connection's checkout."""
    store = PostgresOutbox(fresh_postgres_url, pool_size=1)
    fill(store, "t", 4, keys=4)
    o = parse_owner(new_owner("drain"))
    assert o is not None
    remote = str(OwnerId(o.role, "another-host", o.pid, o.start, o.boot, o.pidns, o.nonce))
    assert len(store.claim(remote, 2, LONG_LEASE, now=time.time())) == 2
    other = PostgresOutbox(fresh_postgres_url)
    for _ in range(3):  # the pool's one connection is used and returned many times meanwhile
        assert store.stats(now=time.time()).leased == 2
    assert other.owner_liveness([remote]) == {remote: Liveness.ALIVE}
    assert other.release_gone_owners(now=time.time()) == 0
    store.close()  # a clean close ends the owner: its lock goes when the server ends its session
    gone = {remote: Liveness.GONE}
    wait_until(lambda: other.owner_liveness([remote]) == gone, 30, "the server to end the session", every=0.05)
    assert other.release_gone_owners(now=time.time()) == 2
    other.close()


def test_a_live_sqlite_producer_keeps_its_write_ahead_leases(tmp_path: Path) -> None:
    """Rows born leased by a live write-ahead producer are never taken by a claimer."""
    path = tmp_path / "o.db"
    store = SQLiteOutbox(str(path))
    owner = new_owner("producer")  # this very process: alive
    store.enqueue(
        [NewMessage("t", b"v", b"k0", [], -1, "first")], lease_owner=owner, lease_until=time.time() + LONG_LEASE
    )
    fill(store, "t", 3, keys=1)
    claimer = SQLiteOutbox(str(path))
    assert claimer.release_gone_owners(now=time.time()) == 0
    assert claimer.claim(new_owner("drain"), 10, 60.0, now=time.time()) == []
    assert claimer.stats(now=time.time()).leased == 1


# A write-ahead sync producer killed -9 while its sends are still in
# flight (within message.timeout.ms), so its rows stay leased (lease_seconds 120 s by default).
# Two of three brokers are down under min.insync.replicas=2: librdkafka retries
# NOT_ENOUGH_REPLICAS by itself, the circuit stays closed and the rows stay leased to the
# sender. (With every broker down the circuit opens, purges librdkafka's queue and releases the
# rows at once: no lease is left to take over.)
WRITE_AHEAD_CHILD = textwrap.dedent(
    """
    import sys
    from outbox import ResilientProducer
    bootstrap, url, topic = sys.argv[1:4]
    p = ResilientProducer(
        {"bootstrap.servers": bootstrap, "message.timeout.ms": 60000},
        outbox=url, mode="write-ahead", durability="sync", drain_workers=0,
    )
    i = 0
    while True:
        key = b"key-%d" % (i % 10)
        print(p.produce(topic, key + b":%d" % (i // 10), key=key), flush=True)
        i += 1
    """
)


def crash_then_drain(cluster: KafkaCluster, topic: str, url: str) -> None:
    bootstrap = cluster.bootstrap_servers
    cluster.stop_broker(1)
    cluster.stop_broker(2)
    child = subprocess.Popen(
        [sys.executable, "-c", WRITE_AHEAD_CHILD, bootstrap, url, topic],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert child.stdout is not None
    acknowledged = []
    for line in child.stdout:
        acknowledged.append(line.strip())
        if len(acknowledged) == 500:
            break
    kill(child)
    acknowledged += [line.strip() for line in child.stdout]
    store = open_outbox(url, create=False)
    assert store.stats(now=time.time()).leased > 0  # the dead producer left rows leased
    store.close()

    cluster.start_broker(1)
    cluster.start_broker(2)
    cluster.wait_until_healthy()
    drain = outbox_cli("drain", "--outbox", url, "-b", bootstrap, "--until-empty", "--json")
    assert drain.returncode == 0, (drain.stdout, drain.stderr)
    got = read_topic(bootstrap, topic, len(acknowledged))
    assert not set(acknowledged) - set(got.by_id)
    store = open_outbox(url, create=False)
    assert store.stats(now=time.time()).pending == 0
    store.close()


MIN_ISR_2 = {"min.insync.replicas": "2"}


def test_drain_takes_over_a_killed_write_ahead_producer_sqlite(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    crash_then_drain(chaos_cluster, make_topic(config=MIN_ISR_2), f"sqlite:///{tmp_path / 'app.db'}")


def test_drain_takes_over_a_killed_write_ahead_producer_postgres(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], fresh_postgres_url: str
) -> None:
    crash_then_drain(chaos_cluster, make_topic(config=MIN_ISR_2), fresh_postgres_url)


T_BACKOFF = 4102444800.0  # 2100-01-01 00:00:00Z
T_ALIVE = T_BACKOFF + 7200


def test_drain_says_what_is_left_and_why(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    """After a drain, text and JSON name each remaining row's state; the live owner's rows stay."""
    path = tmp_path / "o.db"
    url = f"sqlite:///{path}"
    store = SQLiteOutbox(str(path))
    alive = new_owner("producer")  # this test process: alive while the drain runs
    store.enqueue([NewMessage(topic, b"1", b"a", [], -1, "m1")], lease_owner=alive, lease_until=T_ALIVE)
    store.enqueue(
        [
            NewMessage(topic, b"2", b"a", [], -1, "m2"),  # waits behind the live owner's row
            NewMessage(topic, b"3", b"b", [], -1, "m3", next_attempt_at=T_BACKOFF),
            NewMessage(topic, b"4", b"c", [], -1, "m4"),
            NewMessage(topic, b"5", None, [], -1, "m5"),
        ]
    )
    store.close()
    text = outbox_cli("drain", "--outbox", url, "-b", kafka_bootstrap)
    assert text.returncode == 3, text.stderr
    first, *rest = text.stdout.splitlines()
    assert first.startswith("Delivered 2, retried 0, dead-lettered 0 in ")
    who = describe_owner(alive)
    assert rest == [
        f"3 message(s) still pending in {url}:",
        "  1 backing off until 2100-01-01 00:00:00Z",
        f"  1 leased by {who} (alive) until 2100-01-01 02:00:00Z",
        f"  1 waiting behind 1 row(s) of their key leased by {who} until 2100-01-01 02:00:00Z",
    ]
    assert sorted(m.value() for m in read_topic(kafka_bootstrap, topic, 2).messages) == [b"4", b"5"]

    doc = json.loads(outbox_cli("drain", "--outbox", url, "-b", kafka_bootstrap, "--json").stdout)
    assert (doc["delivered"], doc["remaining"], doc["next_due_at"]) == (0, 3, "2100-01-01T00:00:00.000Z")
    assert doc["backlog"]["leases"] == [
        {"owner": alive, "name": who, "state": "alive", "leased": 1, "waiting": 1, "until": "2100-01-01T02:00:00.000Z"}
    ]
    assert (doc["backlog"]["due_now"], doc["backlog"]["backing_off"]) == (0, 1)


def test_drain_takes_over_a_killed_write_ahead_producer_mysql(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], fresh_mysql_url: str
) -> None:
    crash_then_drain(chaos_cluster, make_topic(config=MIN_ISR_2), fresh_mysql_url)
