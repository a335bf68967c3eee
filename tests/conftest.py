"""The project's own tests opt in to the test-bed plugin (it is not registered on install), and
none of them may be skipped: a missing service, build feature or broker is a failure."""

from __future__ import annotations

import os

# Before anything imports the SDK: every lock of the producer and the drain checks the one lock
# order (`outbox.lockorder`), in this process and in the processes the tests start.
os.environ.setdefault("OUTBOX_CHECK_LOCK_ORDER", "1")

from collections.abc import Generator
from typing import Any

import pytest

from .group_protocols import PROTOCOLS

pytest_plugins = ["outbox.testing.plugin"]


@pytest.fixture(params=PROTOCOLS)
def group_protocol(request: pytest.FixtureRequest) -> str:
    """Each consumer-group test that takes it runs twice: on the classic protocol and on KIP-848's
    group.protocol=consumer (`tests.group_protocols.group_settings` gives the group's settings)."""
    return str(request.param)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    """A skip becomes a failure that names its reason. The copied confluent-kafka tests keep
    upstream's `pytest.skip` calls (missing headers support, AvroProducer, a broker); here each
    would hide a test that did not run."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, which the suite does not allow: {reason}"


_seconds_by_module: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Adds each phase's time (setup, call, teardown) to its module: a module's share of the suite
    includes the services its fixtures start."""
    module = report.nodeid.split("::", 1)[0]
    _seconds_by_module[module] = _seconds_by_module.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The ten slowest modules, so a run's length can be read from its own log."""
    slowest = sorted(_seconds_by_module.items(), key=lambda item: item[1], reverse=True)[:10]
    if not slowest:
        return
    terminalreporter.section("slowest modules")
    total = sum(_seconds_by_module.values())
    for module, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f} %  {module}")
    terminalreporter.write_line(f"{total:8.1f} s  all {len(_seconds_by_module)} modules")
