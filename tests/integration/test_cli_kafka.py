"""The installed `outbox` script against the real Kafka cluster of `outbox.testing`.

Every command runs as a subprocess of the console script installed next to this interpreter,
exactly as an operator runs it; outboxes are filled through the store API or a real
ResilientProducer, and every message is consumed back from Kafka and counted by its
`outbox-id` header.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import Message

from outbox.headers import ID_HEADER
from outbox.producer.resilient import ResilientProducer
from outbox.records import NewMessage
from outbox.retry import RetryPolicy
from outbox.stores import SQLiteOutbox
from outbox.testing import KafkaCluster
from outbox.testing.consume import consume, topic_size

from ..waiting import wait_until
from .delivery import keyed_value, read_topic

OUTBOX = Path(sys.executable).parent / "outbox"
TIMED_OUT = "_MSG_TIMED_OUT (-192): Local: Message timed out"
TOO_LARGE = "MSG_SIZE_TOO_LARGE (10): Broker: Message size too large"


def outbox_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the installed `outbox` script; OUTBOX_URL / KAFKA_BOOTSTRAP_SERVERS come from args only."""
    assert OUTBOX.exists(), f"{OUTBOX} is missing: pip install -e . into this interpreter's environment"
    env = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_URL", "KAFKA_BOOTSTRAP_SERVERS")}
    return subprocess.run(
        [str(OUTBOX), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def _interruptible() -> None:
    # As in a terminal, Ctrl-C must reach the command: a test run started in the background by a
    # non-interactive shell (`make test &`) has SIGINT ignored, and children inherit that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_cli(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_URL", "KAFKA_BOOTSTRAP_SERVERS")}
    return subprocess.Popen(
        [str(OUTBOX), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=_interruptible,
    )


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: ")
    return lines[0][len("Error: ") :]


def ids_of(messages: list[Message]) -> Counter[str]:
    out: Counter[str] = Counter()
    for m in messages:
        found = [v for k, v in (m.headers() or []) if k == ID_HEADER]
        assert len(found) == 1, m.headers()
        out[found[0].decode()] += 1
    return out


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_outage_then_drain_delivers_everything(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic = make_topic()
    bootstrap = chaos_cluster.bootstrap_servers
    db = tmp_path / "app.db"
    n = 300
    chaos_cluster.stop_all()

    # The application keeps producing while every broker is down: the outbox takes it all.
    producer = ResilientProducer(
        {"bootstrap.servers": bootstrap, "message.timeout.ms": 2000},
        outbox=f"sqlite:///{db}",
        drain_workers=0,
    )
    values = {f"value-{i}".encode() for i in range(n)}
    for i in range(n):
        producer.produce(topic, value=f"value-{i}".encode(), key=f"key-{i % 7}".encode())
    # What counts is what the outbox holds (checked next with `outbox status`); close()'s own
    # answer, and its count in stats()["unsaved_at_close"], are tested with the producer.
    producer.close(timeout=10)

    status = outbox_cli("status", "--outbox", str(db), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["pending_by_topic"] == {topic: n}

    # Still down: drain reports it, sends nothing and leaves every message pending.
    down = outbox_cli("drain", "--outbox", str(db), "-b", bootstrap, "--connect-timeout", "2")
    assert down.returncode == 3
    assert one_error_line(down).endswith(f"nothing was sent, {n} message(s) stay pending in sqlite:///{db}")

    chaos_cluster.start_all()
    chaos_cluster.wait_until_healthy()
    # Right after a restart, partition leaders may still be moving: a send can fail with a
    # retriable error and be rescheduled under the retry policy. Exit code 3 says so, and the
    # operator runs drain again once the next attempt is due (what this loop does).
    runs: list[dict[str, Any]] = []
    for _ in range(5):
        up = outbox_cli("drain", "--outbox", str(db), "-b", bootstrap, "--json", "--workers", "2")
        assert up.returncode in (0, 3), up.stderr
        runs.append(json.loads(up.stdout))
        if up.returncode == 0:
            break
        status = json.loads(outbox_cli("status", "--outbox", str(db), "--json").stdout)
        time.sleep(status["next_due_in_seconds"] + 0.1)
    print("drain runs after the restart:", runs)
    assert up.returncode == 0, runs
    assert sum(r["delivered"] for r in runs) == n and sum(r["dead"] for r in runs) == 0, runs
    # A drain that was not interrupted never hands rows back unsent (with --workers 2, one worker
    # finding nothing due must not stop the other's batch in flight).
    assert sum(r["released"] for r in runs) == 0, runs
    assert (runs[-1]["remaining"], runs[-1]["interrupted"]) == (0, False)

    messages = consume(bootstrap, topic, n, timeout=30)
    assert len(messages) == n
    assert {m.value() for m in messages} == values
    ids = ids_of(messages)
    assert len(ids) == n and set(ids.values()) == {1}
    assert topic_size(bootstrap, topic) == n  # nothing sent twice
    assert json.loads(outbox_cli("status", "--outbox", str(db), "--json").stdout)["pending"] == 0


def test_dead_letters_list_show_replay_drain_purge(
    kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    topic, other = make_topic(), make_topic()
    db = str(tmp_path / "dlq.db")
    store = SQLiteOutbox(db)
    now = time.time()
    timed_out = [
        NewMessage(
            topic=topic,
            value=bytes([i]) * 50 + b"\x00\xff",
            key=f"k{i}".encode(),
            headers=[("app", f"h{i}".encode()), ("bin", b"\x00\x01")],
            msg_id=f"to-{i}",
            attempts=3,
            first_failed_at=now - 600,
            last_error=TIMED_OUT,
            error_code=-192,
            error_name="_MSG_TIMED_OUT",
        )
        for i in range(4)
    ]
    too_large = [
        NewMessage(
            topic=topic,
            value=f"big-{i}".encode(),
            msg_id=f"tl-{i}",
            attempts=1,
            first_failed_at=now,
            last_error=TOO_LARGE,
            error_code=10,
            error_name="MSG_SIZE_TOO_LARGE",
        )
        for i in range(3)
    ]
    to_ids = store.add_dead(timed_out, failed_at=now - 600)
    tl_ids = store.add_dead(too_large, failed_at=now)
    store.close()

    listed = outbox_cli("dlq", "list", "--outbox", db, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [d["id"] for d in json.loads(listed.stdout)] == to_ids + tl_ids
    text = outbox_cli("dlq", "list", "--outbox", db, "--error", "msg_timed_out").stdout.splitlines()
    assert [line.split()[0] for line in text[1:]] == [str(i) for i in to_ids]

    shown = json.loads(outbox_cli("dlq", "show", str(to_ids[1]), "--outbox", db, "--json").stdout)
    assert bytes.fromhex(shown["value"]) == bytes([1]) * 50 + b"\x00\xff"
    assert shown["headers"][0] == {"name": "app", "value": "h1", "encoding": "utf-8"}
    assert outbox_cli("dlq", "show", "999", "--outbox", db).returncode == 1

    # Replay the timed-out ones (all but one) and one too-large to another topic, then drain.
    replay = outbox_cli("dlq", "replay", "--outbox", db, "--error", "-192", "--since", "1h", "--until", "5m")
    assert replay.returncode == 0 and "Replayed 4 dead letter(s)" in replay.stdout
    moved = outbox_cli("dlq", "replay", "--outbox", db, "--id", str(tl_ids[0]), "--to-topic", other, "--json")
    assert json.loads(moved.stdout)["replayed"] == 1
    drained = outbox_cli("drain", "--outbox", db, "-b", kafka_bootstrap, "--json")
    assert drained.returncode == 0, drained.stderr
    assert json.loads(drained.stdout)["delivered"] == 5

    got = consume(kafka_bootstrap, topic, 4, timeout=30)
    assert sorted((m.key(), m.value()) for m in got) == sorted((m.key, m.value) for m in timed_out)
    assert ids_of(got) == Counter({f"to-{i}": 1 for i in range(4)})
    for m in got:
        headers = m.headers() or []
        assert headers[:2] == [("app", m.key().replace(b"k", b"h")), ("bin", b"\x00\x01")]  # kept, in order
    assert topic_size(kafka_bootstrap, topic) == 4
    got_other = consume(kafka_bootstrap, other, 1, timeout=30)
    assert [m.value() for m in got_other] == [b"big-0"] and ids_of(got_other) == Counter({"tl-0": 1})

    # Purge what is left: the two other too-large ones.
    purge = outbox_cli("dlq", "purge", "--outbox", db, "--topic", topic, "--yes")
    assert purge.returncode == 0 and purge.stdout == "Removed 2 dead letter(s).\n"
    status = json.loads(outbox_cli("status", "--outbox", db, "--json").stdout)
    assert (status["pending"], status["dead"]) == (0, 0)


def test_unreachable_cluster_leaves_every_message_pending(tmp_path: Path) -> None:
    db = str(tmp_path / "app.db")
    store = SQLiteOutbox(db)
    got = store.enqueue([NewMessage(topic="orders", value=f"v{i}".encode(), msg_id=f"m{i}") for i in range(25)])
    port = closed_port()
    proc = outbox_cli(
        "drain",
        "--outbox",
        db,
        "-b",
        f"127.0.0.1:{port}",
        "--connect-timeout",
        "2",
        "-X",
        "sasl.password=Pw0rd!",
    )
    assert proc.returncode == 3
    line = one_error_line(proc)
    assert line.startswith(f"cannot reach Kafka: no Kafka broker answered at 127.0.0.1:{port} within 2s")
    assert line.endswith(f"nothing was sent, 25 message(s) stay pending in sqlite:///{db}")
    assert "Pw0rd!" not in proc.stderr + proc.stdout
    st = store.stats(now=time.time())
    assert (st.pending, st.leased, st.dead) == (25, 0, 0)
    assert {store.get(i).attempts for i in got} == {0}
    store.close()


def test_cli_drain_beside_a_live_producer_sends_each_message_once(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    db = str(tmp_path / "shared.db")
    backlog = 6000
    store = SQLiteOutbox(db)
    store.enqueue(
        [
            NewMessage(topic=topic, value=f"old-{i}".encode(), key=f"k{i % 50}".encode(), msg_id=f"old-{i}")
            for i in range(backlog)
        ]
    )
    store.close()

    # The application restarts on the same file: its own drain workers start on the backlog...
    producer = ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap},
        outbox=f"sqlite:///{db}",
        drain_workers=2,
        drain_batch_size=500,
    )
    # ...while an operator runs `outbox drain` on it too, and new messages keep being produced.
    cli = popen_cli("drain", "--outbox", db, "-b", kafka_bootstrap, "--workers", "2", "--json")
    live_ids = [
        producer.produce(topic, value=f"new-{i}".encode(), key=f"k{i % 50}".encode()) for i in range(1000)
    ]
    out, err = cli.communicate(timeout=120)
    # 3 is fine here: rows the application's drainer still held when the CLI finished are pending.
    assert cli.returncode in (0, 3), err
    cli_result = json.loads(out)

    check = SQLiteOutbox(db)
    wait_until(lambda: check.stats(now=time.time()).pending == 0, 60, "the outbox to empty")
    assert producer.flush(30) == 0
    from_outbox, queued_behind = producer.stats()["delivered_from_outbox"], producer.stats()["outboxed"]
    assert producer.close(timeout=30) is True
    check.close()

    total = backlog + len(live_ids)
    messages = consume(kafka_bootstrap, topic, total, timeout=60)
    ids = ids_of(messages)
    assert set(ids) == {f"old-{i}" for i in range(backlog)} | set(live_ids)
    assert set(ids.values()) == {1}
    assert topic_size(kafka_bootstrap, topic) == total  # no duplicate anywhere in the topic
    # The new messages' keys have rows in the backlog: the producer stored them behind it.
    assert queued_behind == len(live_ids)
    # Every stored row was sent by exactly one of the two drainers.
    assert cli_result["delivered"] + from_outbox == backlog + queued_behind
    for key in {m.key() for m in messages}:
        values = [m.value() for m in messages if m.key() == key]
        olds = [v for v in values if v.startswith(b"old-")]
        assert values[: len(olds)] == olds, f"a new message of {key!r} overtook the backlog"
    assert cli_result["dead"] == 0


def test_follow_mode_stops_cleanly_on_sigint(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    db = str(tmp_path / "follow.db")
    store = SQLiteOutbox(db)
    store.enqueue([NewMessage(topic=topic, value=f"a{i}".encode(), msg_id=f"a{i}") for i in range(200)])
    cli = popen_cli("drain", "--outbox", db, "-b", kafka_bootstrap, "--follow", "--json")
    try:
        wait_until(lambda: store.stats(now=time.time()).pending == 0, 60, "the first batch to drain")
        # Messages stored while it runs are picked up too.
        store.enqueue([NewMessage(topic=topic, value=f"b{i}".encode(), msg_id=f"b{i}") for i in range(300)])
        wait_until(lambda: store.stats(now=time.time()).pending == 0, 60, "the second batch to drain")
    except AssertionError:
        cli.kill()  # a --follow drain never ends by itself: never leave it running
        _, err = cli.communicate(timeout=30)
        raise AssertionError(f"drain --follow stalled; its stderr: {err[-3000:]}") from None
    cli.send_signal(signal.SIGINT)
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    result = json.loads(out)
    assert (result["delivered"], result["remaining"], result["interrupted"]) == (500, 0, True)
    assert "Traceback" not in err
    ids = ids_of(consume(kafka_bootstrap, topic, 500, timeout=30))
    assert len(ids) == 500 and set(ids.values()) == {1}
    store.close()


def test_interrupted_drain_releases_its_leases(kafka_bootstrap: str, topic: str, tmp_path: Path) -> None:
    """SIGINT in the middle of a drain: exit 130, "interrupted" in the report, no lease left, the
    rows it did not send due at once. The backlog is large enough (seconds of sending) that the
    signal, sent as soon as the first rows are gone, finds the drain running."""
    db = str(tmp_path / "big.db")
    n = 60000
    store = SQLiteOutbox(db)
    store.enqueue([NewMessage(topic=topic, value=b"x" * 100, msg_id=f"m{i}") for i in range(n)])
    cli = popen_cli("drain", "--outbox", db, "-b", kafka_bootstrap, "--json")
    wait_until(lambda: store.stats(now=time.time()).pending < n, 60, "the drain to start", every=0.01)
    cli.send_signal(signal.SIGINT)
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 130, err
    assert err == ""  # --json: the document says it was interrupted, stderr stays empty
    result: dict[str, Any] = json.loads(out)
    assert result["interrupted"] is True and 0 < result["remaining"] < n
    st = store.stats(now=time.time())
    assert st.leased == 0  # nothing left held by the stopped drain
    assert st.pending == result["remaining"]
    assert st.next_due_at is None or st.next_due_at <= time.time()  # released rows are due at once
    sent = topic_size(kafka_bootstrap, topic)
    assert sent == result["delivered"] == n - st.pending
    store.close()


def test_producer_without_drain_workers_resumes_the_fast_path_after_an_external_drain(
    kafka_bootstrap: str, topic: str, tmp_path: Path
) -> None:
    """drain_workers=0 and `outbox drain` in another process (a sidecar): once that process has
    delivered a key's backlog, the producer sends the key's next messages to Kafka again, behind
    the drained ones, instead of storing every later message of the key for the rest of its life."""
    db = tmp_path / "app.db"
    # A local queue of one message, and no waiting for room: the second produce() meets
    # BufferError and is stored.
    producer = ResilientProducer(
        {"bootstrap.servers": kafka_bootstrap, "queue.buffering.max.messages": 1, "linger.ms": 50},
        outbox=f"sqlite:///{db}",
        drain_workers=0,
        queue_full_timeout=0,
    )
    try:
        producer.produce(topic, b"first", key=b"k")
        producer.produce(topic, b"stored", key=b"k")
        producer.produce(topic, b"behind", key=b"k")  # the key has a backlog: stored behind it
        assert producer.flush(30) == 0
        st = producer.stats()
        assert (st["outboxed"], st["pending"]) == (2, 2)

        drained = outbox_cli("drain", "--outbox", str(db), "-b", kafka_bootstrap, "--json")
        assert drained.returncode == 0, drained.stderr
        assert json.loads(drained.stdout)["delivered"] == 2
        # The producer's key watcher notices that the key's backlog is gone.
        wait_until(lambda: producer.stats()["keys_waiting"] == 0, 30, "the producer released the drained key")

        producer.produce(topic, b"direct", key=b"k")
        assert producer.flush(30) == 0
        st = producer.stats()
        assert (st["outboxed"], st["pending"], st["delivered_first_try"]) == (2, 0, 2)
    finally:
        assert producer.close(timeout=30) is True
    got = consume(kafka_bootstrap, topic, 4, timeout=30)
    assert [m.value() for m in got] == [b"first", b"stored", b"behind", b"direct"]


def test_a_key_erased_by_another_process_in_an_outage_is_released_and_the_others_keep_their_order(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    """A producer queues each key behind its stored rows (`KeyBacklog`). `outbox erase`, another
    process, deletes one key's rows while every broker is down. The producer's key thread looks
    at the store at least once a second while its circuit is not open, whoever removed the rows,
    and finds none of that key's: it releases the key before the cluster is back, with nothing
    delivered. Once it is back, the other keys' stored messages arrive in produce order, none of
    the erased ones arrive (except any the erasure reports as leased: already in flight), and the
    erased key's new messages go to Kafka on their first try."""
    topic = make_topic(partitions=3)
    bs = chaos_cluster.bootstrap_servers
    db = tmp_path / "app.db"
    keys, per_key, erased = 4, 100, b"key-0"
    seq = [0] * keys
    producer = ResilientProducer(
        # 15 s: the restarted cluster's first seconds (idempotence ids not yet granted) time no send out.
        {"bootstrap.servers": bs, "acks": "all", "linger.ms": 5, "message.timeout.ms": 15000},
        outbox=f"sqlite:///{db}", retry=RetryPolicy(max_attempts=100, initial_delay=0.5),
        circuit_reset_timeout=1.0, drain_poll_interval=0.2, lease_seconds=10.0,
    )
    try:
        producer.produce(make_topic(partitions=1), b"warm-up")
        wait_until(lambda: producer.stats()["delivered"] == 1, 60, "the warm-up message is delivered")
        chaos_cluster.stop_all()
        for i in range(keys * per_key):
            k = i % keys
            key, value = keyed_value(k, seq[k])
            seq[k] += 1
            producer.produce(topic, value, key=key)
        wait_until(lambda: producer.stats()["pending"] == keys * per_key and producer.stats()["unsaved"] == 0
                   and producer.stats()["in_memory"] == 0, 90, "every message of the outage is in the outbox")
        assert producer.stats()["keys_waiting"] == keys
        with contextlib.closing(sqlite3.connect(db)) as raw:  # how the producer stored them, for the log
            groups = raw.execute("SELECT count(*), coalesce(sum(n), 0) FROM outbox WHERE n > 1").fetchone()

        done = outbox_cli("erase", "--outbox", str(db), "--key", erased.decode(), "--topic", topic, "--yes", "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["pending"], report["dead"]) == (per_key, 0), report
        with SQLiteOutbox(str(db), create=False) as store:
            assert not store.has_pending(topic, erased)
            assert store.stats(now=time.time()).pending == (keys - 1) * per_key
            [entry] = store.audit_log()
            assert (entry.action, entry.count) == ("erase", per_key) and erased.decode() not in entry.filter
        # Still down: no delivery can have freed anything. The key thread found the key's rows gone.
        wait_until(lambda: producer.stats()["keys_waiting"] == keys - 1, 30, "the producer released the erased key")
        assert producer.stats()["delivered"] == 1

        chaos_cluster.start_all()
        chaos_cluster.wait_until_healthy()
        wait_until(lambda: producer.stats()["pending"] == 0 and producer.stats()["keys_waiting"] == 0
                   and producer.stats()["circuit"] == "closed", 120, "the outbox is drained and the circuit closed")
        first_tries: list[bool] = []
        for _ in range(20):
            key, value = keyed_value(0, seq[0])
            seq[0] += 1
            producer.produce(topic, value, key=key,
                             on_delivery=lambda err, msg: first_tries.append(err is None and msg is not None))
        assert producer.flush(30) == 0
        assert first_tries == [True] * 20, "the erased key's new messages went through the outbox"
        assert producer.stats()["outboxed"] == keys * per_key
    finally:
        producer.close(timeout=30)
    got = read_topic(bs, topic, (keys - 1) * per_key + 20)
    assert got.order_violations() == []
    arrived = {m.value() for m in got.messages}
    assert all(keyed_value(k, s)[1] in arrived for k in range(1, keys) for s in range(per_key))
    assert all(keyed_value(0, s)[1] in arrived for s in range(per_key, per_key + 20))
    erased_arrived = [m for m in got.messages if m.key() == erased and int(m.value().rsplit(b":", 1)[1]) < per_key]
    assert len(erased_arrived) <= report["leased"], "erased messages reached Kafka that were not in flight"
    print(f"\nerasure: {report}; {len(erased_arrived)} erased message(s) were already in flight; "
          f"{groups[1]} of the outage's messages were in {groups[0]} group row(s)")


def test_json_errors_and_exit_codes_of_the_installed_script(kafka_bootstrap: str, tmp_path: Path) -> None:
    """The table of outbox.exitcodes, with --json errors on stdout, from the real console script."""
    db = str(tmp_path / "app.db")
    SQLiteOutbox(db).enqueue([NewMessage(topic="orders", value=b"v", msg_id="m1")])
    port = closed_port()

    def error_of(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
        assert proc.stderr == "", proc.stderr  # nothing else: no Error: line, no raw librdkafka line
        error: dict[str, Any] = json.loads(proc.stdout)["error"]
        assert error["exit_code"] == proc.returncode
        return error

    drain = outbox_cli("drain", "--outbox", db, "-b", f"127.0.0.1:{port}", "--connect-timeout", "2", "--json")
    assert drain.returncode == 3 and error_of(drain)["type"] == "pending"

    gone = outbox_cli("dlq", "replay-topic", "orders.g.dlq", "-b", f"127.0.0.1:{port}", "--timeout", "2", "--json")
    assert gone.returncode == 4 and error_of(gone)["type"] == "kafka_unavailable"

    missing = "no-such-dlq-" + uuid.uuid4().hex[:6]
    absent = outbox_cli("dlq", "replay-topic", missing, "-b", kafka_bootstrap, "--json")
    assert absent.returncode == 2
    assert error_of(absent) == {"type": "usage", "message": f"topic {missing!r} does not exist", "exit_code": 2}

    pending = outbox_cli("dlq", "show", "1", "--outbox", db, "--json")
    assert pending.returncode == 1
    assert error_of(pending)["message"].startswith("message 1 is pending, not a dead letter")

    bad = outbox_cli("dlq", "list", "--outbox", db, "--error", "NOT_A_CODE", "--json")
    assert bad.returncode == 2 and "'NOT_A_CODE' is not a librdkafka error code or name" in error_of(bad)["message"]
