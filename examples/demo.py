"""kafka-outbox demo: a stream of messages survives an outage of the whole Kafka cluster.

    make demo                                   # local 3-broker cluster, brokers stopped mid-stream
    KAFKA_BOOTSTRAP_SERVERS=host:9092 make demo # your cluster, no broker stopped

Side by side, a plain confluent_kafka.Producer sends the same stream to another topic, so the
difference is counted, not claimed.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from contextlib import ExitStack

from confluent_kafka import Producer

from outbox import ResilientProducer, RetryPolicy
from outbox.testing import KafkaCluster, create_topic
from outbox.testing.consume import consume_to_end

TOTAL = int(os.environ.get("DEMO_MESSAGES", "6000"))
RATE = 500  # messages per second: the stream lasts TOTAL / RATE seconds
KAFKA = {"acks": "all", "enable.idempotence": True, "message.timeout.ms": 5000}


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="  %(name)s: %(message)s")
    logging.getLogger("outbox.librdkafka").setLevel(logging.CRITICAL)  # "connection refused" noise
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    with ExitStack() as stack:
        if external:
            bootstrap, cluster = external, None
            say(f"using your cluster at {bootstrap} (no broker will be stopped)")
        else:
            say("starting a local Apache Kafka cluster: 1 controller + 3 brokers (first run downloads Kafka)")
            cluster = stack.enter_context(KafkaCluster(brokers=3))
            bootstrap = cluster.bootstrap_servers
        suffix = str(int(time.time()))
        topic, raw_topic = f"demo-orders-{suffix}", f"demo-orders-raw-{suffix}"
        rf = 3 if cluster else None
        for t in (topic, raw_topic):
            create_topic(bootstrap, t, 3, rf, {"min.insync.replicas": "2"} if cluster else None)
        workdir = stack.enter_context(tempfile.TemporaryDirectory())
        outbox_url = f"sqlite:///{workdir}/outbox.db"
        dead: list[object] = []
        raw_failed = [0]

        def raw_report(err: object, msg: object) -> None:
            if err is not None:
                raw_failed[0] += 1

        raw = Producer({"bootstrap.servers": bootstrap, **KAFKA, "logger": logging.getLogger("outbox.librdkafka")})
        producer = ResilientProducer(
            {"bootstrap.servers": bootstrap, **KAFKA},
            outbox=outbox_url,
            retry=RetryPolicy(max_attempts=20, backoff="exponential", initial_delay=0.5, max_delay=5.0),
            on_dead_letter=dead.append,
            circuit_reset_timeout=2.0,
        )
        say(f"producing {TOTAL} orders at {RATE}/s with ResilientProducer (outbox: {outbox_url})")
        started = time.monotonic()
        for i in range(TOTAL):
            if cluster and i == TOTAL // 3:
                say("*** stopping ALL brokers mid-stream ***")
                cluster.stop_all()
            if cluster and i == 2 * TOTAL // 3:
                say("*** starting the brokers again ***")
                cluster.start_all()
            key, value = b"customer-%d" % (i % 50), b'{"order": %d}' % i
            producer.produce(topic, value, key=key)
            try:
                raw.produce(raw_topic, value, key, on_delivery=raw_report)
            except BufferError:
                raw_failed[0] += 1
            raw.poll(0)
            if i % RATE == 0:
                st = producer.stats()
                say(
                    f"  produced {i:>6}  delivered {st['delivered']:>6}  "
                    f"in outbox {st['pending']:>6}  circuit {st['circuit']}"
                )
            time.sleep(max(0.0, started + (i + 1) / RATE - time.monotonic()))
        say("stream done; draining the outbox")
        raw.flush(30)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = producer.stats()
            if st["pending"] == 0 and st["in_memory"] == 0 and st["unsaved"] == 0:
                break
            say(f"  delivered {st['delivered']:>6}  in outbox {st['pending']:>6}  circuit {st['circuit']}")
            time.sleep(2)
        st = producer.stats()
        producer.close(30)
        # Everything the topics hold, to the end: a count would stop early on a duplicate.
        got = consume_to_end(bootstrap, topic, timeout=60)
        ids = {dict(m.headers() or []).get("outbox-id") for m in got}
        raw_got = consume_to_end(bootstrap, raw_topic, timeout=60)
        pending, n_dead = st["pending"], len(dead)
        lost = TOTAL - len(ids) - pending - n_dead
        print()
        print("                      kafka-outbox   plain producer")
        print(f"  produced            {TOTAL:>12}   {TOTAL:>14}")
        print(f"  in Kafka            {len(ids):>12}   {len(raw_got):>14}")
        print(f"  duplicates          {len(got) - len(ids):>12}   {'-':>14}")
        print(f"  still pending       {pending:>12}   {'-':>14}")
        print(f"  dead-lettered       {n_dead:>12}   {'-':>14}")
        print(f"  LOST                {lost:>12}   {TOTAL - len(raw_got):>14}")
        print()
        return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
