"""Benchmarks of kafka-outbox against the raw producer and the naive durable approach.

Run ``python -m benchmarks --help``. Every scenario runs in a fresh child process
(``python -m benchmarks.scenarios NAME PARAMS``) so its peak RSS is its own; the parent
(``benchmarks.__main__``) owns the Kafka cluster, interleaves repetitions, takes medians,
prints the table and writes ``benchmarks/results/<date>.json``.
"""
