"""The dead-letter console (`outbox ui`): pages and a JSON API over one outbox store.

Needs the `ui` extra: ``pip install 'kafka-outbox[ui]'`` (FastAPI, Jinja2, uvicorn).
"""

from __future__ import annotations

from outbox.ui.app import create_app

__all__ = ["create_app"]
