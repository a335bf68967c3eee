"""Summarize a chaos run's report (`$CHAOS_REPORT`, one JSON line per schedule).

    python -m tests.chaos.report chaos-report.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import Counter


def summarize(lines: list[dict]) -> str:  # type: ignore[type-arg]
    kinds: Counter[str] = Counter()
    dups: Counter[str] = Counter()
    msgs: Counter[str] = Counter()
    for r in lines:
        for f in r["schedule"]:
            kinds[f["kind"]] += 1
        for k in {f["kind"] for f in r["schedule"]}:
            dups[k] += r["duplicates"]
            msgs[k] += r["messages"]
    counted = ("messages", "records", "lost", "reordered_keys", "duplicates", "without_id", "dead", "pending")
    total = {k: sum(r[k] for r in lines) for k in counted}
    out = [
        f"{len(lines)} schedules, {sum(kinds.values())} faults, "
        f"{total['messages']} messages, {total['records']} records: "
        f"{total['lost']} lost, {total['reordered_keys']} reordered keys, {total['duplicates']} duplicates, "
        f"{total['without_id']} without outbox-id, {total['dead']} dead-lettered, {total['pending']} left pending",
        "faults by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())),
        "duplicates in schedules with each kind (of their messages): "
        + ", ".join(f"{k} {dups[k]} of {msgs[k]} ({100 * dups[k] / max(1, msgs[k]):.2f} %)" for k in sorted(dups)),
    ]
    single = [r for r in lines if r.get("one_broker_at_a_time")]
    opened = sum(1 for r in single if r.get("circuit_opens"))
    out.append(f"circuit opened in {opened} of {len(single)} schedules that faulted one broker at a time")
    return "\n".join(out)


def main() -> None:
    with open(sys.argv[1]) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    print(summarize(lines))


if __name__ == "__main__":
    main()
