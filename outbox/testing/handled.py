"""One checker of what a consumer's handler did: its effect log against what was produced.

A handler that records each effect durably (with `ResilientConsumer(dedup=True)` and a handler
``handler(msg, tx)``, a row written through `tx`, in the transaction that marks the message
handled) leaves a log of effects in the order they committed. `check_handled` judges that log
against the messages produced, each key's in produce order, and returns a `Handled`:

- **missing**: produced messages with no effect;
- **twice**: messages whose effect was applied more than once (with how many times);
- **reordered keys**: keys whose first effects are not in produce order;
- **unknown**: effects of messages never produced.

It is a pure function of the two lists: the effect log is read by the caller, however it is kept.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Handled", "check_handled"]


@dataclass
class Handled:
    """What `check_handled` found; `ok` when nothing is missing, applied twice, reordered or unknown."""

    messages: int
    effects: int
    missing: list[str] = field(default_factory=list)
    twice: dict[str, int] = field(default_factory=dict)
    #: Reordered keys: their messages' ids in the order of their first effects.
    reordered: dict[bytes | None, list[str]] = field(default_factory=dict)
    unknown: int = 0
    #: Of reordered keys' messages: the position in its key's produce order.
    produced: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.twice and not self.reordered and not self.unknown

    def summary(self) -> str:
        """One line: messages, effects, missing, applied twice, reordered keys, unknown."""
        return (
            f"{self.messages} messages, {self.effects} effects: {len(self.missing)} missing, "
            f"{len(self.twice)} applied twice, {len(self.reordered)} reordered keys, {self.unknown} unknown"
        )

    def first_inversions(self, most: int = 3) -> list[str]:
        """A few reordered keys with the ids around their first inversion, for a failure message."""
        out = []
        for key, ids in list(self.reordered.items())[:most]:
            n = next(n for n in range(len(ids) - 1) if self.produced[ids[n]] > self.produced[ids[n + 1]])
            late, early = ids[n], ids[n + 1]
            out.append(
                f"{key!r}: {late} (produced #{self.produced[late]}) took effect before {early} "
                f"(produced #{self.produced[early]}); in all: {ids[:12]}{' ...' if len(ids) > 12 else ''}"
            )
        return out


def check_handled(produced: Iterable[tuple[bytes | None, str]], effects: Iterable[str]) -> Handled:
    """Judge an effect log.

    Args:
        produced: (key, message id) of every message produced; a key's messages in produce order.
            A key of None has no order.
        effects: the message id of each effect, in the order the effects were applied (committed).
    """
    order: dict[bytes | None, list[str]] = defaultdict(list)
    key_of: dict[str, bytes | None] = {}
    for key, msg_id in produced:
        order[key].append(msg_id)
        key_of[msg_id] = key
    applied: Counter[str] = Counter()
    first: list[str] = []  # ids in the order of their first effect
    for msg_id in effects:
        if applied[msg_id] == 0:
            first.append(msg_id)
        applied[msg_id] += 1
    verdict = Handled(len(key_of), sum(applied.values()))
    verdict.missing = [i for i in key_of if not applied[i]]
    verdict.twice = {i: n for i, n in applied.items() if n > 1}
    verdict.unknown = sum(n for i, n in applied.items() if i not in key_of)
    taken: dict[bytes | None, list[str]] = defaultdict(list)
    for msg_id in first:
        if msg_id in key_of:
            taken[key_of[msg_id]].append(msg_id)
    for key, ids in order.items():
        if key is None:
            continue
        position = {i: n for n, i in enumerate(ids)}
        got = [position[i] for i in taken[key]]
        if got != sorted(got):
            verdict.reordered[key] = taken[key]
            verdict.produced.update(position)
    return verdict
