"""Per-key order through the real send fence, in simulated schedules (`tests.unit.ordersim`).

100,000 seeded schedules of 60 steps each must keep every key's first copies in produce order
and lose nothing. Each order rule the model names, removed, must turn a schedule red: that is
what shows the schedules reach the interleavings the rule is there for.
"""

from __future__ import annotations

import os

import pytest

from tests.unit.ordersim import Rules, run

SCHEDULES = int(os.environ.get("ORDER_SIM_SCHEDULES", "100000"))
STEPS = 60


def test_random_schedules_keep_each_keys_order_and_lose_nothing() -> None:
    produced = delivered = purges = 0
    for seed in range(SCHEDULES):
        sim = run(seed, STEPS)
        produced += len(sim.produced)
        delivered += len(sim.first)
        purges += sim.purges
    assert produced == delivered > SCHEDULES  # every accepted message reached the topic
    assert purges > SCHEDULES // 2  # the schedules hand messages back, not only deliver them


def first_failing(rules: Rules, limit: int = 5000) -> int | None:
    for seed in range(limit):
        try:
            run(seed, STEPS, rules)
        except AssertionError:
            return seed
    return None


@pytest.mark.parametrize(
    "rule",
    [
        "in_flight_before_armed",
        "hold_pending_keys",
        "release_only_when_empty",
        "store_keys_handed_back",
        "purge_stragglers",
        "note_purges",
    ],
)
def test_each_rule_removed_turns_a_schedule_red(rule: str) -> None:
    assert first_failing(Rules(**{rule: False})) is not None, f"no schedule needs {rule}"


def test_a_failing_schedule_names_its_seed_and_replays() -> None:
    rules = Rules(purge_stragglers=False)
    seed = first_failing(rules)
    assert seed is not None
    with pytest.raises(AssertionError, match=f"seed {seed}: key b'k[0-9]': [0-9a-f]+ reached Kafka after"):
        run(seed, STEPS, rules)
    with pytest.raises(AssertionError, match=f"seed {seed}:"):
        run(seed, STEPS, rules)  # the same seed, the same schedule
