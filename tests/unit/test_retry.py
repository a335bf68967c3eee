"""RetryPolicy: delays, stop rules, validation, and the librdkafka error classification table.

`decide()` takes the times as arguments, so no clock is needed: every test passes explicit
epoch seconds.
"""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError
from tenacity import stop_after_attempt, stop_after_delay, wait_exponential, wait_fixed

from outbox.errors import ConfigError
from outbox.retry import (
    FATAL_CODES,
    PERMANENT_CODES,
    RETRIABLE_CODES,
    Disposition,
    RetryDecision,
    RetryPolicy,
    describe,
    error_name,
    refused,
)

E = KafkaError
T0 = 1_700_000_000.0  # an arbitrary "first failure" time, epoch seconds


def delays(policy: RetryPolicy, n: int) -> list[float]:
    """The delays after failed sends 1..n (each one must not give up)."""
    out = []
    for attempt in range(1, n + 1):
        d = policy.decide(attempt, T0, T0 + attempt)
        assert not d.give_up, f"gave up after attempt {attempt}"
        out.append(d.delay)
    return out


# -- defaults and backoff ----------------------------------------------------------------------


def test_defaults_are_three_attempts_fixed_three_seconds() -> None:
    p = RetryPolicy()
    assert (p.max_attempts, p.backoff, p.initial_delay, p.jitter) == (3, "fixed", 3.0, 0.0)
    assert p.decide(1, T0, T0) == RetryDecision(give_up=False, delay=3.0)
    assert p.decide(2, T0, T0 + 3) == RetryDecision(give_up=False, delay=3.0)
    # The third failed send is the last one: dead-lettered, however little time passed.
    assert p.decide(3, T0, T0 + 6).give_up
    assert p.decide(4, T0, T0 + 9).give_up


def test_max_attempts_one_gives_up_on_the_first_failure() -> None:
    assert RetryPolicy(max_attempts=1).decide(1, T0, T0).give_up


def test_fixed_backoff_uses_initial_delay() -> None:
    assert delays(RetryPolicy(max_attempts=6, initial_delay=0.5), 5) == [0.5] * 5


def test_exponential_sequence_grows_by_multiplier_up_to_max_delay() -> None:
    p = RetryPolicy(max_attempts=10, backoff="exponential", initial_delay=1.0, multiplier=3.0, max_delay=50.0)
    assert delays(p, 9) == [1.0, 3.0, 9.0, 27.0, 50.0, 50.0, 50.0, 50.0, 50.0]
    assert p.decide(10, T0, T0 + 100).give_up


def test_exponential_default_multiplier_doubles() -> None:
    p = RetryPolicy(max_attempts=6, backoff="exponential", initial_delay=0.25)
    assert delays(p, 5) == [0.25, 0.5, 1.0, 2.0, 4.0]


def test_exponential_huge_attempt_number_stays_capped() -> None:
    # Replayed/long-lived rows can carry large attempt counts: no OverflowError, just the cap.
    p = RetryPolicy(max_attempts=10_000, backoff="exponential", initial_delay=1.0, max_delay=60.0)
    assert p.decide(5_000, T0, T0).delay == 60.0


@pytest.mark.parametrize("backoff", ["fixed", "exponential"])
def test_jitter_stays_within_bounds(backoff: str) -> None:
    p = RetryPolicy(max_attempts=100, backoff=backoff, initial_delay=2.0, multiplier=2.0, max_delay=16.0, jitter=0.5)
    base = RetryPolicy(max_attempts=100, backoff=backoff, initial_delay=2.0, multiplier=2.0, max_delay=16.0)
    seen: set[float] = set()
    for attempt in range(1, 8):
        d = base.decide(attempt, T0, T0).delay
        for _ in range(200):
            j = p.decide(attempt, T0, T0).delay
            assert d <= j <= d * 1.5
            seen.add(j)
    # Jitter actually varies the delay (200 draws of random() being all equal is impossible).
    assert len(seen) > 7


def test_jitter_one_at_most_doubles() -> None:
    p = RetryPolicy(max_attempts=5, initial_delay=4.0, jitter=1.0)
    for _ in range(200):
        assert 4.0 <= p.decide(1, T0, T0).delay <= 8.0


# -- tenacity strategies -----------------------------------------------------------------------


def test_tenacity_stop_after_attempt_replaces_max_attempts() -> None:
    p = RetryPolicy(max_attempts=2, stop=stop_after_attempt(5))
    assert delays(p, 4) == [3.0] * 4
    assert p.decide(5, T0, T0).give_up


def test_tenacity_stop_after_delay_counts_from_first_failure() -> None:
    p = RetryPolicy(stop=stop_after_delay(3600))
    # Attempt numbers do not matter to a delay-based stop: 50 failures within the hour go on.
    assert not p.decide(50, T0, T0 + 3599).give_up
    assert p.decide(2, T0, T0 + 3600).give_up
    assert p.decide(2, T0, T0 + 7200).give_up


