"""Command line of the test bed.

``python -m outbox.testing fetch``   download Kafka jars (once) and print their directory.
``python -m outbox.testing up [-n N]``  run a local cluster until Ctrl-C, printing its bootstrap servers.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from outbox.testing.cluster import KAFKA_VERSION, KafkaCluster, KafkaSetupError, kafka_libs_dir


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m outbox.testing``."""
    parser = argparse.ArgumentParser(
        prog="python -m outbox.testing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "fetch", help=f"fetch Apache Kafka {KAFKA_VERSION} jars (cached) and print their directory"
    )
    up = sub.add_parser("up", help="run a local Kafka cluster until interrupted")
    up.add_argument("-n", "--brokers", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "fetch":
            print(kafka_libs_dir())
            return 0
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with KafkaCluster(brokers=args.brokers) as cluster:
            print(f"bootstrap.servers={cluster.bootstrap_servers}", flush=True)
            print(f"logs: {cluster.log_dir}  (Ctrl-C to stop)", flush=True)
            while True:
                time.sleep(3600)
    except KafkaSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
