"""Eviction policies: the order in which a :class:`~kvblocks.core.pool.BlockPool` gives up its idle blocks.

A pool's idle blocks (ref count 0, content still findable) are the cache's evictable part. Which
of them goes next is the policy's decision, and the policy is the only place that order lives:
the pool tells it when a block becomes idle, when an idle block is acquired again (a hit) and when
one is dropped; the content index (:class:`~kvblocks.core.prefix_tree.PrefixTree`, the flat index of a
hybrid model's local groups, the host tier) asks it for victims.

Policies, by registry name (:data:`EVICTION_POLICIES`):

* ``"lru"`` (the default): least recently released first (:class:`LRU`).
* ``"s3fifo"``: S3-FIFO (Yang et al., SOSP 2023) over the idle blocks (:class:`S3FIFO`): a small
  probation queue, a main queue with second chances and a ghost set of recently evicted contents.

A prefix tree may only evict leaves: it passes ``blockers`` (cached children per block) and
``parent`` to :meth:`EvictionPolicy.victims`; a blocked candidate is kept, and evicting a block
unblocks its parent within the same call. Adding a policy is one class with the methods of
:class:`EvictionPolicy` plus one entry in :data:`EVICTION_POLICIES`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from itertools import chain, islice
from types import MappingProxyType
from typing import Protocol

from kvblocks.errors import ConfigError, IntegrityError

__all__ = [
    "DEFAULT_EVICTION",
    "EVICTION_POLICIES",
    "LRU",
    "S3FIFO",
    "EvictionPolicy",
    "PolicyFactory",
    "check_eviction",
    "make_policy",
    "register_eviction_policy",
    "unregister_eviction_policy",
]

DEFAULT_EVICTION = "lru"


class EvictionPolicy(Protocol):
    """Which idle block goes next. Block ids are ints in ``0..num_blocks-1``; the pool changes the idle set
    only for blocks in the right state (the policy does not check)."""

    name: str

    @property
    def idle(self) -> MutableMapping[int, float]:
        """The idle blocks, each -> when it became idle, in the policy's order (the likely next victims
        first; LRU: exactly its order). The pool's hot loops write it: ``idle[b] = now`` when ``b`` is
        released by its last holder with cached content, ``del idle[b]`` when idle ``b`` is acquired again
        (a hit). LRU's is its own ``OrderedDict``, so those loops run on the dict's C operations."""
        ...

    def touch(self, block: int) -> None:
        """Idle ``block``'s content was just used without acquiring it (it stays idle)."""
        ...

    def remove(self, block: int) -> object:
        """Idle ``block`` is dropped by its index, not chosen by the policy. ``KeyError`` if it is not idle."""
        ...

    def victims(
        self,
        count: int,
        blockers: MutableSequence[int] | None = None,
        parent: Sequence[int] | None = None,
        stamps: list[float] | None = None,
    ) -> list[int]:
        """Choose, remove and return up to ``count`` idle blocks, in eviction order.

        With ``blockers``, a block with ``blockers[b] > 0`` is not evictable now (a prefix tree's
        interior node): it is kept; choosing ``b`` decrements ``blockers[parent[b]]``, so a parent
        whose last child goes in this call may follow it. Fewer than ``count`` only when no idle
        block is left; :class:`IntegrityError` if idle blocks remain but all are blocked. With
        ``stamps``, each victim's idle time (its value in :attr:`idle`) is appended to it, in order.
        """
        ...

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless the policy's own structures agree."""
        ...


PolicyFactory = Callable[[int, Sequence[object]], EvictionPolicy]
"""Builds a pool's policy from the pool's size and its content keys (``keys[b]``: what block ``b`` holds,
None when nothing): a policy that remembers contents (S3-FIFO's ghost set) reads them there."""


