"""The proxied cluster the fault schedules play on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox.testing import KafkaCluster
from outbox.testing.plugin import running_cluster


# One for the producer's and the consumer's schedules: starting three brokers again for the second
# module would only add to make test's time. Package scope: it stops once the schedules are done,
# not at the end of the session.
@pytest.fixture(scope="package")
def proxied_cluster(request: pytest.FixtureRequest) -> Iterator[KafkaCluster]:
    yield from running_cluster(request, KafkaCluster(brokers=3, proxied=True))


@pytest.fixture
def cluster(proxied_cluster: KafkaCluster) -> KafkaCluster:
    """The shared cluster, every broker up and every partition fully replicated, whatever the test
    before it left: a schedule starts from a healthy cluster."""
    proxied_cluster.wait_until_healthy()
    return proxied_cluster
