"""Command line of the test bed.

``python -m outbox.testing fetch``      download the Kafka jars and the JDBC drivers (once) and print where.
``python -m outbox.testing up [-n N]``  run a local cluster until Ctrl-C, printing its bootstrap servers.
``python -m outbox.testing postgres``   make sure of a PostgreSQL server for the tests and print its URL
                                        (an embedded one runs until Ctrl-C).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from outbox.testing.cluster import KAFKA_VERSION, KafkaCluster, KafkaSetupError, kafka_libs_dir
from outbox.testing.maven import JDBC, MavenFetchError, fetch
from outbox.testing.postgres import PostgresSetupError, embedded_running, ensure_server, redact, stop_server


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (its sub-commands are what the docs must list)."""
    parser = argparse.ArgumentParser(
        prog="python -m outbox.testing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "fetch", help=f"fetch Apache Kafka {KAFKA_VERSION} jars and the JDBC drivers (cached) and print where"
    )
    up = sub.add_parser("up", help="run a local Kafka cluster until interrupted")
    up.add_argument("-n", "--brokers", type=int, default=3)
    sub.add_parser("postgres", help="make sure of a PostgreSQL server for the tests and print its URL")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m outbox.testing``."""
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if args.cmd == "fetch":
            print(f"kafka: {kafka_libs_dir()}")
            print(f"jdbc: {fetch(JDBC)}")
            return 0
        if args.cmd == "postgres":
            url = ensure_server()
            print(f"postgres: {redact(url)}", flush=True)
            if embedded_running():
                print("(embedded server from the wheel; Ctrl-C stops it)", flush=True)
                try:
                    while True:
                        time.sleep(3600)
                finally:
                    stop_server()
            return 0
        with KafkaCluster(brokers=args.brokers) as cluster:
            print(f"bootstrap.servers={cluster.bootstrap_servers}", flush=True)
            print(f"logs: {cluster.log_dir}  (Ctrl-C to stop)", flush=True)
            while True:
                time.sleep(3600)
    except (KafkaSetupError, MavenFetchError, PostgresSetupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