class LRU:
    """Least recently released first: an ordered dict of idle blocks (-> when each became idle), oldest first.

    The pool's hot loops set and delete its entries directly (C dict operations), so a pool with this
    policy does exactly what it did before policies existed, at the same speed.

    >>> lru = LRU()
    >>> for b in (3, 1, 2):
    ...     lru.became_idle(b)
    >>> lru.hit(1)
    >>> lru.victims(5)
    [3, 2]
    """

    __slots__ = ("idle",)

    name = "lru"

    def __init__(self, num_blocks: int = 0, keys: Sequence[object] = ()) -> None:
        self.idle: OrderedDict[int, float] = OrderedDict()
        """Idle blocks -> when each became idle, least recently released first."""

    def __len__(self) -> int:
        return len(self.idle)

    def __contains__(self, block: object) -> bool:
        return block in self.idle

    def became_idle(self, block: int, now: float = 0.0) -> None:
        """What the pool's ``idle[block] = now`` does: ``block`` joins the back."""
        self.idle[block] = now

    def hit(self, block: int) -> None:
        """What the pool's ``del idle[block]`` does: an idle block was acquired again."""
        del self.idle[block]

    def remove(self, block: int) -> None:
        del self.idle[block]

    def touch(self, block: int) -> None:
        """Make idle ``block`` the most recently used."""
        self.idle.move_to_end(block)

    def victims(
        self,
        count: int,
        blockers: MutableSequence[int] | None = None,
        parent: Sequence[int] | None = None,
        stamps: list[float] | None = None,
    ) -> list[int]:
        """The ``count`` least recently released blocks; with ``blockers``, the least recently released
        unblocked ones (a blocked block ahead of them stays where it is)."""
        order = self.idle
        if blockers is None or parent is None:
            out = list(islice(order, count))
            if stamps is None:
                for b in out:
                    del order[b]
            else:
                stamps.extend(map(order.pop, out))
            return out
        if count == 1 and order:  # a decoding sequence's next block: the loop below, for one victim
            b = next(iter(order))
            if blockers[b]:
                b = self._oldest_unblocked(blockers)
            stamp = order.pop(b)
            if stamps is not None:
                stamps.append(stamp)
            blockers[parent[b]] -= 1
            return [b]
        out = []
        append = out.append
        pop = order.pop
        keep = None if stamps is None else stamps.append
        while len(out) < count and order:
            # Snapshot the oldest candidates: iterating a list is cheaper than re-peeking the dict.
            for b in list(islice(order, count - len(out))):
                blocked = blockers[b]
                if blocked:  # a block released before a descendant (not the manager's order): skip ahead
                    b = self._oldest_unblocked(blockers)
                if keep is None:
                    del order[b]
                else:
                    keep(pop(b))
                blockers[parent[b]] -= 1
                append(b)
                if blocked:  # the snapshot may be stale now: take a new one
                    break
        return out

    def _oldest_unblocked(self, blockers: Sequence[int]) -> int:
        for b in self.idle:
            if not blockers[b]:
                return b
        raise IntegrityError("idle blocks exist but every one is blocked: an idle block has a cached child in use")

    def check_integrity(self) -> None:
        """Nothing to check: one dict holds the whole order."""


