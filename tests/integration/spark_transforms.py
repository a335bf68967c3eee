"""`--transform` functions for tests/integration/test_spark_drain.py, imported by Spark's Python workers."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc


def route_odd_keys(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Messages of `fill()` (value b"k<key>:<seq>"): odd keys to "<topic>-odd", each value marked
    with a trailing "!", and k0's fifth message dropped. Returns only the columns it changes."""
    for b in batches:
        keys, values, topics = (b.column(c).to_pylist() for c in ("key", "value", "topic"))
        keep = pa.array([not (k == b"k0" and v == b"k0:5") for k, v in zip(keys, values, strict=True)])
        yield pa.RecordBatch.from_arrays(
            [
                b.column("id"),
                pa.array([f"{t}-odd" if int(k[1:]) % 2 else t for t, k in zip(topics, keys, strict=True)]),
                pa.array([v + b"!" for v in values], pa.binary()),
            ],
            names=["id", "topic", "value"],
        ).filter(keep)


def amounts_in_cents(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The JSON values' "amount" ("12.50") as whole cents (1250), with pandas."""
    for b in batches:
        df = b.select(["id", "value"]).to_pandas()

        def fix(raw: bytes) -> bytes:
            doc = json.loads(raw)
            doc["amount"] = round(float(doc["amount"]) * 100)
            return json.dumps(doc).encode()

        df["value"] = df["value"].map(fix)
        yield pa.RecordBatch.from_pandas(df, preserve_index=False)


def poison(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Fails on a value that contains "poison"; returns every other batch as it is."""
    for b in batches:
        for v in b.column("value").to_pylist():
            if v is not None and b"poison" in v:
                raise ValueError(f"cannot read {v.decode()!r}")
        yield b


def new_ids(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Returns its messages under other ids (not allowed)."""
    for b in batches:
        yield b.set_column(b.schema.get_field_index("id"), "id", pc.add(b.column("id"), 1_000_000))


def new_keys(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Gives every message the key b"other" (not allowed)."""
    for b in batches:
        yield b.set_column(b.schema.get_field_index("key"), "key", pa.array([b"other"] * b.num_rows, pa.binary()))


def exclaim(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Each value with a "!" appended: applied twice, a value would end in "!!"."""
    for b in batches:
        values = [None if v is None else v + b"!" for v in b.column("value").to_pylist()]
        yield pa.RecordBatch.from_arrays([b.column("id"), pa.array(values, pa.binary())], names=["id", "value"])