def test_tenacity_stop_combination_gives_up_on_either() -> None:
    p = RetryPolicy(stop=stop_after_delay(3600) | stop_after_attempt(10))
    assert not p.decide(9, T0, T0 + 100).give_up
    assert p.decide(10, T0, T0 + 100).give_up  # attempts exhausted first
    assert p.decide(2, T0, T0 + 3600).give_up  # time exhausted first


def test_tenacity_stop_and_combination_needs_both() -> None:
    p = RetryPolicy(stop=stop_after_delay(60) & stop_after_attempt(3))
    assert not p.decide(5, T0, T0 + 10).give_up
    assert not p.decide(2, T0, T0 + 100).give_up
    assert p.decide(3, T0, T0 + 60).give_up


def test_max_attempts_zero_is_allowed_when_stop_is_given() -> None:
    p = RetryPolicy(max_attempts=0, stop=stop_after_attempt(2))
    assert not p.decide(1, T0, T0).give_up
    assert p.decide(2, T0, T0).give_up


def test_tenacity_wait_fixed_replaces_backoff() -> None:
    p = RetryPolicy(max_attempts=5, backoff="exponential", initial_delay=100.0, wait=wait_fixed(7))
    assert delays(p, 4) == [7.0] * 4


def test_tenacity_wait_exponential() -> None:
    p = RetryPolicy(max_attempts=8, wait=wait_exponential(multiplier=1, min=2, max=20))
    assert delays(p, 7) == [2.0, 2.0, 4.0, 8.0, 16.0, 20.0, 20.0]


def test_tenacity_wait_sum_and_jitter_on_top() -> None:
    p = RetryPolicy(max_attempts=4, wait=wait_fixed(1) + wait_fixed(2), jitter=0.1)
    for _ in range(50):
        assert 3.0 <= p.decide(1, T0, T0).delay <= 3.3


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"backoff": "linear"}, "backoff must be 'fixed' or 'exponential', got 'linear'"),
        ({"backoff": ""}, "backoff must be 'fixed' or 'exponential'"),
        ({"jitter": 1.5}, "jitter is a fraction between 0 and 1, got 1.5"),
        ({"jitter": -0.1}, "jitter is a fraction between 0 and 1, got -0.1"),
        ({"jitter": float("nan")}, "jitter is a fraction between 0 and 1"),
        ({"max_attempts": 0}, "max_attempts must be at least 1, got 0"),
        ({"max_attempts": -3}, "max_attempts must be at least 1, got -3"),
        ({"initial_delay": -1.0}, "delays must be >= 0"),
        ({"max_delay": -1.0}, "delays must be >= 0"),
        ({"multiplier": 0.5}, "multiplier >= 1"),
    ],
)
def test_invalid_settings_raise_config_error(kwargs: dict[str, object], text: str) -> None:
    with pytest.raises(ConfigError) as info:
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
    assert text in str(info.value)
    # ConfigError is also a ValueError, so generic callers catch it too.
    assert isinstance(info.value, ValueError)


# -- classification ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (E.NOT_ENOUGH_REPLICAS, Disposition.RETRY),
        (E._MSG_TIMED_OUT, Disposition.RETRY),
        (E._TRANSPORT, Disposition.RETRY),
        (E._ALL_BROKERS_DOWN, Disposition.RETRY),
        (E._QUEUE_FULL, Disposition.RETRY),
        (E._PURGE_QUEUE, Disposition.RETRY),
        (E.LEADER_NOT_AVAILABLE, Disposition.RETRY),
        (E.NOT_LEADER_FOR_PARTITION, Disposition.RETRY),
        (E.MSG_SIZE_TOO_LARGE, Disposition.DEAD),
        (E.TOPIC_AUTHORIZATION_FAILED, Disposition.DEAD),
        (E.INVALID_RECORD, Disposition.DEAD),
        (E._FATAL, Disposition.FATAL),
        (E.OUT_OF_ORDER_SEQUENCE_NUMBER, Disposition.FATAL),
        (E.PRODUCER_FENCED, Disposition.FATAL),
    ],
)
def test_classify_table(code: int, expected: Disposition) -> None:
    assert RetryPolicy().classify(code) is expected


def test_unknown_code_is_retried_but_bounded_by_attempts() -> None:
    unknown = 31337
    assert unknown not in RETRIABLE_CODES | PERMANENT_CODES | FATAL_CODES
    p = RetryPolicy(max_attempts=3)
    assert p.classify(unknown) is Disposition.RETRY
    assert p.decide(3, T0, T0).give_up


def test_code_sets_are_disjoint_and_nonempty() -> None:
    assert RETRIABLE_CODES and PERMANENT_CODES and FATAL_CODES
    assert not RETRIABLE_CODES & PERMANENT_CODES
    assert not RETRIABLE_CODES & FATAL_CODES
    assert not PERMANENT_CODES & FATAL_CODES


def test_every_table_code_classifies_as_its_set() -> None:
    p = RetryPolicy()
    assert {p.classify(c) for c in RETRIABLE_CODES} == {Disposition.RETRY}
    assert {p.classify(c) for c in PERMANENT_CODES} == {Disposition.DEAD}
    assert {p.classify(c) for c in FATAL_CODES} == {Disposition.FATAL}


