"""Random fault schedules on the consumer side, judged by the effect-log checker.

Each example draws a consumer setup (partitions, batch size, which messages fail and how often, when
the consumer process is killed with SIGKILL, the group's protocol: classic or KIP-848's) and a
schedule of faults as the producer's schedules do (tests/chaos/test_schedules.py). A
`ResilientConsumer(ordering="key", dedup=True)` in a process of its own handles a few thousand
messages of 40 keys while a `ResilientProducer` produces them and the schedule plays; about one in
ten fails once or twice and goes through the retry tiers. The handler writes each effect through
`tx`, in the transaction that marks the message handled. The process is killed part-way and a new
one resumes in the same group. Every run must apply every message's effect exactly once, in each
key's produce order, with nothing dead-lettered and the group's ladder committed to its end.

`make test` runs the fixed schedules below (the `@example`s); `make chaos` (`CHAOS_LONG=1`) draws
`CHAOS_EXAMPLES` more with random seeds and shrinking, and writes `$CHAOS_REPORT` lines for
`python -m tests.chaos.report`.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from outbox.testing import KafkaCluster
from outbox.testing.schedule import Fault

from ..group_protocols import PROTOCOLS
from .consumer_runner import ConsumerSetup, report, run
from .test_schedules import EXAMPLES, LONG, faults

setups = st.builds(
    ConsumerSetup,
    partitions=st.sampled_from([3, 6]),
    batch_size=st.sampled_from([20, 100, 500]),
    seed=st.integers(0, 2**16),
    kills=st.lists(st.floats(0.1, 0.9).map(lambda f: round(f, 2)), min_size=1, max_size=2).map(
        lambda ks: tuple(sorted(ks))
    ),
    protocol=st.sampled_from(PROTOCOLS),
)

schedules = st.lists(faults, min_size=1, max_size=3)
FIXED = 2  # the @examples below


# A run takes some 30 to 90 s: the consumer's start, 5 s of producing, the faults, a rebalance
# after each kill (the dead member's session times out), the retry tiers' delays, the read-back.
@pytest.mark.timeout(max(600, 180 * (EXAMPLES + FIXED if LONG else FIXED)))
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    print_blob=True,
    phases=[Phase.explicit] + ([Phase.reuse, Phase.generate, Phase.shrink] if LONG else []),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None if not LONG else settings.default.database,
)
@given(setup=setups, schedule=schedules)
# One broker killed, then every link slowed; the consumer killed a third of the way.
@example(
    setup=ConsumerSetup(partitions=6, messages=2000, batch_size=100, seed=1, kills=(0.35,)),
    schedule=[Fault("kill", 1, 1.0, 3.0), Fault("latency", None, 3.0, 2.0)],
)
# Every broker frozen while one's connections are reset; the consumer killed twice; KIP-848's protocol.
@example(
    setup=ConsumerSetup(partitions=3, messages=2000, batch_size=500, seed=2, kills=(0.25, 0.7), protocol="consumer"),
    schedule=[Fault("reset", 2, 0.5, 2.0), Fault("freeze", None, 2.0, 3.0)],
)
def test_a_random_fault_schedule_with_consumer_kills_applies_every_message_once_in_key_order(
    cluster: KafkaCluster, setup: ConsumerSetup, schedule: list[Fault]
) -> None:
    result = run(cluster, setup, schedule)
    report(result)
    h = result.handled
    assert h.missing == [], result.line()
    assert h.twice == {}, "\n".join([result.line(), f"applied more than once: {list(h.twice.items())[:5]}"])
    assert h.reordered == {}, "\n".join([result.line(), *h.first_inversions()])
    assert h.unknown == 0, result.line()
    assert result.dlq == 0 and result.lag == 0, result.line()
