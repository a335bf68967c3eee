"""Cost of the ecosystem integrations on the happy path, against a real broker.

Standalone (not collected by pytest):

    python benchmarks/bench_ecosystem.py                    # 100,000 messages, 5 interleaved reps
    python benchmarks/bench_ecosystem.py --messages 30000 --reps 3 --variants plain,metrics
    KAFKA_BOOTSTRAP_SERVERS=host:9092 python benchmarks/bench_ecosystem.py

Variants, each in its own child process, repetitions interleaved (plain, metrics, ..., plain, ...):
    plain     ResilientProducer (fallback mode), produce() in a tight loop, 200-byte values.
    metrics-idle  the same with outbox.metrics.register_producer() and prometheus-client's HTTP
              server running, not scraped during the run (Prometheus' usual 15 s interval is
              longer than a run).
    metrics   the same, scraped over HTTP every 100 ms during the run (150x the usual rate, so
              that the scrapes' own cost shows).
    otel-outbox  outbox.otel.instrument(spans_on_produce=False) with an SDK TracerProvider: only
              the outbox's spans (spill, deliver, dead-letter), none of which occur on the happy path.
    otel      instrument() with its default `send` span per produce() and the SDK recording it
              (no exporter): what a span per message costs.
    async     AsyncResilientProducer: batches of 1,000 `await produce()` gathered at a time.
    serialize the same as plain with value_serializer=StringSerializer() (values given as str).
A run is N messages produced, then waiting until stats() says all N were delivered. Reported:
median msgs/s, ratio to `plain` from the same run, and CPU µs per message (process CPU, all
threads), which is steadier than msgs/s on a shared machine. Uses only the public API.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("plain", "metrics-idle", "metrics", "otel-outbox", "otel", "async", "serialize")
CONFIG = {"acks": "all", "enable.idempotence": True, "linger.ms": 5}


# -- child side ------------------------------------------------------------------------------


def _wait_delivered(stats: Any, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while stats()["delivered"] < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {stats()['delivered']} of {n} delivered after {timeout}s")
        time.sleep(0.002)


def child(variant: str, p: dict[str, Any]) -> dict[str, Any]:
    from outbox import ResilientProducer

    n, topic = int(p["n"]), p["topic"]
    value: Any = os.urandom(100).hex() if variant == "serialize" else os.urandom(200)
    config = {"bootstrap.servers": p["bootstrap"], **CONFIG}
    outbox = f"sqlite:///{p['workdir']}/{variant}-{os.getpid()}.db"
    extra: dict[str, Any] = {}
    if variant == "serialize":
        from confluent_kafka.serialization import StringSerializer

        extra["value_serializer"] = StringSerializer()
    if variant.startswith("otel"):
        from opentelemetry.sdk.trace import TracerProvider

        from outbox.otel import instrument

        extra["tracer_provider"] = TracerProvider()  # spans recorded, then dropped: no exporter
    scrapes = 0
    stop = threading.Event()
    if variant == "async":
        from outbox.producer.aio import AsyncResilientProducer

        async def run() -> tuple[float, float]:
            ap = AsyncResilientProducer(config, outbox=outbox)
            ap.producer.produce(topic, b"warm-up")
            _wait_delivered(ap.producer.stats, 1)
            c0, t0 = sum(os.times()[:2]), time.perf_counter()
            for start in range(0, n, 1000):
                await asyncio.gather(*(ap.produce(topic, value) for _ in range(min(1000, n - start))))
            await ap.flush()
            _wait_delivered(ap.producer.stats, n + 1)
            return time.perf_counter() - t0, sum(os.times()[:2]) - c0

        seconds, cpu = asyncio.run(run())
    else:
        rp = ResilientProducer(config, outbox=outbox, **{k: v for k, v in extra.items() if k != "tracer_provider"})
        if variant.startswith("otel"):
            instrument(rp, tracer_provider=extra["tracer_provider"], spans_on_produce=variant == "otel")
        if variant.startswith("metrics"):
            from prometheus_client import CollectorRegistry, start_http_server

            from outbox.metrics import register_producer

            registry = CollectorRegistry(auto_describe=True)
            register_producer(rp, registry=registry)
            server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
            url = f"http://127.0.0.1:{server.server_port}/metrics"

            def scraper() -> None:
                nonlocal scrapes
                while not stop.wait(0.1):
                    with urllib.request.urlopen(url, timeout=10) as resp:
                        resp.read()
                    scrapes += 1

            if variant == "metrics":
                threading.Thread(target=scraper, daemon=True).start()
        rp.produce(topic, value)  # warm-up: metadata and connections, as in benchmarks/
        _wait_delivered(rp.stats, 1)
        produce = rp.produce
        c0, t0 = sum(os.times()[:2]), time.perf_counter()
        for _ in range(n):
            produce(topic, value)
        rp.flush(300)
        _wait_delivered(rp.stats, n + 1)
        seconds, cpu = time.perf_counter() - t0, sum(os.times()[:2]) - c0
        stop.set()
    return {"msgs_per_s": n / seconds, "cpu_us_per_msg": cpu / n * 1e6, "scrapes": scrapes}


# -- parent side -----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        out = child(args.child[0], json.loads(args.child[1]))
        sys.stdout.write("RESULT " + json.dumps(out) + "\n")
        sys.stdout.flush()
        os._exit(0)  # producer teardown is not measured
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if "plain" not in variants:
        variants.insert(0, "plain")

    from outbox.testing import KafkaCluster, create_topic

    cluster = None
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        cluster = KafkaCluster(brokers=1)
        cluster.start()
        bootstrap = cluster.bootstrap_servers
    try:
        topic = create_topic(bootstrap, f"bench-eco-{os.getpid()}", 3, 1)
        with tempfile.TemporaryDirectory(prefix="bench-eco-") as workdir:
            params = {"bootstrap": bootstrap, "topic": topic, "n": args.messages, "workdir": workdir}
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
            for rep in range(args.reps):
                for v in variants:
                    proc = subprocess.run(
                        [sys.executable, __file__, "--child", v, json.dumps(params)],
                        capture_output=True, text=True, timeout=900, check=False,
                    )
                    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                    if line is None:
                        raise SystemExit(f"{v} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                    runs[v].append(json.loads(line[7:]))
                    print(f"rep {rep + 1} {v:12s} {runs[v][-1]['msgs_per_s']:>9.0f} msgs/s", file=sys.stderr)
    finally:
        if cluster is not None:
            cluster.close()
    base = statistics.median(r["msgs_per_s"] for r in runs["plain"])
    base_cpu = statistics.median(r["cpu_us_per_msg"] for r in runs["plain"])
    print(f"\n{args.messages} messages x {args.reps} interleaved reps, 200 B, 1 broker, load {os.getloadavg()[0]:.1f}")
    print(f"{'variant':12s} {'msgs/s':>9s} {'ratio':>6s} {'CPU µs/msg':>11s} {'CPU ratio':>9s}  per-rep ratios")
    for v in variants:
        rate = statistics.median(r["msgs_per_s"] for r in runs[v])
        cpu = statistics.median(r["cpu_us_per_msg"] for r in runs[v])
        pairs = zip(runs[v], runs["plain"], strict=True)
        per_rep = " ".join(f"{r['msgs_per_s'] / b['msgs_per_s']:.2f}" for r, b in pairs)
        extra = f"  scrapes/run {statistics.median(r['scrapes'] for r in runs[v]):.0f}" if v == "metrics" else ""
        print(f"{v:12s} {rate:>9.0f} {rate / base:>6.3f} {cpu:>11.2f} {cpu / base_cpu:>9.3f}  {per_rep}{extra}")


if __name__ == "__main__":
    main()
