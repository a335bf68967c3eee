"""How a drain of pending rows is cut into waves (`spark_drain.read.id_waves`)."""

from __future__ import annotations

import itertools

import pytest

from outbox.errors import ConfigError
from spark_drain.options import JobOptions, parse_args
from spark_drain.read import id_waves


def test_waves_cover_the_id_range_once_in_order_each_twice_the_one_before() -> None:
    waves = id_waves(1, 1_000_000, 1_000_000, 50_000)
    assert waves == [(1, 50_000), (50_001, 150_000), (150_001, 350_000), (350_001, 750_000), (750_001, 1_000_000)]


def test_sparse_ids_are_cut_by_the_messages_they_are_taken_to_hold() -> None:
    # Half the ids are gone (delivered rows, group ids): 100,000 messages over 200,000 ids.
    waves = id_waves(1001, 201_000, 100_000, 10_000)
    assert waves[0] == (1001, 21_000)
    assert [b for _, b in waves][-1] == 201_000
    assert all(a == b + 1 for (_, b), (a, _) in itertools.pairwise(waves))


@pytest.mark.parametrize(("selected", "first"), [(100_000, 50_000), (1_000_000, 0), (10, 50_000)])
def test_a_small_selection_or_no_first_wave_is_one_wave(selected: int, first: int) -> None:
    assert id_waves(5, 5 + selected - 1, selected, first) == [(5, 5 + selected - 1)]


def test_first_wave_is_an_option_of_the_command_line() -> None:
    assert parse_args(["--outbox", "sqlite:///x.db", "-b", "k:9092"]).first_wave == 50_000
    assert parse_args(["--outbox", "sqlite:///x.db", "-b", "k:9092", "--first-wave", "0"]).first_wave == 0
    with pytest.raises(ConfigError, match="--first-wave must be 0 or more, got -1"):
        JobOptions(outbox="sqlite:///x.db", bootstrap_servers="k:9092", first_wave=-1)
