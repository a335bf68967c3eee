"""Which offset of each partition may be committed: only past messages whose fate is durable.

A message is done when it was handled, ignored, or its dead letter was stored; it is *waiting*
while its retry hop (or DLQ-topic publish) is neither acknowledged by Kafka nor committed to the
outbox. A partition's committable offset is its lowest waiting offset, or the offset after the
last processed message. Used by the poll-loop thread only.
"""

from __future__ import annotations

from collections.abc import Iterable

TP = tuple[str, int]


class OffsetTracker:
    """Per-partition progress and the hops each offset waits for."""

    def __init__(self) -> None:
        self._position: dict[TP, int] = {}
        self._waiting: dict[TP, dict[int, int]] = {}  # tp → offset → hops not yet durable
        self._owner: dict[int, tuple[TP, int]] = {}  # hop token → (tp, offset)
        self._dirty: set[TP] = set()
        self._committed: dict[TP, int] = {}

    def done(self, tp: TP, offset: int) -> None:
        """The message at `offset` (and every earlier one not waiting) needs nothing more."""
        if self._position.get(tp, -1) <= offset:
            self._position[tp] = offset + 1
            self._dirty.add(tp)

    def rewind(self, tp: TP, offset: int) -> None:
        """The messages from `offset` on are to be processed again (their outcome was lost)."""
        if self._position.get(tp, offset) > offset:
            self._position[tp] = offset
            self._dirty.add(tp)

    def wait(self, tp: TP, offset: int, token: int) -> None:
        """The message at `offset` is done once hop `token` is durable."""
        if self._position.get(tp, -1) <= offset:
            self._position[tp] = offset + 1
        w = self._waiting.setdefault(tp, {})
        w[offset] = w.get(offset, 0) + 1
        self._owner[token] = (tp, offset)
        self._dirty.add(tp)

    def resolve(self, token: int) -> None:
        """Hop `token` is durable (unknown tokens, e.g. of revoked partitions, are ignored)."""
        owner = self._owner.pop(token, None)
        if owner is None:
            return
        tp, offset = owner
        w = self._waiting.get(tp)
        if w is None or offset not in w:
            return
        w[offset] -= 1
        if w[offset] == 0:
            del w[offset]
        self._dirty.add(tp)

    def resolve_all(self, tokens: Iterable[int] | None = None) -> None:
        """Every hop (or the given ones) is durable."""
        for token in list(self._owner if tokens is None else tokens):
            self.resolve(token)

    @property
    def waiting_hops(self) -> int:
        return len(self._owner)

    def committable(self) -> list[tuple[TP, int]]:
        """Partitions whose committable offset moved since the last call, with that offset."""
        out: list[tuple[TP, int]] = []
        for tp in self._dirty:
            pos = self._position.get(tp)
            if pos is None:
                continue
            w = self._waiting.get(tp)
            offset = min(w) if w else pos
            if self._committed.get(tp) != offset:
                self._committed[tp] = offset
                out.append((tp, offset))
        self._dirty.clear()
        return out

    def committable_of(self, tp: TP) -> int | None:
        """The offset `tp` could be committed at now (None: nothing processed on it yet)."""
        pos = self._position.get(tp)
        if pos is None:
            return None
        w = self._waiting.get(tp)
        return min(w) if w else pos

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop revoked partitions: their hops' results no longer matter to this consumer."""
        for tp in tps:
            self._position.pop(tp, None)
            self._committed.pop(tp, None)
            self._dirty.discard(tp)
            self._waiting.pop(tp, None)
        self._owner = {t: o for t, o in self._owner.items() if o[0] in self._waiting}
