"""The consumer side: retry tiers with growing delays, dead letters, four strategies, no loss.

    from outbox import ResilientConsumer, RetryTopics, RetryInPlace, Ignore
"""

from .aio import AsyncResilientConsumer
from .circuit import MainTopicCircuit
from .consumer import CONSUMER_DEFAULTS, ResilientConsumer
from .deadletters import DEAD_LETTER_MODES
from .redrive import RedriveResult, redrive_topic
from .strategies import Ignore, RetryInPlace, RetryTopics, Strategy
from .tiers import Ladder, dlq_name, retry_tier_name

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
