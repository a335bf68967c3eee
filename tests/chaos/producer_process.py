"""A producing process of the fault schedules' process faults (`runner.run` with `Setup.process`).

``python -m tests.chaos.producer_process BOOTSTRAP URL TOPIC MODE DRAIN_IN SIZE THREADS PREFIX SECONDS FORK_AT``

Threads produce keyed messages through a `ResilientProducer` on the outbox `URL` for `SECONDS`
(< 0: until the process is stopped, by SIGTERM), and write one line per accepted message,
``ACCEPTED <key> <id>``, with one `os.write` (atomic on a pipe: lines of two processes never
mix, and a fork never inherits a lock of Python's buffered stdout). The keys are
``<PREFIX>w<thread>-k<n>``. A successor run with the same prefix continues the same keys.

`FORK_AT` >= 0: at that second the main thread forks. The child, as the error of a producer that
crossed a fork tells it, makes a producer of its own on the same outbox and produces keys of
its own (prefix ``fork-``) until `SECONDS`, then exits. The parent's threads go on throughout.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from outbox import ProducerForkedError, ResilientProducer

KEYS_PER_THREAD = 30
SMALL_BUDGET = 4 * 1024 * 1024
LARGE = 4096


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def produce(producer: ResilientProducer, topic: str, prefix: str, size: int, threads: int, until: float) -> None:
    pad = b"x" * size

    def work(w: int) -> None:
        i = 0
        while until < 0 or time.monotonic() < until:
            key = b"%sw%d-k%d" % (prefix.encode(), w, i % KEYS_PER_THREAD)
            msg_id = producer.produce(topic, pad, key=key)
            say(f"ACCEPTED {key.decode()} {msg_id}")
            i += 1
            time.sleep(0.0005)

    workers = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        while t.is_alive():  # joined in steps: SIGTERM's handler runs in the main thread
            t.join(0.1)


def main(argv: list[str]) -> int:
    bootstrap, url, topic, mode, drain_in, size_, threads_, prefix, seconds_, fork_at_ = argv
    size, threads, seconds, fork_at = int(size_), int(threads_), float(seconds_), float(fork_at_)

    def new_producer() -> ResilientProducer:
        return ResilientProducer(
            {"bootstrap.servers": bootstrap}, outbox=url, mode=mode, drain_in=drain_in,
            memory_budget=SMALL_BUDGET if size >= LARGE else 16 * 1024 * 1024,
        )

    producer = new_producer()
    started = time.monotonic()
    until = -1.0 if seconds < 0 else started + seconds
    if fork_at < 0:
        say("READY")
        produce(producer, topic, prefix, size, threads, until)
        return 0
    runner = threading.Thread(target=produce, args=(producer, topic, prefix, size, threads, until), daemon=True)
    runner.start()
    say("READY")
    time.sleep(fork_at)
    if os.fork() == 0:
        try:
            producer.produce(topic, b"crossed a fork", key=b"fork")
        except ProducerForkedError:
            pass
        else:
            say("ERROR the parent's producer accepted a message in the child")
            os._exit(3)
        child = new_producer()
        produce(child, topic, "fork-", size, threads, until)
        return 0  # a plain exit: the exit hook delivers or commits what the child's producer holds
    while runner.is_alive():
        runner.join(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
