"""The dead-letter console (`outbox ui`): pages and a JSON API over one outbox store.

Needs the `ui` extra: ``pip install 'kafka-outbox[ui]'`` (FastAPI, Jinja2, uvicorn). Only
`create_app` does: `outbox.ui.masking`, which the command line shares, imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.ui.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # Imported on first use (PEP 562), so that `outbox.ui.masking` needs no FastAPI.
    if name == "create_app":
        from outbox.ui.app import create_app

        return create_app
    raise AttributeError(f"module 'outbox.ui' has no attribute {name!r}")