class S3FIFO(MutableMapping[int, float]):
    """S3-FIFO over the idle blocks: a small FIFO, a main FIFO with second chances, a ghost set.

    A block's content enters the *small* queue when it first becomes idle -- the *main* queue if
    the same content was evicted from the small queue recently (its key is in the ghost set).
    Each hit (an idle block acquired again) adds one to the block's frequency (at most 3). A
    released block rejoins its queue at the tail. To evict, the policy takes from the small queue
    while it holds more than ``small_share`` of the idle blocks (or the main queue is empty), else
    from the main queue. From the small queue, a block with a hit moves to the main queue, one
    without is evicted and its key joins the ghost set. From the main queue, a block with a
    positive frequency loses one and goes to the tail; one without is evicted. A blocked block
    (an interior node of a prefix tree) is moved to the main queue's tail and kept.

    The queue and the frequency of a block belong to its content: they are forgotten when the
    block is evicted or starts holding other content. The policy is its own :attr:`idle` mapping
    (idle block -> when it became idle; setting an entry is :meth:`became_idle`, deleting one :meth:`hit`).

    >>> keys = ["a", "b", "c", None]
    >>> s3 = S3FIFO(4, keys, small_share=0.5)
    >>> for b in (0, 1, 2):
    ...     s3.became_idle(b)
    >>> s3.touch(0)  # block 0 was used while idle: at the head of the small queue it is promoted
    >>> s3.victims(1)
    [1]
    >>> s3.queue_of(0)
    'main'
    >>> "b" in s3.ghost
    True
    """

    __slots__ = ("_content", "_freq", "_ghost", "_in_main", "_keys", "_main", "_small", "ghost_size", "small_share")

    name = "s3fifo"
    parameter = "small_share"
    """The keyword a policy spec's value sets: ``"s3fifo:0.75"`` is ``S3FIFO(..., small_share=0.75)``."""
    MAX_FREQ = 3

    def __init__(
        self,
        num_blocks: int,
        keys: Sequence[object],
        *,
        small_share: float = 0.1,
        ghost_size: int | None = None,
    ) -> None:
        if not isinstance(small_share, float | int) or isinstance(small_share, bool) or not 0 < small_share < 1:
            raise ConfigError(f"small_share must be a number in (0, 1), got {small_share!r}")
        ghost = num_blocks if ghost_size is None else ghost_size
        if isinstance(ghost, bool) or not isinstance(ghost, int) or ghost < 0:
            raise ConfigError(f"ghost_size must be an int >= 0, got {ghost_size!r}")
        self.small_share = float(small_share)
        self.ghost_size = ghost
        """Evicted contents remembered (default: as many as the pool has blocks)."""
        self._keys = keys
        self._small: OrderedDict[int, float] = OrderedDict()  # block -> when it became idle
        self._main: OrderedDict[int, float] = OrderedDict()
        self._ghost: OrderedDict[object, None] = OrderedDict()
        self._freq = bytearray(num_blocks)
        self._in_main = bytearray(num_blocks)
        self._content: list[object] = [None] * num_blocks  # the key a block's queue and frequency belong to

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, block: object) -> bool:
        return block in self._small or block in self._main

    def __iter__(self) -> Iterator[int]:
        """The small queue then the main queue, each oldest first (victims may skip or promote some)."""
        return chain(self._small, self._main)

    def __getitem__(self, block: int) -> float:
        queue = self._main if self._in_main[block] else self._small
        return queue[block]

    @property
    def idle(self) -> S3FIFO:
        """This policy, as the pool's mapping of idle blocks -> when each became idle."""
        return self

    @property
    def ghost(self) -> Mapping[object, None]:
        """Keys of contents recently evicted from the small queue, oldest first (a live view)."""
        return self._ghost

    def queue_of(self, block: int) -> str | None:
        """``"small"``, ``"main"`` or None (not idle)."""
        if block in self._small:
            return "small"
        return "main" if block in self._main else None

    def frequency(self, block: int) -> int:
        return self._freq[block] if self._content[block] is not None else 0

    # ------------------------------------------------------------------ transitions

    def __setitem__(self, block: int, now: float) -> None:
        """``block`` was released by its last holder at ``now``: it joins the tail of its content's queue."""
        key = self._keys[block]
        if self._content[block] is not key:  # new content: it starts in the small queue, or main if a ghost
            self._content[block] = key
            self._freq[block] = 0
            ghost = self._ghost
            recalled = key in ghost
            if recalled:
                del ghost[key]
            self._in_main[block] = recalled
        if self._in_main[block]:
            self._main[block] = now
        else:
            self._small[block] = now

    def __delitem__(self, block: int) -> None:
        """Idle ``block`` was acquired again: it leaves its queue, its frequency grows."""
        if self._in_main[block]:
            del self._main[block]
        else:
            del self._small[block]
        if self._freq[block] < self.MAX_FREQ:
            self._freq[block] += 1

    def became_idle(self, block: int, now: float = 0.0) -> None:
        """What the pool's ``idle[block] = now`` does."""
        self[block] = now

    def hit(self, block: int) -> None:
        """What the pool's ``del idle[block]`` does."""
        del self[block]

    def touch(self, block: int) -> None:
        if block in self and self._freq[block] < self.MAX_FREQ:
            self._freq[block] += 1

    def remove(self, block: int) -> None:
        if self._in_main[block]:
            del self._main[block]
        else:
            del self._small[block]
        self._forget(block)

    def _forget(self, block: int) -> None:
        self._content[block] = None
        self._freq[block] = 0
        self._in_main[block] = 0

    def victims(
        self,
        count: int,
        blockers: MutableSequence[int] | None = None,
        parent: Sequence[int] | None = None,
        stamps: list[float] | None = None,
    ) -> list[int]:
        small, main, freq, in_main, share = self._small, self._main, self._freq, self._in_main, self.small_share
        content, ghost, ghost_size = self._content, self._ghost, self.ghost_size
        blocked = blockers if parent is not None else None  # a tree's child counts; None: every block may go
        up: Sequence[int] = parent if parent is not None else ()
        out: list[int] = []
        futile = 0  # main-queue blocks passed over (blocked) since the last change that could unblock one
        while len(out) < count and (small or main):
            n_small, n_main = len(small), len(main)
            from_small = n_small > 0 and (not n_main or n_small > share * (n_small + n_main) or futile >= n_main)
            if from_small:
                b, stamp = small.popitem(last=False)
                if freq[b] or (blocked is not None and blocked[b]):
                    main[b] = stamp  # a hit (or a blocked prefix): promoted, to earn its place again
                    in_main[b] = 1
                    freq[b] = 0
                    futile = 0
                    continue
                if ghost_size:  # the content is remembered (a block's key is never None while it is idle)
                    key = content[b]
                    if key in ghost:
                        ghost.move_to_end(key)
                    else:
                        ghost[key] = None
                        if len(ghost) > ghost_size:
                            ghost.popitem(last=False)
            else:
                b, stamp = main.popitem(last=False)
                if freq[b]:
                    freq[b] -= 1
                    main[b] = stamp
                    futile = 0
                    continue
                if blocked is not None and blocked[b]:
                    main[b] = stamp
                    futile += 1
                    if futile > len(main) and not small:
                        raise IntegrityError(
                            "idle blocks exist but every one is blocked: an idle block has a cached child in use"
                        )
                    continue
            content[b] = None  # forgotten: its queue and frequency belonged to the evicted content
            freq[b] = in_main[b] = 0
            if blocked is not None:
                blocked[up[b]] -= 1
            if stamps is not None:
                stamps.append(stamp)
            out.append(b)
            futile = 0
        return out

    def check_integrity(self) -> None:
        both = self._small.keys() & self._main.keys()
        if both:
            raise IntegrityError(f"blocks in both S3-FIFO queues: {sorted(both)}")
        for queue, main in ((self._small, 0), (self._main, 1)):
            for b in queue:
                if self._in_main[b] != main:
                    raise IntegrityError(f"block {b} is queued in the wrong S3-FIFO queue")
                if self._content[b] is None or self._content[b] is not self._keys[b]:
                    raise IntegrityError(f"idle block {b}'s S3-FIFO state belongs to other content")
        if len(self._ghost) > self.ghost_size:
            raise IntegrityError(f"{len(self._ghost)} ghosts, more than {self.ghost_size}")


