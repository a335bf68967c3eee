"""RetryInPlace's attempt count, kept in the metadata of the partition's committed offset.

A message retried in place is the partition's next uncommitted message, so the group's committed
offset for that partition is where its retry state belongs: it survives a crash, a restart and a
rebalance, and a new owner reads it with the offset it resumes from. It is committed synchronously
after each failed attempt; a crash between an attempt and that commit leaves that one attempt
uncounted (the only way the bound can be exceeded: by one attempt per such crash).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "outbox-in-place"


@dataclass(frozen=True, slots=True)
class InPlace:
    """A message retried in place: its offset, failed attempts so far, and when it first failed."""

    offset: int
    attempts: int
    first_failed_at: float  # epoch seconds

    def encode(self) -> str:
        """The commit metadata: ``outbox-in-place <offset> <attempts> <first failure, epoch ms>``."""
        return f"{PREFIX} {self.offset} {self.attempts} {int(self.first_failed_at * 1000)}"


def decode(metadata: str | None) -> InPlace | None:
    """The state in a committed offset's metadata, or None (none there, or not ours)."""
    if not metadata or not metadata.startswith(PREFIX + " "):
        return None
    try:
        offset, attempts, first_ms = (int(x) for x in metadata[len(PREFIX) + 1 :].split())
    except ValueError:
        return None
    return InPlace(offset, attempts, first_ms / 1000.0)
