"""The settle step: every fate of one send, decided without Kafka (KafkaError values only)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from confluent_kafka import KafkaError

from outbox.drain.settle import DELIVERED, Decision, Verdict, add_to, settle
from outbox.retry import RetryPolicy
from outbox.stores.base import Failure, Settlement

NOW = 1_700_000_000.0
POLICY = RetryPolicy(max_attempts=3, initial_delay=5.0)


@dataclass
class Row:
    attempts: int = 0
    first_failed_at: float | None = None


def err(code: int, text: str = "boom") -> KafkaError:
    return KafkaError(code, text)


def test_delivered() -> None:
    assert settle(Row(), None, POLICY, NOW) is DELIVERED


def test_retriable_failure_is_rescheduled_by_the_policy_with_code_and_name() -> None:
    d = settle(Row(attempts=1, first_failed_at=NOW - 10), err(KafkaError._MSG_TIMED_OUT, "late"), POLICY, NOW)
    assert d == Decision(
        Verdict.RESCHEDULE, NOW + 5.0, -192, "_MSG_TIMED_OUT", "_MSG_TIMED_OUT (-192): late", False, 2
    )


def test_policy_gives_up_after_max_attempts() -> None:
    d = settle(Row(attempts=2, first_failed_at=NOW - 10), err(KafkaError.NOT_ENOUGH_REPLICAS), POLICY, NOW)
    assert (d.verdict, d.at, d.code, d.name, d.attempts) == (
        Verdict.DEAD_LETTER, None, 19, "NOT_ENOUGH_REPLICAS", 3
    )


def test_permanent_error_is_dead_at_once() -> None:
    d = settle(Row(), err(KafkaError.TOPIC_AUTHORIZATION_FAILED, "no"), POLICY, NOW)
    assert (d.verdict, d.code, d.name, d.error, d.attempts) == (
        Verdict.DEAD_LETTER, 29, "TOPIC_AUTHORIZATION_FAILED", "TOPIC_AUTHORIZATION_FAILED (29): no", 1
    )


@pytest.mark.parametrize("code", [KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE])
def test_batch_size_error_resends_alone_then_decides(code: int) -> None:
    assert settle(Row(), err(code), POLICY, NOW).verdict is Verdict.RESEND_ALONE
    alone = settle(Row(), err(code), POLICY, NOW, alone=True)
    assert (alone.verdict, alone.code, alone.attempts) == (Verdict.DEAD_LETTER, code, 1)


@pytest.mark.parametrize("code", [KafkaError._PURGE_QUEUE, KafkaError._DESTROY])
def test_never_sent_is_released_without_an_attempt(code: int) -> None:
    d = settle(Row(attempts=1, first_failed_at=NOW - 1), err(code), POLICY, NOW)
    assert (d.verdict, d.at, d.code, d.attempts) == (Verdict.RELEASE, NOW, code, 1)


def test_fatal_error_reschedules_and_asks_for_a_new_producer() -> None:
    d = settle(Row(), err(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER), POLICY, NOW)
    assert (d.verdict, d.recreate_producer, d.at) == (Verdict.RESCHEDULE, True, NOW + 5.0)


def test_unknown_error_retries_only_as_often_as_the_policy_allows() -> None:
    assert settle(Row(attempts=0), err(12345), POLICY, NOW).verdict is Verdict.RESCHEDULE
    assert settle(Row(attempts=2, first_failed_at=NOW), err(12345), POLICY, NOW).verdict is Verdict.DEAD_LETTER


def test_user_overrides_of_the_classification_apply() -> None:
    policy = RetryPolicy(dead_letter_codes=[KafkaError._MSG_TIMED_OUT])
    assert settle(Row(), err(KafkaError._MSG_TIMED_OUT), policy, NOW).verdict is Verdict.DEAD_LETTER


def test_first_failure_time_defaults_to_now_for_the_time_based_stop() -> None:
    import tenacity

    policy = RetryPolicy(stop=tenacity.stop_after_delay(60))
    assert settle(Row(attempts=5), err(KafkaError._TRANSPORT), policy, NOW).verdict is Verdict.RESCHEDULE
    late = settle(Row(attempts=5, first_failed_at=NOW - 61), err(KafkaError._TRANSPORT), policy, NOW)
    assert late.verdict is Verdict.DEAD_LETTER


def test_decisions_group_into_one_settlement() -> None:
    st = Settlement()
    add_to(st, 1, DELIVERED, NOW)
    add_to(st, 2, settle(Row(), err(KafkaError._MSG_TIMED_OUT, "t"), POLICY, NOW), NOW)
    add_to(st, 3, settle(Row(), err(KafkaError.TOPIC_AUTHORIZATION_FAILED, "n"), POLICY, NOW), NOW)
    add_to(st, 4, settle(Row(), err(KafkaError._PURGE_QUEUE), POLICY, NOW), NOW)
    assert st.delivered == [1] and st.released == [4]
    assert st.failures == [
        Failure(2, "_MSG_TIMED_OUT (-192): t", NOW + 5.0, NOW, -192, "_MSG_TIMED_OUT"),
        Failure(3, "TOPIC_AUTHORIZATION_FAILED (29): n", None, NOW, 29, "TOPIC_AUTHORIZATION_FAILED"),
    ]
    with pytest.raises(ValueError, match="re-send row 5 first"):
        add_to(st, 5, settle(Row(), err(KafkaError.MSG_SIZE_TOO_LARGE), POLICY, NOW), NOW)


@pytest.mark.parametrize("code", [KafkaError._MSG_TIMED_OUT, KafkaError._TRANSPORT, KafkaError.NOT_ENOUGH_REPLICAS])
def test_failure_for_want_of_a_cluster_while_no_broker_answers_is_not_an_attempt(code: int) -> None:
    row = Row(attempts=2, first_failed_at=NOW - 100)  # the policy would give up on this one
    d = settle(row, err(code, "down"), POLICY, NOW, cluster_down=True)
    assert (d.verdict, d.at, d.code, d.attempts) == (Verdict.RELEASE, NOW, code, 2)
    settlement = Settlement()
    add_to(settlement, 7, d, NOW)
    assert settlement == Settlement(released=[7])
    # With a broker answering, the same failure counts and the policy gives up.
    assert settle(row, err(code, "down"), POLICY, NOW).verdict is Verdict.DEAD_LETTER


def test_message_faults_count_even_while_no_broker_answers() -> None:
    d = settle(Row(), err(KafkaError.TOPIC_AUTHORIZATION_FAILED, "no"), POLICY, NOW, cluster_down=True)
    assert (d.verdict, d.attempts) == (Verdict.DEAD_LETTER, 1)
    d = settle(Row(), err(KafkaError.UNKNOWN_TOPIC_OR_PART, "gone"), POLICY, NOW, cluster_down=True)
    assert (d.verdict, d.attempts) == (Verdict.RESCHEDULE, 1)
