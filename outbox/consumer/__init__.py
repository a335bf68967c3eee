"""The consumer side: retry tiers with growing delays, dead letters, four strategies, no loss.

    from outbox import ResilientConsumer, RetryTopics, RetryInPlace, Ignore
"""

from outbox.consumer.aio import AsyncResilientConsumer
from outbox.consumer.circuit import MainTopicCircuit
from outbox.consumer.consumer import CONSUMER_DEFAULTS, ResilientConsumer
from outbox.consumer.deadletters import DEAD_LETTER_MODES
from outbox.consumer.redrive import RedriveResult, redrive_topic
from outbox.consumer.strategies import Ignore, RetryInPlace, RetryTopics, Strategy
from outbox.consumer.tiers import Ladder, dlq_name, retry_tier_name

__all__ = [
    "AsyncResilientConsumer",
    "CONSUMER_DEFAULTS",
    "DEAD_LETTER_MODES",
    "Ignore",
    "Ladder",
    "MainTopicCircuit",
    "RedriveResult",
    "ResilientConsumer",
    "RetryInPlace",
    "RetryTopics",
    "Strategy",
    "dlq_name",
    "redrive_topic",
    "retry_tier_name",
]
