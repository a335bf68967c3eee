"""`--transform` functions for benchmarks/bench_spark.py, imported by Spark's Python workers
(the benchmark puts this checkout on their PYTHONPATH)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

MARK = pa.scalar(b"!", pa.binary())
NO_SEPARATOR = pa.scalar(b"", pa.binary())


def mark_values(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Every value with a trailing "!", in one Arrow kernel per batch: the cost measured is the
    job's for a transform, not a Python loop's over the values. Returns only the columns it changes."""
    for b in batches:
        value = pc.binary_join_element_wise(b.column("value"), MARK, NO_SEPARATOR)
        yield pa.RecordBatch.from_arrays([b.column("id"), value], names=["id", "value"])
