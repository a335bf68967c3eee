"""Outbox stores, chosen by URL."""

from __future__ import annotations

from ..urls import StoreURL, parse_url
from .base import Failure, Outbox
from .sqlite import SQLiteOutbox

__all__ = ["Failure", "Outbox", "SQLiteOutbox", "open_outbox"]


def open_outbox(target: str | StoreURL | Outbox, *, create: bool = True) -> Outbox:
    """Open the store a URL names (or return an `Outbox` given as is).

    Args:
        target: an outbox URL (see `outbox.urls`), a parsed `StoreURL`, or a store instance.
        create: create a missing SQLite file / missing PostgreSQL schema objects. The CLI passes
            False so that a mistyped path is reported instead of silently creating a new outbox.
    """
    if isinstance(target, Outbox):
        return target
    url = target if isinstance(target, StoreURL) else parse_url(target)
    if url.kind == "sqlite":
        return SQLiteOutbox(url.path, create=create)
    from .postgres import PostgresOutbox  # psycopg is an optional extra

    return PostgresOutbox(url, create=create)