def test_retry_codes_override_the_table() -> None:
    p = RetryPolicy(retry_codes=[E.TOPIC_AUTHORIZATION_FAILED, 4242])
    # e.g. ACLs granted by an operator later: worth retrying.
    assert p.classify(E.TOPIC_AUTHORIZATION_FAILED) is Disposition.RETRY
    assert p.classify(4242) is Disposition.RETRY
    assert p.classify(E.MSG_SIZE_TOO_LARGE) is Disposition.DEAD  # others unchanged


def test_dead_letter_codes_override_the_table() -> None:
    p = RetryPolicy(dead_letter_codes=(E.UNKNOWN_TOPIC_OR_PART,))
    assert p.classify(E.UNKNOWN_TOPIC_OR_PART) is Disposition.DEAD
    assert p.classify(E._MSG_TIMED_OUT) is Disposition.RETRY


def test_dead_letter_codes_win_over_retry_codes() -> None:
    p = RetryPolicy(retry_codes=[E._TRANSPORT], dead_letter_codes=[E._TRANSPORT])
    assert p.classify(E._TRANSPORT) is Disposition.DEAD


def test_retry_codes_accept_a_generator_once() -> None:
    # An iterable is consumed once at construction; classification must not depend on it again.
    p = RetryPolicy(retry_codes=(c for c in [E.INVALID_RECORD]))
    assert p.classify(E.INVALID_RECORD) is Disposition.RETRY
    assert p.classify(E.INVALID_RECORD) is Disposition.RETRY


def test_is_retriable_overrides_everything_and_none_falls_through() -> None:
    calls: list[int] = []

    def pred(code: int) -> bool | None:
        calls.append(code)
        if code == E.MSG_SIZE_TOO_LARGE:
            return True
        if code == E._MSG_TIMED_OUT:
            return False
        return None

    p = RetryPolicy(is_retriable=pred, dead_letter_codes=[E.MSG_SIZE_TOO_LARGE])
    assert p.classify(E.MSG_SIZE_TOO_LARGE) is Disposition.RETRY
    assert p.classify(E._MSG_TIMED_OUT) is Disposition.DEAD
    # A verdict of False dead-letters even a fatal code; None leaves the table in charge.
    assert p.classify(E._FATAL) is Disposition.FATAL
    assert p.classify(E.INVALID_RECORD) is Disposition.DEAD
    assert calls == [E.MSG_SIZE_TOO_LARGE, E._MSG_TIMED_OUT, E._FATAL, E.INVALID_RECORD]


# -- names and descriptions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (E._MSG_TIMED_OUT, "_MSG_TIMED_OUT"),
        (-192, "_MSG_TIMED_OUT"),
        (E.MSG_SIZE_TOO_LARGE, "MSG_SIZE_TOO_LARGE"),
        (E.NOT_ENOUGH_REPLICAS, "NOT_ENOUGH_REPLICAS"),
        (E._ALL_BROKERS_DOWN, "_ALL_BROKERS_DOWN"),
        (E.NO_ERROR, "NO_ERROR"),
        (99999, "ERR_99999"),
        (-99999, "ERR_-99999"),
    ],
)
def test_error_name(code: int, name: str) -> None:
    assert error_name(code) == name


def test_error_name_agrees_with_librdkafka_for_every_table_code() -> None:
    for code in RETRIABLE_CODES | PERMANENT_CODES | FATAL_CODES:
        assert error_name(code) == KafkaError(code).name()


def test_describe_format() -> None:
    assert describe(KafkaError(E.MSG_SIZE_TOO_LARGE, "reason")) == "MSG_SIZE_TOO_LARGE (10): reason"
    assert describe(KafkaError(E._MSG_TIMED_OUT, "Local: Message timed out")) == (
        "_MSG_TIMED_OUT (-192): Local: Message timed out"
    )
    assert describe(KafkaError(4242, "what")) == "ERR_4242 (4242): what"


def test_describe_without_reason_uses_librdkafka_text() -> None:
    text = describe(KafkaError(E.TOPIC_AUTHORIZATION_FAILED))
    assert text.startswith("TOPIC_AUTHORIZATION_FAILED (29): ")
    assert len(text) > len("TOPIC_AUTHORIZATION_FAILED (29): ")


def test_a_refusal_of_credentials_or_tls_is_told_from_a_broken_connection() -> None:
    """A broker that rejects the client's certificate under TLS 1.3 ends the connection with an alert."""
    bad_certificate = (
        "ssl://127.0.0.1:9/bootstrap: Receive failed: error:0A000412:SSL routines::ssl/tls alert bad certificate"
    )
    assert refused(KafkaError(E._TRANSPORT, bad_certificate))
    assert refused(KafkaError(E._AUTHENTICATION, "SASL authentication error: invalid credentials"))
    assert refused(KafkaError(E._SSL, "certificate verify failed"))
    assert not refused(KafkaError(E._TRANSPORT, "127.0.0.1:9/0: Disconnected (after 10ms in state UP)"))
    assert not refused(KafkaError(E._ALL_BROKERS_DOWN, "1/1 brokers are down"))
