"""Summarize a chaos run's report (`$CHAOS_REPORT`, one JSON line per schedule).

    python -m tests.chaos.report chaos-report.jsonl

Producer schedules (tests/chaos/test_schedules.py) and consumer schedules
(tests/chaos/test_consumer_schedules.py, lines with ``"side": "consumer"``) are summed apart.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

from outbox.testing.schedule import Fault


def summarize(lines: list[dict]) -> str:  # type: ignore[type-arg]
    producer = [r for r in lines if r.get("side", "producer") == "producer" and not r.get("window")]
    window = [r for r in lines if r.get("window")]
    consumer = [r for r in lines if r.get("side") == "consumer"]
    parts = ([summarize_producer(producer)] if producer or not (consumer or window) else []) + (
        [summarize_window(window)] if window else []
    ) + ([summarize_consumer(consumer)] if consumer else [])
    return "\n".join(parts)


def summarize_window(lines: list[dict]) -> str:  # type: ignore[type-arg]
    """Schedules aimed at the documented window (one partition leaderless past message.timeout.ms)."""
    hit = [r for r in lines if r["reordered_keys"]]
    return (
        f"the documented window: {len(lines)} schedules, {sum(r['messages'] for r in lines)} messages: "
        f"{sum(r['lost'] for r in lines)} lost, keys reordered in {len(hit)} schedules"
        + (f" ({', '.join(str(r['reordered_keys']) for r in hit)} keys)" if hit else "")
    )


def fault_kinds(lines: list[dict]) -> str:  # type: ignore[type-arg]
    kinds: Counter[str] = Counter(f["kind"] for r in lines for f in r["schedule"])
    # A fault of the producing process (`Setup.process`) counts beside the cluster's.
    kinds.update(r["setup"]["process"] for r in lines if r["setup"].get("process", "none") != "none")
    return "faults by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))


def summarize_producer(lines: list[dict]) -> str:  # type: ignore[type-arg]
    dups: Counter[str] = Counter()
    msgs: Counter[str] = Counter()
    raw_dups: Counter[str] = Counter()
    raw_msgs: Counter[str] = Counter()
    for r in lines:
        for k in {f["kind"] for f in r["schedule"]}:
            dups[k] += r["duplicates"]
            msgs[k] += r["messages"]
            raw_dups[k] += r.get("raw_duplicates", 0)
            raw_msgs[k] += r.get("raw_messages", 0)
    counted = ("messages", "records", "lost", "reordered_keys", "duplicates", "without_id", "dead", "pending")
    total = {k: sum(r[k] for r in lines) for k in counted}
    out = [
        f"{len(lines)} schedules, {sum(len(r['schedule']) for r in lines)} faults, "
        f"{total['messages']} messages, {total['records']} records: "
        f"{total['lost']} lost, {total['reordered_keys']} reordered keys, {total['duplicates']} duplicates, "
        f"{total['without_id']} without outbox-id, {total['dead']} dead-lettered, {total['pending']} left pending",
        fault_kinds(lines),
        "duplicates in schedules with each kind (of their messages): "
        + ", ".join(f"{k} {dups[k]} of {msgs[k]} ({percent(dups[k], msgs[k])})" for k in sorted(dups)),
    ]
    if any("raw_messages" in r for r in lines):
        # The wrapper's own re-sends: its duplicate rate beyond the raw producer's beside it.
        out.append(
            "beside a raw producer with the same settings (its duplicates; the wrapper's excess): "
            + ", ".join(
                f"{k} {raw_dups[k]} of {raw_msgs[k]} ({percent(raw_dups[k], raw_msgs[k])}; "
                f"excess {100 * (dups[k] / max(1, msgs[k]) - raw_dups[k] / max(1, raw_msgs[k])):+.2f} points)"
                for k in sorted(raw_dups)
            )
        )
        raw_total = {k: sum(r.get("raw_" + k, 0) for r in lines) for k in ("messages", "lost", "reordered_keys")}
        out.append(
            f"the raw producer: {raw_total['messages']} messages, {raw_total['lost']} lost, "
            f"{raw_total['reordered_keys']} reordered keys"
        )
    # A producer in other processes (a process fault) has no circuit this process saw: None.
    single = [r for r in lines if r.get("one_broker_at_a_time") and r.get("circuit_opens") is not None]
    opened = sum(1 for r in single if r.get("circuit_opens"))
    out.append(f"circuit opened in {opened} of {len(single)} schedules that faulted one broker at a time")
    for r in single:
        if r.get("circuit_opens"):
            faults = "; ".join(str(Fault(**f)) for f in r["schedule"])
            why = "; ".join(r.get("circuit_reasons", [])) or "reason not recorded"
            out.append(f"  opened under [{faults}] {r['setup']}: {why}")
    return "\n".join(out)


def percent(part: int, whole: int) -> str:
    return f"{100 * part / max(1, whole):.2f} %"


def summarize_consumer(lines: list[dict]) -> str:  # type: ignore[type-arg]
    counted = ("messages", "effects", "missing", "twice", "reordered_keys", "unknown", "dlq", "lag", "failing",
               "retried", "parked", "duplicates_skipped", "topic_reordered_keys")
    t = {k: sum(r.get(k, 0) for r in lines) for k in counted}
    kills = sum(len(r["setup"]["kills"]) for r in lines)
    return "\n".join([
        f"consumer: {len(lines)} schedules, {sum(len(r['schedule']) for r in lines)} faults, {kills} consumer kills, "
        f"{t['messages']} messages ({t['failing']} failing at first), {t['effects']} effects: {t['missing']} missing, "
        f"{t['twice']} applied twice, {t['reordered_keys']} reordered keys, {t['unknown']} unknown, "
        f"{t['dlq']} dead-lettered, {t['lag']} left uncommitted",
        "consumer " + fault_kinds(lines),
        f"consumer work: {t['retried']} hops, {t['parked']} parkings ({t['parked'] / max(1, t['messages']):.1f} a "
        f"message), {t['duplicates_skipped']} copies skipped; keys reordered in the topic by the producer: "
        f"{t['topic_reordered_keys']}",
    ])


def main() -> None:
    with open(sys.argv[1]) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    print(summarize(lines))


if __name__ == "__main__":
    main()
