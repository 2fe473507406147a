"""HybridKVCacheManager: a :class:`~kvblocks.manager.KVCacheManager` given layer groups beside full attention.

The groups (sliding window, chunked local, recurrent state, cross-attention) and the rules that span
them live in :mod:`kvblocks.core.coordinator` and :mod:`kvblocks.core.groups`; the manager owns one
coordinator over them. This class only builds such a manager (and refuses one without a group), so that
its constructor and ``from_config`` keep their names; :func:`kvblocks.manager_for_role` builds it too::

    block size 4, window 6; a sequence committed up to token 14 (next token: 14, attends 9..14)
    positions           0    1    2    3
    full table          5    6    7    8
    window table        -1   -1   3    9       blocks 0 and 1 left the window: released, still cached

Groups are numbered 0 (full attention), then the local groups in the order given, then the recurrent
groups, then the cross-attention groups. Every group's events are tagged with its index and kind.
Attention groups have host and storage tiers (:mod:`kvblocks.hybrid.tiers`); recurrent groups have none yet.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvblocks.config import CacheConfig
from kvblocks.core.groups.cross_group import CrossAttentionGroup
from kvblocks.core.groups.local_group import PLACEHOLDER, LocalGroup
from kvblocks.core.groups.recurrent_group import RecurrentGroup
from kvblocks.errors import ConfigError
from kvblocks.events import EventSink
from kvblocks.hashing import DEFAULT_SCHEME, Namespace
from kvblocks.manager import KVCacheManager

__all__ = ["PLACEHOLDER", "HybridKVCacheManager", "LocalGroup"]


class HybridKVCacheManager(KVCacheManager):
    """Full-attention layers in the base manager's tree and tables, local layer groups beside them.

    >>> m = HybridKVCacheManager(16, 4, local_groups=[LocalGroup("sliding_window", span=6, num_blocks=16)])
    >>> m.add_sequence("a", list(range(17)))
    >>> list(m.allocate("a", 17)), m.group_block_table("a", 1)
    ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    >>> m.commit("a", 17)                      # token 17 attends to 12..17: blocks 0-2 leave the window
    >>> m.group_block_table("a", 1)
    [-1, -1, -1, 3, 4]
    """

    _tree_group = (0, "full")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        local_groups: Sequence[LocalGroup] = (),
        recurrent_groups: Sequence[RecurrentGroup] = (),
        cross_groups: Sequence[CrossAttentionGroup] = (),
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
        reserved_blocks: int = 0,
        drop_last_matched_block: bool = False,
    ) -> None:
        super().__init__(
            num_blocks,
            block_size,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
            event_sink=event_sink,
            reserved_blocks=reserved_blocks,
            drop_last_matched_block=drop_last_matched_block,
        )
        self._setup_groups(local_groups, recurrent_groups, cross_groups)

    @classmethod
    def from_config(
        cls,
        config: CacheConfig,
        *,
        local_groups: Sequence[LocalGroup] = (),
        recurrent_groups: Sequence[RecurrentGroup] = (),
        cross_groups: Sequence[CrossAttentionGroup] = (),
        event_sink: EventSink | None = None,
    ) -> HybridKVCacheManager:
        manager = cls.__new__(cls)
        manager._setup(config, event_sink)
        manager._setup_groups(local_groups, recurrent_groups, cross_groups)
        return manager

    def _setup_groups(
        self,
        local_groups: Sequence[LocalGroup],
        recurrent_groups: Sequence[RecurrentGroup],
        cross_groups: Sequence[CrossAttentionGroup] = (),
    ) -> None:
        super()._setup_groups(local_groups, recurrent_groups, cross_groups)
        if self._coordinator is None:
            raise ConfigError(
                "a hybrid manager needs a local, recurrent or cross-attention group (else KVCacheManager)"
            )