_POLICIES: dict[str, PolicyFactory] = {"lru": LRU, "s3fifo": S3FIFO}
_BUILT_IN = frozenset(_POLICIES)

EVICTION_POLICIES: Mapping[str, PolicyFactory] = MappingProxyType(_POLICIES)
"""Eviction policies by name (read-only): a new policy is one class and one entry here, or
:func:`register_eviction_policy` from outside the package."""


def register_eviction_policy(name: str, factory: PolicyFactory) -> None:
    """Make ``factory`` (a policy class: ``factory(num_blocks, keys)``) selectable as ``name`` wherever a
    policy is named (``CacheConfig.eviction``, ``TierConfig.host_eviction``, ``--eviction``). New names only."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ConfigError(f"an eviction policy's name is a non-empty str without ':', got {name!r}")
    if not callable(factory):
        raise ConfigError(f"an eviction policy factory must be callable, got {type(factory).__name__}")
    if name in _POLICIES:
        raise ConfigError(f"eviction policy {name!r} is already registered")
    _POLICIES[name] = factory


def unregister_eviction_policy(name: str) -> None:
    """Forget a policy added by :func:`register_eviction_policy` (the built-in ones stay)."""
    if name in _BUILT_IN:
        raise ConfigError(f"eviction policy {name!r} is built in")
    if _POLICIES.pop(name, None) is None:
        raise ConfigError(f"unknown eviction policy {name!r}")


def _split(spec: object, what: str) -> tuple[str, str | None]:
    name, colon, argument = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if name not in EVICTION_POLICIES:
        raise ConfigError(
            f"unknown {what} policy {str(spec)[:60]!r}; known: {', '.join(EVICTION_POLICIES)} (s3fifo:SHARE sets"
            " its small queue's share)"
        )
    return name, (argument if colon else None)


def _build(spec: object, what: str, num_blocks: int, keys: Sequence[object]) -> EvictionPolicy:
    name, argument = _split(spec, what)
    factory = EVICTION_POLICIES[name]
    if argument is None:
        return factory(num_blocks, keys)
    parameter = getattr(factory, "parameter", None)
    if parameter is None:
        raise ConfigError(f"{what} policy {name!r} takes no parameter (got {spec!r})")
    try:
        value = float(argument)
    except ValueError:
        raise ConfigError(f"{what} {str(spec)[:60]!r}: {argument[:30]!r} is not a number") from None
    try:
        policy: EvictionPolicy = factory(num_blocks, keys, **{parameter: value})
    except ConfigError as error:
        raise ConfigError(f"{what} {str(spec)[:60]!r}: {error}") from None
    return policy


def check_eviction(spec: object, what: str = "eviction") -> str:
    """``spec`` if it names a policy (``"lru"``, ``"s3fifo"``), or a policy and the value of its one parameter
    (``"s3fifo:0.75"``: S3-FIFO with its small queue at 75% of the idle blocks); else :class:`ConfigError`
    saying why (and listing the known names for an unknown one)."""
    _build(spec, what, 0, ())
    return spec  # type: ignore[return-value]


def make_policy(spec: str, num_blocks: int, keys: Sequence[object]) -> EvictionPolicy:
    """A new policy as ``spec`` says (see :func:`check_eviction`) for a pool of ``num_blocks`` whose content
    keys are ``keys``."""
    return _build(spec, "eviction", num_blocks, keys)
