"""Exceptions raised by kvblocks.

Every error a caller can provoke has its own class, so an engine can react to the
one it expects and let the others surface. Each also derives from the built-in
exception a Python programmer would reach for (``ValueError``, ``LookupError``,
``RuntimeError``), so generic handlers keep working.

Whenever one of these is raised by a public call, the structure that raised it is
unchanged: the check happens before the first mutation.
"""

from __future__ import annotations

__all__ = [
    "AccountingError",
    "AttachTimeoutError",
    "BackendUnavailableError",
    "CommitOutOfRangeError",
    "ConfigError",
    "DoubleFreeError",
    "DuplicateSequenceError",
    "EventDecodeError",
    "IntegrityError",
    "InvalidArgumentError",
    "InvalidBlockHashError",
    "HandoffError",
    "InvalidBlockIdError",
    "InvalidTokenError",
    "KVBlocksError",
    "MissingExtraError",
    "SequenceStateError",
    "StaleLookupError",
    "UnknownSequenceError",
]


class KVBlocksError(Exception):
    """Base class of every exception raised on purpose by kvblocks."""


class ConfigError(KVBlocksError, ValueError):
    """A configuration value is invalid (non-positive size, unknown hash scheme, ...)."""


class InvalidTokenError(KVBlocksError, ValueError):
    """Token ids are not non-negative integers below 2**32, or the prompt is empty."""


class InvalidBlockHashError(KVBlocksError, ValueError):
    """Precomputed block hashes are not ints >= 0 or non-empty bytes, or do not fit the token count."""


class InvalidArgumentError(KVBlocksError, ValueError):
    """A numeric argument is out of its domain (for example a negative token count)."""


class UnknownSequenceError(KVBlocksError, LookupError):
    """The sequence id was never registered (or was freed long ago)."""

    def __init__(self, seq_id: object, detail: str = "") -> None:
        self.seq_id = seq_id
        message = f"unknown sequence {seq_id!r}"
        super().__init__(f"{message}: {detail}" if detail else message)

    def __str__(self) -> str:  # LookupError would otherwise repr() the message
        return str(self.args[0])


class DuplicateSequenceError(KVBlocksError, ValueError):
    """``add_sequence`` was called with an id that is already registered."""


class DoubleFreeError(KVBlocksError, RuntimeError):
    """A sequence was freed twice, or a block was released more often than it was taken."""


class SequenceStateError(KVBlocksError, RuntimeError):
    """The call does not fit the sequence's state (e.g. commit before allocate)."""


class CommitOutOfRangeError(KVBlocksError, ValueError):
    """``commit`` named a token count below the previous commit or beyond what is allocated/known."""


class StaleLookupError(KVBlocksError, RuntimeError):
    """An admission was told the hit a lookup saw, and the cache no longer holds it: look up again.

    Nothing changed; the sequence is still waiting.
    """


class InvalidBlockIdError(KVBlocksError, ValueError):
    """A block id is outside ``0..num_blocks-1`` or not in the state the call needs."""


class AccountingError(KVBlocksError, ValueError):
    """A cached-token breakdown is negative or exceeds the prompt length."""


class IntegrityError(KVBlocksError, RuntimeError):
    """``check_integrity`` found a broken invariant. This is always a kvblocks bug."""


class BackendUnavailableError(KVBlocksError, RuntimeError):
    """A tensor backend was asked for but cannot run here; the message names what is missing."""


class MissingExtraError(ConfigError, BackendUnavailableError):
    """An optional dependency is not installed; the message names the extra that installs it.

    One class for every extra (torch, redis, prometheus, zmq, vllm, plot, ...). It is both a
    :class:`ConfigError` and a :class:`BackendUnavailableError`, so a handler written for either keeps
    catching it.

    >>> str(MissingExtraError("kvblocks.metrics needs prometheus_client", "prometheus"))
    'kvblocks.metrics needs prometheus_client: pip install "kvblocks[prometheus]"'
    """

    def __init__(self, needs: str, extra: str, note: str = "") -> None:
        self.extra = extra
        message = f'{needs}: pip install "kvblocks[{extra}]"'
        super().__init__(f"{message} ({note})" if note else message)


class HandoffError(KVBlocksError, ValueError):
    """A prefill-to-decode handoff is malformed, of another format version, scheme or namespace, or
    does not match the prompt it is accepted for."""


class AttachTimeoutError(KVBlocksError, TimeoutError):
    """A runner waited for published KV caches longer than its timeout."""


class EventDecodeError(KVBlocksError, ValueError):
    """Bytes received as a KV event batch are malformed or of another wire format version."""
