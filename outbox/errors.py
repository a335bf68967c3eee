"""One exception tree for everything kafka-outbox raises."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error raised by kafka-outbox."""


class ConfigError(OutboxError, ValueError):
    """A setting, URL or argument is invalid. Nothing was stored."""


class MissingDependencyError(ConfigError, ImportError):
    """An optional dependency the asked-for feature needs is not installed (an extra to install).

    A ConfigError (the setup cannot work as it is) and an ImportError (what it is underneath), so
    code catching either keeps working; the `outbox` command exits 1 for it, not 2 (usage).
    """


class StoreError(OutboxError):
    """The outbox store failed (corrupt, locked, read-only, full, unreachable).

    Messages already committed to the store are not lost by this error.
    """


class StoreNotFoundError(StoreError):
    """The outbox named by a URL does not exist and was not to be created."""


class UnknownMessageError(OutboxError, KeyError):
    """No message with the given id exists in the store."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want a plain sentence.
        return str(self.args[0]) if self.args else "unknown message"


class ProducerClosedError(OutboxError, RuntimeError):
    """`produce()` was called after `close()`."""


class ProducerForkedError(ProducerClosedError):
    """The producer was made in another process, before a fork: it cannot be used in this one.

    librdkafka's threads, and the producer's own, do not survive `os.fork()`. The child's copy of
    the producer is closed there (the parent's messages stay the parent's); make a producer in
    the child instead, after the fork.
    """


class KafkaDeliveryError(OutboxError):
    """A Kafka error, with librdkafka's code and name kept."""

    def __init__(self, code: int, name: str, reason: str) -> None:
        super().__init__(f"{name} ({code}): {reason}")
        self.code = code
        self.name = name
        self.reason = reason


class KafkaUnavailableError(OutboxError):
    """No broker of the cluster answered (the cluster is down or the address is wrong)."""


class DecryptionError(StoreError):
    """A stored row is encrypted with a key that was not given, or does not decrypt with it.

    Names the key's id (`key_id`), never the key. Nothing is lost: the row stays in the store,
    pending or dead as it was, and is read once the right key is given.
    """

    def __init__(self, key_id: str, message: str) -> None:
        super().__init__(message)
        self.key_id = key_id
