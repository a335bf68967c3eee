"""Chaos at fleet scale: 2 producer processes and 1 drainer process on one
PostgreSQL outbox, while brokers are stopped, killed -9 and restarted at random and the
PostgreSQL server restarts once.

Checks: every message whose produce() returned is in the topic (read back by an independent
consumer), every copy of a message carries the same outbox-id, and the outbox ends empty with
no dead letter. Prints the seed and the counts. `FLEET_CHAOS_SEED` replays a run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from outbox import ATTEMPT_HEADER, ID_HEADER, parse_url
from outbox.stores.postgres import PostgresOutbox
from outbox.testing import KafkaCluster
from outbox.testing.consume import consume_to_end

from ..waiting import wait_until
from .delivery import header
from .private_pg import PrivatePostgres

WORKER = Path(__file__).with_name("fleet_chaos_worker.py")
ROOT = Path(__file__).parents[2]
PRODUCE_SECONDS = 60  # each producer's stream; the chaos runs during its first 45 s
RATE = 100  # produce() calls a second per producer: the 2-core machine runs 5 JVMs besides


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _chaos(cluster: KafkaCluster, pg: PrivatePostgres, rng: random.Random, seconds: float) -> list[str]:
    """Random broker stops, kills and restarts for `seconds`, one PostgreSQL restart among them;
    then every broker is started again. Returns what was done, when."""
    started = time.monotonic()
    pg_at = rng.uniform(10, seconds - 15)
    pg_mode = rng.choice(["fast", "immediate", "kill"])
    log: list[str] = []
    while (now := time.monotonic() - started) < seconds:
        if pg_at is not None and now >= pg_at:
            pg.restart(pg_mode)
            log.append(f"{now:.0f}s pg restart ({pg_mode})")
            pg_at = None
            continue
        up = cluster.running_brokers()
        down = [i for i in range(cluster.num_brokers) if i not in up]
        if up and (not down or rng.random() < 0.6):
            victim = rng.choice(up)
            if rng.random() < 0.5:
                cluster.kill_broker(victim)
                log.append(f"{now:.0f}s kill -9 broker {victim}")
            else:
                cluster.stop_broker(victim)
                log.append(f"{now:.0f}s stop broker {victim}")
        else:
            back = rng.choice(down)
            cluster.start_broker(back)  # blocks until it serves
            log.append(f"{now:.0f}s start broker {back}")
        time.sleep(rng.uniform(2, 6))
    if pg_at is not None:
        pg.restart(pg_mode)
        log.append(f"{time.monotonic() - started:.0f}s pg restart ({pg_mode})")
    cluster.start_all()
    log.append(f"{time.monotonic() - started:.0f}s all brokers started")
    return log


def test_two_producers_and_a_drainer_on_postgres_through_broker_and_database_chaos(
    chaos_cluster: KafkaCluster, make_topic: Callable[..., str], tmp_path: Path
) -> None:
    seed = int(os.environ.get("FLEET_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"\nfleet chaos: seed {seed} (FLEET_CHAOS_SEED={seed} replays the chaos schedule)")
    rng = random.Random(seed)
    topic = make_topic(partitions=6, replication_factor=3, config={"min.insync.replicas": "2"})
    bs = chaos_cluster.bootstrap_servers
    pg = PrivatePostgres("fleet-chaos-pw")
    pg.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        PostgresOutbox(parse_url(pg.url)).close()  # the schema, before three processes race for it
        env = {**os.environ, "OUTBOX_URL": pg.url, "PYTHONPATH": str(ROOT)}
        logs = {n: tmp_path / f"{n}.log" for n in ("drain", "p0", "p1")}
        reports = {n: tmp_path / f"{n}.json" for n in logs}
        argv = {
            "drain": ["drain", bs, str(reports["drain"])],
            **{n: ["produce", bs, topic, n, str(PRODUCE_SECONDS), str(RATE), str(reports[n])] for n in ("p0", "p1")},
        }
        for n, args in argv.items():
            with open(logs[n], "wb") as err:
                procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env, cwd=ROOT,
                                              stdout=subprocess.DEVNULL, stderr=err))
        drainer, producers = procs[0], procs[1:]
        time.sleep(5)  # the producers' first messages go straight to Kafka
        schedule = _chaos(chaos_cluster, pg, rng, PRODUCE_SECONDS - 15)
        chaos_cluster.wait_until_healthy()
        for p, n in zip(producers, ("p0", "p1"), strict=True):
            assert p.wait(180) == 0, f"producer {n} exited with {p.returncode}:\n{_tail(logs[n])}"
        with PostgresOutbox(parse_url(pg.url), create=False) as store:
            wait_until(lambda: store.stats(now=time.time()).pending == 0, 180, "the outbox to drain", every=0.5)
            left = store.stats(now=time.time())
        drainer.send_signal(signal.SIGTERM)
        assert drainer.wait(60) == 0, f"the drainer exited with {drainer.returncode}:\n{_tail(logs['drain'])}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        pg.close()

    made = {n: json.loads(reports[n].read_text()) for n in ("p0", "p1")}
    drained = json.loads(reports["drain"].read_text())
    returned = {mid for r in made.values() for mid in r["returned"]}
    errors = [e for r in made.values() for e in r["errors"]]

    got = consume_to_end(bs, topic)
    values_by_id: dict[str, set[bytes]] = defaultdict(set)
    ids_by_value: dict[bytes, set[str]] = defaultdict(set)
    resent: set[str] = set()
    for m in got:
        mid = (header(m, ID_HEADER) or b"").decode()
        values_by_id[mid].add(m.value())
        ids_by_value[m.value()].add(mid)
        if header(m, ATTEMPT_HEADER) is not None:
            resent.add(mid)
    lost = returned - set(values_by_id)
    print(
        "fleet chaos: " + "; ".join(schedule) + "\n"
        f"fleet chaos: produced {len(returned)} (produce() raised {len(errors)}), delivered unique "
        f"{len(values_by_id)}, records {len(got)}, duplicates {len(got) - len(values_by_id)}, lost {len(lost)}; "
        f"went through the outbox: {sum(r['stats']['outboxed'] for r in made.values())} stored by the producers "
        f"(arrived as re-sends: {len(resent)}); delivered from the outbox by the producers "
        f"{sum(r['stats']['delivered_from_outbox'] for r in made.values())} and by the drainer {drained['delivered']}; "
        f"store errors survived: producers {[r['stats']['store_errors'] for r in made.values()]}, "
        f"drainer {drained['store_errors']}"
    )
    assert not lost, f"{len(lost)} of {len(returned)} messages lost, e.g. {sorted(lost)[:5]}"
    assert "" not in values_by_id, "a message without an outbox-id"
    assert all(len(v) == 1 for v in values_by_id.values()), "one outbox-id on two different messages"
    split = {v: ids for v, ids in ids_by_value.items() if len(ids) > 1}
    assert not split, f"copies of one message with different outbox-ids: {list(split.items())[:3]}"
    assert set(values_by_id) == returned, "a message in the topic that no produce() returned"
    assert errors == [], errors[:3]
    assert [r["unsafe_at_close"] for r in made.values()] == [0, 0]
    assert (left.pending, left.dead) == (0, 0)
    assert len(returned) >= PRODUCE_SECONDS * RATE  # both streams really ran
