"""Outbox stores, chosen by URL."""

from __future__ import annotations

from outbox.stores.base import Capabilities, Failure, Outbox
from outbox.stores.encryption import KeyRing
from outbox.stores.memory import MemoryOutbox, open_memory
from outbox.stores.registry import backend
from outbox.stores.sqlite import SQLiteOutbox
from outbox.stores.urls import StoreURL, parse_url

__all__ = ["Capabilities", "Failure", "MemoryOutbox", "Outbox", "SQLiteOutbox", "open_outbox"]

#: The URL scheme of the memory store (`MemoryOutbox`): `memory://` or `memory://NAME`.
MEMORY_SCHEME = "memory:"


def open_outbox(target: str | StoreURL | Outbox, *, create: bool = True, encryption: KeyRing | None = None) -> Outbox:
    """Open the store a URL names (or return an `Outbox` given as is).

    Args:
        target: an outbox URL (see `outbox.stores.urls`; `memory://NAME` opens this process's memory
            store of that name, `outbox.stores.memory`), a parsed `StoreURL`, or a store instance.
        create: create a missing SQLite file / missing database tables. The CLI passes
            False so that a mistyped path is reported instead of silently creating a new outbox.
        encryption: the key ring that encrypts stored payloads (`Outbox.set_encryption`).
    """
    store = _open(target, create)
    if encryption is not None:
        try:
            store.set_encryption(encryption)
        except BaseException:
            if store is not target:
                store.close()
            raise
    return store


def _open(target: str | StoreURL | Outbox, create: bool) -> Outbox:
    if isinstance(target, Outbox):
        return target
    if isinstance(target, str) and target[: len(MEMORY_SCHEME)].lower() == MEMORY_SCHEME:
        return open_memory(target[len(MEMORY_SCHEME) :].lstrip("/"))
    url = target if isinstance(target, StoreURL) else parse_url(target)
    return backend(url.kind).open(url, create)
