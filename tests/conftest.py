"""Loads the test-bed plugin when the project is not pip-installed.

When installed, the ``pytest11`` entry point ``outbox`` has already registered it; nothing is done then.
"""

from __future__ import annotations

import pytest

import outbox.testing.plugin as _outbox_plugin


def pytest_configure(config: pytest.Config) -> None:
    pm = config.pluginmanager
    if not pm.is_registered(_outbox_plugin) and not pm.is_blocked("outbox"):
        pm.register(_outbox_plugin, "outbox")
