"""Host and storage tiers under a hybrid manager's attention groups.

:class:`TieredHybridKVCacheManager` is :class:`~kvblocks.tiers.TieredKVCacheManager` over
:class:`~kvblocks.hybrid.HybridKVCacheManager`: group 0 (full attention) keeps the tiered manager's
host tier, storage tier and plan fields; each sliding-window or chunked-local group gets a host tier
of its own (``TierConfig.group_host_blocks``) that the blocks its index evicts move down to::

    block size 4, window 6, a 17-token prompt seen before; its blocks were evicted since
    position           0    1    2    3
    group 0  where     dev  dev  host host        tree run 2, host run 2: serves a hit up to 16
    group 1  where     -    -    host dev         the window at 16 needs positions 2, 3
    lookup   CachedTokens(device=8, host=8)       group 0's split of the common hit (16 tokens)
    allocate group 0: swap-ins h->n2, h->n3 (plan.group_transfers[0].swap_ins); group 1: h->m2 (plan.group_transfers[1])

* The hit is the longest prefix every group serves when a group "serves" a block it holds on device
  or in its host tier (group 0 also what storage is known to hold): :func:`longest_common_hit` over
  those answers. :class:`~kvblocks.CachedTokens` reports group 0's device / host / storage split of
  that hit.
* An admission gives every group's needed blocks that are not on device a device block and a
  swap-in (group 0 also storage loads), in every group or none. The sequence is pending until every
  copy is reported (``complete_transfers``, ``poll_loads``). A failed copy in any group cuts the hit
  back to the longest one every group still serves with the blocks whose copies landed; the rest of
  every table goes back and the engine allocates those tokens again.
* Storage: group 0 stores under the manager's keys; with ``TierConfig.group_entry_formats`` each
  local group stores under keys of its own (:func:`~kvblocks.tiers.group_tag`: a local block and a
  full-attention block under the same hash hold different KV) in the same backend, with its own
  entry format, known-stored index and I/O threads. A local group then serves a block also when its
  storage is known to hold it; its stored blocks get device blocks and loads, reported by
  ``poll_loads`` as :class:`~kvblocks.tiers.LoadResult` with ``group`` set. Its write-back and
  write-through saves are in its :class:`~kvblocks.tiers.GroupTransfers` ``saves``; their payloads
  come back in ``complete_transfers(saved_groups={group: [...]})``. Without group formats, storage
  serves group 0 only and a storage block counts only where every local group serves the hit from
  device or host.
* Events: with an ``event_sink``, every group's host and storage tiers emit ``tier="host"`` /
  ``"storage"`` events tagged with the group's index and kind, as its device index tags its own
  (group 0: ``(0, "full")``), when and where the tiered manager emits group 0's (see
  :mod:`kvblocks.tiers.manager`). A router follows the ``"full"`` group only; the local groups'
  events are for consumers that track windows. :meth:`TieredHybridKVCacheManager.snapshot_events`
  covers every group and tier.
* Recurrent groups are refused (:class:`~kvblocks.errors.ConfigError`): their checkpoints have no
  host tier yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

from kvblocks.accounting import CachedTokens
from kvblocks.config import CacheConfig
from kvblocks.core.groups.hits import longest_common_hit, needed_blocks
from kvblocks.core.groups.local_group import PLACEHOLDER, LocalGroup, LocalGroupManager
from kvblocks.core.groups.recurrent_group import RecurrentGroup
from kvblocks.errors import ConfigError, IntegrityError, InvalidArgumentError, StaleLookupError
from kvblocks.events import BlockStored, EventSink
from kvblocks.hashing import DEFAULT_SCHEME, BlockHash, Namespace
from kvblocks.hybrid.manager import HybridKVCacheManager
from kvblocks.manager import BlockTable, _count_arg, _Sequence
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.entry import group_tag, namespace_tag
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.manager import TieredKVCacheManager, _Admission, _Plan
from kvblocks.tiers.storage_tier import LoadOutcome, StorageTier
from kvblocks.tiers.transfers import AdmittedTable, BlockSave, GroupTransfers, LoadResult, TransferPlan, per_group

__all__ = ["TieredHybridKVCacheManager"]

_LocalSwap = tuple[int, int, "_HybridAdmission", int]  # host block, device block, admission, group position
_DEVICE, _HOST, _STORED = 0, 1, 2  # where a local group holds a block a hit needs
_Source = tuple[int, int, int]  # group position, block (device or host; -1 when stored), where


class _HybridAdmission(_Admission):
    """A pending admission of a hybrid sequence: group 0's copies, and each local group's swap-ins."""

    __slots__ = ("hit", "local_loaded", "local_loads", "local_ok", "local_requests", "local_swaps")

    def __init__(
        self,
        seq_id: Hashable,
        seq: _Sequence,
        parts: tuple[int, list[int], int],
        hit: int,
        local_swaps: list[list[tuple[int, int, int]]],
        local_loads: list[list[tuple[int, int]]],
    ) -> None:
        device, host_blocks, num_loads = parts
        super().__init__(seq_id, seq, device, host_blocks, num_loads)
        self.hit = hit  # chain blocks every group serves once its copies land
        self.local_swaps = local_swaps  # per local group: (host block, device block, group position)
        # per local group, the positions whose swap-in landed; None until the plan holding them completes
        self.local_ok: list[set[int]] | None = None if any(local_swaps) else [set() for _ in local_swaps]
        self.local_loads = local_loads  # per local group: (device block, group position) read from its storage
        # per local group, the positions its storage read filled; None until poll_loads reports that read
        self.local_loaded: list[set[int] | None] = [None if loads else set() for loads in local_loads]
        self.local_requests = [-1 for _ in local_loads]  # per local group: its storage read's request id


class _HybridPlan(_Plan):
    """A step's plan with each local group's swap-outs, swap-ins and deferred releases."""

    __slots__ = ("group_deferred", "group_queued", "group_saves", "group_swap_ins", "group_swap_outs")

    def __init__(self, plan_id: int, num_locals: int) -> None:
        super().__init__(plan_id)
        self.group_swap_outs: list[list[tuple[int, int, BlockHash]]] = [[] for _ in range(num_locals)]
        self.group_swap_ins: list[list[_LocalSwap]] = [[] for _ in range(num_locals)]
        self.group_deferred: list[list[list[int]]] = [[] for _ in range(num_locals)]
        self.group_saves: list[list[BlockSave]] = [[] for _ in range(num_locals)]
        self.group_queued: list[set[BlockHash]] = [set() for _ in range(num_locals)]  # hashes saved per group

    def busy(self) -> bool:
        return (
            super().busy()
            or any(self.group_swap_outs)
            or any(self.group_swap_ins)
            or any(self.group_deferred)
            or any(self.group_saves)
        )

    def frozen_groups(self) -> tuple[GroupTransfers, ...]:
        return super().frozen_groups() + tuple(
            GroupTransfers(
                number,
                tuple((d, h) for d, h, _ in outs),
                tuple((h, d) for h, d, _, _ in ins),
                tuple(saves),
            )
            for number, (outs, ins, saves) in enumerate(
                zip(self.group_swap_outs, self.group_swap_ins, self.group_saves, strict=True), 1
            )
        )


class TieredHybridKVCacheManager(TieredKVCacheManager, HybridKVCacheManager):
    """A hybrid manager (full attention + local groups) whose evicted blocks live on in host tiers and storage.

    >>> from kvblocks.tiers import TierConfig
    >>> m = TieredHybridKVCacheManager(
    ...     5, 4, tiers=TierConfig(num_host_blocks=8, group_host_blocks=(8,)),
    ...     local_groups=[LocalGroup("sliding_window", span=6, num_blocks=5)])
    >>> m.add_sequence("a", list(range(17))); _ = m.allocate("a", 17); m.commit("a", 17); m.free("a")
    >>> m.add_sequence("b", list(range(100, 117))); _ = m.allocate("b", 17)   # evicts a's blocks in both groups
    >>> plan = m.take_transfers(); [(g.group, len(g.swap_outs)) for g in plan.group_transfers]
    [(0, 4), (1, 4)]
    >>> m.complete_transfers(plan); m.free("b"); m.add_sequence("c", list(range(17)))
    >>> m.lookup("c")
    CachedTokens(device=0, host=16, storage=0, num_prompt_tokens=17)
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        tiers: TierConfig,
        local_groups: Sequence[LocalGroup],
        recurrent_groups: Sequence[RecurrentGroup] = (),
        hash_scheme: str = DEFAULT_SCHEME,
        namespace: str | Namespace = "default",
        enable_prefix_caching: bool = True,
        event_sink: EventSink | None = None,
        reserved_blocks: int = 0,
    ) -> None:
        HybridKVCacheManager.__init__(
            self,
            num_blocks,
            block_size,
            local_groups=local_groups,
            recurrent_groups=recurrent_groups,
            hash_scheme=hash_scheme,
            namespace=namespace,
            enable_prefix_caching=enable_prefix_caching,
            event_sink=event_sink,
            reserved_blocks=reserved_blocks,
        )
        self._setup_tiers(tiers)

    @classmethod
    def from_config(  # type: ignore[override]
        cls,
        config: CacheConfig,
        *,
        tiers: TierConfig,
        local_groups: Sequence[LocalGroup],
        recurrent_groups: Sequence[RecurrentGroup] = (),
        event_sink: EventSink | None = None,
    ) -> TieredHybridKVCacheManager:
        manager = cls.__new__(cls)
        manager._setup(config, event_sink)
        manager._setup_groups(local_groups, recurrent_groups)
        manager._setup_tiers(tiers)
        return manager

    def _setup_tiers(self, tiers: TierConfig) -> None:
        if self._recurrents:
            raise ConfigError("tiers serve attention groups only: recurrent groups have no host or storage tier yet")
        for local in self._locals:
            local.require_block_per_position("a tiered manager")
        if not isinstance(tiers, TierConfig):
            raise ConfigError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
        per_group = tiers.group_host_blocks
        if per_group and len(per_group) != len(self._locals):
            raise ConfigError(
                f"group_host_blocks names {len(per_group)} groups, the manager has {len(self._locals)} local groups"
            )
        formats = tiers.group_entry_formats if tiers.storage is not None else ()
        if formats and len(formats) != len(self._locals):
            raise ConfigError(
                f"group_entry_formats names {len(formats)} groups, the manager has {len(self._locals)} local groups"
            )
        on = tiers.host_policy != "off"
        sink = self._tree.events
        kinds = self.group_kinds
        self._group_hosts = [
            HostTier(
                count,
                events=sink,
                group=number,
                group_kind=kinds[number],
                block_size=self._locals[number - 1].block_size,
            )
            if on and count
            else None
            for number, count in enumerate(per_group, 1)
        ] or [None for _ in self._locals]
        self._group_write_back = tiers.host_policy == "write-back"
        self._group_write_through = tiers.host_policy == "write-through"
        self._group_save_back = bool(formats) and tiers.storage_policy == "write-back"
        self._group_save_through = bool(formats) and tiers.storage_policy == "write-through"
        self._group_loads: dict[tuple[int, int], _HybridAdmission] = {}  # (local group, request) -> admission
        self._held_group_results: list[tuple[int, int, LoadOutcome]] = []
        self._group_probes: dict[Hashable, list[tuple[int, int]]] = {}  # sequence -> (local group, probe request)
        super()._setup_tiers(tiers)
        self._group_storages: list[StorageTier | None] = [
            self._local_storage(tiers, number, fmt) for number, fmt in enumerate(formats)
        ] or [None for _ in self._locals]

    def _local_storage(self, tiers: TierConfig, number: int, entry_format: object) -> StorageTier:
        """Local group ``number``'s (0-based) storage tier: the shared backend under the group's own keys."""
        config = self.config
        local = self._locals[number]
        base = namespace_tag(config.namespace, config.hash_scheme, config.block_size)
        tag = group_tag(base, number + 1, self.group_kinds[number + 1], local.block_size, local.span)
        return StorageTier(
            tiers,
            config.namespace,  # type: ignore[arg-type]
            config.hash_scheme,
            local.block_size,
            entry_format=entry_format,  # type: ignore[arg-type]
            tag=tag,
            owns_backend=False,  # group 0's tier closes the backend, after the local groups' tiers
            events=self._tree.events,
            group=number + 1,
            group_kind=self.group_kinds[number + 1],
        )

    def _new_plan(self, plan_id: int) -> _Plan:
        return _HybridPlan(plan_id, len(self._locals))

    def group_host(self, group: int) -> HostTier | None:
        """Group ``group``'s host tier (0: :attr:`host`); read it, change it only through the manager."""
        number = self._group(group)
        return self._host if number == 0 else self._group_hosts[number - 1]

    def group_storage(self, group: int) -> StorageTier | None:
        """Group ``group``'s storage tier (0: :attr:`storage`); a local group's has keys and a format of its own."""
        number = self._group(group)
        return self._storage if number == 0 else self._group_storages[number - 1]

    @property
    def num_pending_loads(self) -> int:
        """Storage reads of every group not yet reported by :meth:`poll_loads`."""
        return len(self._loads) + len(self._group_loads)

    # ------------------------------------------------------------------ registration

    def _registered(self, seq_id: Hashable, s: _Sequence) -> None:
        """As the tiered manager's; each local group's storage is also asked (off-thread) which blocks it holds."""
        super()._registered(seq_id, s)
        if s.skip_read or not self._caching or not any(self._group_storages):
            return
        limit = self._cacheable_blocks(s.content.num_tokens)
        probes = []
        for number, storage in enumerate(self._group_storages):
            if storage is None:
                continue
            local = self._locals[number]
            keys = local.keys(s.content.hashes)
            host = self._group_hosts[number]
            unknown = [
                key
                for key in (keys[p] for p in range(limit // local.ratio))
                if local.index.block_of(key) is None and (host is None or key not in host)
            ]
            request = storage.probe(unknown) if unknown else None
            if request is not None:
                probes.append((number, request))
        if probes:
            self._group_probes[seq_id] = probes

    def is_storage_check_pending(self, seq_id: Hashable) -> bool:
        """Whether a storage check :meth:`add_sequence` queued for ``seq_id``, in any group, is unanswered. Pure."""
        pending = super().is_storage_check_pending(seq_id)
        probes = self._group_probes.get(seq_id)
        if probes:
            left = [(n, r) for n, r in probes if not self._group_storages[n].is_answered(r)]  # type: ignore[union-attr]
            if left:
                self._group_probes[seq_id] = left
                return True
            del self._group_probes[seq_id]
        return pending

    def free(self, seq_id: Hashable) -> None:
        super().free(seq_id)
        self._group_probes.pop(seq_id, None)

    # ------------------------------------------------------------------ the hit over tiers

    def _tier_hit(self, s: _Sequence) -> tuple[int, int, list[int], int]:
        """(common hit, group 0's device run, its host run after that, its known-stored run after that),
        in chain blocks. Pure."""
        if not self._caching or s.skip_read:
            return 0, 0, [], 0
        content = s.content
        hashes = content.hashes
        device = self._tree.match_length(hashes, self._cacheable_blocks(content.num_tokens))
        host_blocks, stored = self._tier_runs(s, device)
        run = device + len(host_blocks) + stored
        if not run:
            return 0, 0, [], 0
        rules = [local.rule for local in self._locals]
        answers = [self._served(number, hashes) for number in range(len(self._locals))]
        size = self._block_size
        return longest_common_hit(rules, run * size, answers) // size, device, host_blocks, stored

    def _served(self, number: int, hashes: Sequence[BlockHash]) -> Callable[[int], bool]:
        """Whether local group ``number`` (0-based) holds block position ``p`` on device, in its host tier,
        or (known) in its storage."""
        local = self._locals[number]
        keys = local.keys(hashes)
        count = len(keys)
        on_device = local.index.block_of
        host = self._group_hosts[number]
        storage = self._group_storages[number]
        if storage is not None and not storage.healthy:
            storage = None  # a read timed out: no storage hits until the backend answers again
        if host is None and storage is None:
            return lambda p: p < count and on_device(keys[p]) is not None
        on_host = host.block_of if host is not None else _nowhere
        if storage is None:
            return lambda p: p < count and (on_device(keys[p]) is not None or on_host(keys[p]) is not None)
        stored = storage.is_known if storage is not None else _never

        def served(p: int) -> bool:
            if p >= count:
                return False
            key = keys[p]
            return on_device(key) is not None or on_host(key) is not None or stored(key)

        return served

    @staticmethod
    def _split(hit: int, device: int, host_blocks: list[int]) -> tuple[int, list[int], int]:
        """Group 0's device blocks, host blocks and storage loads of a ``hit``-block hit."""
        device = min(device, hit)
        host_part = host_blocks[: hit - device]
        return device, host_part, hit - device - len(host_part)

    def _cached(self, s: _Sequence) -> CachedTokens:
        """The common hit, reported as group 0's device / host / storage split. Pure."""
        hit, device, host_blocks, _ = self._tier_hit(s)
        device, host_part, loads = self._split(hit, device, host_blocks)
        size = self._block_size
        return CachedTokens(
            device=device * size,
            host=len(host_part) * size,
            storage=loads * size,
            num_prompt_tokens=s.content.num_tokens,
        )

    def _local_sources(self, seq_id: Hashable, s: _Sequence, hit: int) -> list[list[_Source]]:
        """Per local group, (position, block, where) for each block a ``hit``-block hit needs: on device,
        in its host tier, or (block -1) known stored. Pure.

        Raises :class:`StaleLookupError` when a group holds one of them nowhere (a caller-named hit below
        the one every group serves now)."""
        hashes = s.content.hashes
        out = []
        for number, local in enumerate(self._locals):
            keys = local.keys(hashes)
            host = self._group_hosts[number]
            storage = self._group_storages[number]
            sources = []
            for p in needed_blocks(local.rule, hit * self._block_size):
                key = keys[p]
                block = local.index.block_of(key)
                if block is not None:
                    sources.append((p, block, _DEVICE))
                    continue
                block = host.block_of(key) if host is not None else None
                if block is not None:
                    sources.append((p, block, _HOST))
                elif storage is not None and storage.healthy and storage.is_known(key):
                    sources.append((p, -1, _STORED))
                else:
                    raise StaleLookupError(
                        f"sequence {seq_id!r}: group {number + 1} no longer holds what the "
                        f"{hit * self._block_size}-token hit seen needs"
                    )
            out.append(sources)
        return out

    def blocks_short(self, seq_id: Hashable, num_new_tokens: int, *, num_lookahead_tokens: int = 0) -> int:
        s = self._get(seq_id)
        n = _count_arg(num_new_tokens, "num_new_tokens")
        k = _count_arg(num_lookahead_tokens, "num_lookahead_tokens")
        if s.table is not None:
            return HybridKVCacheManager.blocks_short(self, seq_id, n, num_lookahead_tokens=k)
        hit, device, _, _ = self._tier_hit(s)
        device = min(device, hit)
        size = self._block_size
        matched = self._tree.matched_blocks(s.content.hashes, device) if device else []
        need = (hit * size + n + k + size - 1) // size - device
        pool = self._pool
        short = need - (pool.num_free - pool.count_idle(matched) - self._reserve)
        for local, sources in zip(self._locals, self._local_sources(seq_id, s, hit), strict=True):
            kept = [b for _, b, where in sources if where == _DEVICE]
            fresh = local.blocks_for(device + need) - hit // local.ratio + len(sources) - len(kept)
            short = max(short, fresh - (local.pool.num_free - local.pool.count_idle(kept)))
        return max(0, short)

    # ------------------------------------------------------------------ admission

    def _admit(self, seq_id: Hashable, s: _Sequence, n: int, k: int, expected: int | None) -> BlockTable | None:
        """Every group takes the blocks the common hit needs: on device, or a new device block and a copy.

        All or nothing over the groups; pending until every copy is reported (see the module docstring).
        """
        size = self._block_size
        pool = self._pool
        hit, device, host_all, _ = self._tier_hit(s)
        if expected is not None:
            self._check_expected(seq_id, expected, hit)
            hit = expected
        device, host_blocks, num_loads = self._split(hit, device, host_all)
        matched = self._tree.matched_blocks(s.content.hashes, device) if device else []
        covered = hit * size + n
        need = (covered + k + size - 1) // size - device
        if need > pool.num_free - pool.count_idle(matched) - self._reserve:
            return None
        sources = self._local_sources(seq_id, s, hit)
        total = device + need
        for local, group_sources in zip(self._locals, sources, strict=True):
            kept = [b for _, b, where in group_sources if where == _DEVICE]
            fresh = local.blocks_for(total) - hit // local.ratio + len(group_sources) - len(kept)
            if fresh > local.pool.num_free - local.pool.count_idle(kept):
                return None
        # every group has room: take it
        if device:
            pool._acquire_valid(matched)
        if host_blocks:
            self._host.acquire(host_blocks)  # type: ignore[union-attr]  # before eviction can write back into host
        if need:
            matched += self._take(need)
        local_copies = [
            self._admit_local(s, number, group_sources, hit, total) for number, group_sources in enumerate(sources)
        ]
        local_swaps = [swaps for swaps, _ in local_copies]
        local_loads = [loads for _, loads in local_copies]
        s.table = matched
        s.view = BlockTable(matched, hit * size)
        s.num_covered = covered
        s.lookahead = k
        s.num_committed = device * size
        s.watch = self._coordinator.next_move(hit * size)  # type: ignore[union-attr]  # a hybrid manager has groups
        if not host_blocks and not num_loads and not any(local_swaps) and not any(local_loads):
            self._admitted(seq_id, CachedTokens(device=hit * size, num_prompt_tokens=s.content.num_tokens), s.preempted)
            return s.view
        return self._pend(seq_id, s, (device, host_blocks, num_loads), hit, local_swaps, local_loads)

    def _admit_local(
        self, s: _Sequence, number: int, sources: list[_Source], hit: int, total: int
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """Local group ``number`` (0-based) takes its table for an admission; returns its swap-ins
        (host block, device block, position) and its storage loads (device block, position)."""
        local = self._locals[number]
        kept = [b for _, b, where in sources if where == _DEVICE]
        from_host = [b for _, b, where in sources if where == _HOST]
        local.pool._acquire_valid(kept)
        if from_host:
            self._group_hosts[number].acquire(from_host)  # type: ignore[union-attr]  # before eviction writes back
        cached = hit // local.ratio  # a hit ends on a boundary of every group (hit_step)
        first = cached - len(sources)
        fresh = self._take_local(number, local.blocks_for(total) - cached + len(sources) - len(kept))
        table = [PLACEHOLDER] * first
        swaps = []
        loads = []
        taken = iter(fresh)
        for position, block, where in sources:
            if where == _DEVICE:
                table.append(block)
                continue
            target = next(taken)
            table.append(target)
            if where == _HOST:
                swaps.append((block, target, position))
            else:
                loads.append((target, position))
        table.extend(taken)
        local.set_table(id(s), table, hit * self._block_size, s.content.num_tokens)
        return swaps, loads

    def _pend(
        self,
        seq_id: Hashable,
        s: _Sequence,
        parts: tuple[int, list[int], int],
        hit: int,
        local_swaps: list[list[tuple[int, int, int]]],
        local_loads: list[list[tuple[int, int]]],
    ) -> AdmittedTable:
        """Record a pending admission and plan its copies (as the tiered manager does for group 0)."""
        device, host_blocks, num_loads = parts
        admission = _HybridAdmission(seq_id, s, parts, hit, local_swaps, local_loads)
        plan: _HybridPlan = self._open  # type: ignore[assignment]
        table: list[int] = s.table  # type: ignore[assignment]
        start = device + len(host_blocks)
        swap_ins = tuple(zip(host_blocks, table[device:start], strict=True))
        if host_blocks or any(local_swaps):
            admission.swap_plan = plan.id
        plan.swap_ins.extend((h, d, admission) for h, d in swap_ins)
        for number, swaps in enumerate(local_swaps):
            plan.group_swap_ins[number].extend((h, d, admission, p) for h, d, p in swaps)
        loaded = s.content.hashes[start : start + num_loads]
        view = AdmittedTable(
            table, swap_ins, tuple(zip(table[start : start + num_loads], loaded, strict=True)), hit * self._block_size
        )
        s.view = view
        if num_loads:
            self._start_load(admission, loaded)
        if any(local_loads):
            self._start_local_loads(admission)
        self._admissions[id(s)] = admission
        return view

    def _start_local_loads(self, admission: _HybridAdmission) -> None:
        """Queue each local group's storage read of an admission's blocks (reported by :meth:`poll_loads`)."""
        hashes = admission.seq.content.hashes
        admission.load_plan = self._open.id  # held until this step's plan was taken (its saves read first)
        for number, loads in enumerate(admission.local_loads):
            if not loads:
                continue
            storage: StorageTier = self._group_storages[number]  # type: ignore[assignment]
            keys = self._locals[number].keys(hashes)
            request = storage.load([keys[p] for _, p in loads])
            admission.local_requests[number] = request
            admission.deadline = max(admission.deadline, time.monotonic() + storage.timeout_s)
            self._group_loads[number, request] = admission

    def _take_local(self, number: int, count: int) -> list[int]:
        """``count`` fresh blocks of local group ``number``; what its index evicts moves to its host tier."""
        local = self._locals[number]
        pool = local.pool
        short = count - pool.num_fresh
        if short > 0:
            host = self._group_hosts[number]
            save_back = self._group_save_back
            if host is None and not save_back:  # nothing below wants the evicted content
                local.index.evict(short)
            else:
                hashes: list[BlockHash] = []
                evicted = local.index.evict(short, hashes)
                for block, block_hash in zip(evicted, hashes, strict=True):
                    if host is not None:
                        if block_hash in host:
                            host.touch(block_hash)
                            continue
                        if self._group_write_back:
                            if self._copy_local(number, block, block_hash):
                                continue
                            self._counts.write_backs_without_host_room += 1
                    if save_back:
                        self._plan_local_save(number, "device", block, block_hash)
                if self._tier_events:
                    self._publish_tier_events()
        return pool.take_fresh(count)

    def _copy_local(self, number: int, block: int, block_hash: BlockHash) -> bool:
        reserved = self._group_hosts[number].reserve(block_hash)  # type: ignore[union-attr]
        if reserved is None:
            return False
        host_block, evicted = reserved
        if evicted is not None and self._group_save_back:
            self._plan_local_save(number, "host", host_block, evicted)  # saved before the swap-out overwrites it
        self._open.group_swap_outs[number].append((block, host_block, block_hash))  # type: ignore[attr-defined]
        return True

    def _plan_local_save(self, number: int, tier: str, block: int, block_hash: BlockHash) -> None:
        """Queue local group ``number``'s ``block`` for its storage in the open plan unless known stored."""
        storage = self._group_storages[number]
        plan: _HybridPlan = self._open  # type: ignore[assignment]
        if storage is None or storage.is_known(block_hash) or block_hash in plan.group_queued[number]:
            return
        plan.group_saves[number].append(BlockSave(tier, block, block_hash))
        plan.group_queued[number].add(block_hash)
        self._counts.saves_planned += 1

    def _window_tokens(self, s: _Sequence) -> int:
        """A pending admission holds its windows at the hit it will have, not at its device prefix."""
        admission = self._admissions.get(id(s))
        return admission.hit * self._block_size if isinstance(admission, _HybridAdmission) else s.num_committed

    # ------------------------------------------------------------------ commit and release

    def _commit(self, s: _Sequence, n: int) -> None:
        before = s.num_committed
        super()._commit(s, n)
        if not ((self._group_write_through or self._group_save_through) and self._caching):
            return
        hashes = s.content.hashes
        for number, local in enumerate(self._locals):
            host = self._group_hosts[number] if self._group_write_through else None
            save = self._group_save_through and self._group_storages[number] is not None
            if host is None and not save:
                continue
            keys = local.keys(hashes)
            for position in range(before // local.block_size, n // local.block_size):
                block_hash = keys[position]
                block = local.index.block_of(block_hash)
                if block is None:
                    continue
                if host is not None and block_hash not in host and not self._copy_local(number, block, block_hash):
                    self._counts.write_backs_without_host_room += 1
                if save:
                    self._plan_local_save(number, "device", block, block_hash)
        if self._tier_events:
            self._publish_tier_events()

    def _release(self, s: _Sequence) -> None:
        if s.table is None:
            return
        key = id(s)
        admission = self._admissions.get(key)
        defer_to: _HybridPlan | None = None
        if isinstance(admission, _HybridAdmission) and admission.local_ok is None:  # local copies not reported
            if admission.swap_plan == self._open.id:  # not handed out yet: drop them
                plan: _HybridPlan = self._open  # type: ignore[assignment]
                for number, swaps in enumerate(admission.local_swaps):
                    if swaps:
                        plan.group_swap_ins[number] = [e for e in plan.group_swap_ins[number] if e[2] is not admission]
                        self._group_hosts[number].release(h for h, _, _ in swaps)  # type: ignore[union-attr]
            else:
                defer_to = self._inflight[admission.swap_plan]  # type: ignore[assignment]
        for number, local in enumerate(self._locals):
            table = local.pop_table(key)
            order = [b for b in reversed(table) if b != PLACEHOLDER]
            if defer_to is not None:
                defer_to.group_deferred[number].append(order)  # blocks a copy in flight writes into
            else:
                local.pool._release_valid(order)
        super()._release(s)

    def _cancel_admission(self, s: _Sequence) -> _Plan | None:
        """As the tiered manager's; a local group's storage read still queued is skipped, a late one dropped."""
        admission = self._admissions.get(id(s))
        if isinstance(admission, _HybridAdmission):
            for number, request in enumerate(admission.local_requests):
                if request >= 0 and self._group_loads.pop((number, request), None) is not None:
                    self._group_storages[number].cancel(request)  # type: ignore[union-attr]
        return super()._cancel_admission(s)

    # ------------------------------------------------------------------ transfers

    def complete_transfers(
        self,
        plan: TransferPlan,
        *,
        saved: Mapping[int, Sequence[object]] | Sequence[object] | None = None,
        failed_swap_ins: Mapping[int, Collection[int]] | Collection[int] = (),
        failed_swap_outs: Mapping[int, Collection[int]] | Collection[int] = (),
        saved_groups: Mapping[int, Sequence[object]] | None = None,
        failed_group_swap_ins: Mapping[int, Collection[int]] | None = None,
        failed_group_swap_outs: Mapping[int, Collection[int]] | None = None,
    ) -> None:
        """As :meth:`TieredKVCacheManager.complete_transfers`, each argument mapping a group (0: full
        attention, then the local groups) to the payloads of its ``group_transfers[g].saves`` (without
        them they are dropped and counted) or to its device / host blocks whose copy failed.

        ``saved_groups``, ``failed_group_swap_ins`` and ``failed_group_swap_outs`` (the groups after 0,
        beside bare group-0 figures) are the previous release's form, still taken. Every argument is
        checked before anything changes (a wrong payload in any group: the plan can be completed again).
        A failed copy in any group cuts the admission's hit back to the longest one every group still
        serves with what landed.
        """
        groups = 1 + len(self._locals)
        saved_0: Sequence[object] | None
        saved_0, more_saved = per_group(saved, "saved", groups)
        failed_swap_ins, more_in = per_group(failed_swap_ins, "failed_swap_ins", groups, ())
        failed_swap_outs, more_out = per_group(failed_swap_outs, "failed_swap_outs", groups, ())
        saved_groups = _one_form(saved_groups, more_saved, "saved")
        failed_group_swap_ins = _one_form(failed_group_swap_ins, more_in, "failed_swap_ins")
        failed_group_swap_outs = _one_form(failed_group_swap_outs, more_out, "failed_swap_outs")
        failed_in = set(failed_swap_ins)
        failed_out = set(failed_swap_outs)
        state: _HybridPlan | None = self._completing(plan, failed_in, failed_out)  # type: ignore[assignment]
        group_in = self._group_failures(failed_group_swap_ins, state, "swap_ins")
        group_out = self._group_failures(failed_group_swap_outs, state, "swap_outs")
        payloads = self._group_payloads(saved_groups, state)
        if state is None:
            return
        if saved_0 is not None and state.saves:  # group 0's, checked before any group changes
            self._storage.check_payloads([save.block_hash for save in state.saves], saved_0)  # type: ignore[union-attr]
        for number, saves in enumerate(state.group_saves):
            if not saves:
                continue
            given = payloads[number]
            if given is None:
                self._counts.saves_without_payload += len(saves)
            else:
                self._group_storages[number].save([save.block_hash for save in saves], given)  # type: ignore[union-attr]
        for number, outs in enumerate(state.group_swap_outs):
            host = self._group_hosts[number]
            for _, host_block, block_hash in outs:
                host.complete(block_hash, host_block, host_block not in group_out[number])  # type: ignore[union-attr]
        reported: list[_HybridAdmission] = []
        for number, ins in enumerate(state.group_swap_ins):
            if ins:
                self._group_hosts[number].release(h for h, _, _, _ in ins)  # type: ignore[union-attr]
            for _, device_block, admission, position in ins:
                if admission.local_ok is None:
                    admission.local_ok = [set() for _ in self._locals]
                    reported.append(admission)
                if device_block not in group_in[number]:
                    admission.local_ok[number].add(position)
        for number, local in enumerate(self._locals):
            for order in state.group_deferred[number]:
                local.pool._release_valid(order)
        super().complete_transfers(plan, saved=saved_0, failed_swap_ins=failed_in, failed_swap_outs=failed_out)
        for admission in reported:  # those with no group-0 swap-in in this plan
            if not admission.cancelled and self._admissions.get(id(admission.seq)) is admission:
                self._finish(admission)

    def _group_payloads(
        self, saved: Mapping[int, Sequence[object]] | None, state: _HybridPlan | None
    ) -> list[Sequence[object] | None]:
        """Per local group, the payloads given for its saves (None: none given); checked, changes nothing."""
        out: list[Sequence[object] | None] = [None for _ in self._locals]
        if not saved:
            return out
        if not isinstance(saved, Mapping):
            raise InvalidArgumentError("saved_groups must map a local group's index to its saves' payloads")
        for group, given in saved.items():
            if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= len(self._locals):
                raise InvalidArgumentError(f"saved_groups: {group!r} is not a local group's index")
            saves = state.group_saves[group - 1] if state is not None else []
            if not saves:
                continue  # as for group 0: payloads of a plan without saves are ignored
            if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
                raise InvalidArgumentError(f"saved_groups[{group}] must be a sequence of payloads, one per save")
            self._group_storages[group - 1].check_payloads([save.block_hash for save in saves], given)  # type: ignore[union-attr]
            out[group - 1] = given
        return out

    def _group_failures(
        self, failed: Mapping[int, Collection[int]] | None, state: _HybridPlan | None, which: str
    ) -> list[set[int]]:
        """Per local group, the failed blocks named for ``which`` of ``state``; checked, changes nothing."""
        out: list[set[int]] = [set() for _ in self._locals]
        if not failed:
            return out
        if not isinstance(failed, Mapping):
            raise InvalidArgumentError(f"failed_group_{which} must map a local group's index to blocks")
        for group, blocks in failed.items():
            if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= len(self._locals):
                raise InvalidArgumentError(f"failed_group_{which}: {group!r} is not a local group's index")
            entries = (
                (state.group_swap_ins if which == "swap_ins" else state.group_swap_outs)[group - 1] if state else []
            )
            targets = {e[1] for e in entries}
            named = set(blocks)
            if not named <= targets:
                raise InvalidArgumentError(
                    f"failed_group_{which}[{group}] {sorted(named)} are not {which[:-1]} targets of this plan"
                )
            out[group - 1] = named
        return out

    def poll_loads(self) -> list[LoadResult]:
        """Storage reads of every group that finished (or timed out) since the last poll. Never waits.

        Group 0's results first, as the tiered manager reports them; then each local group's, with
        ``group`` set (its ``blocks`` are that group's device blocks). An admission settles once every
        group's reads and copies are reported.
        """
        results = super().poll_loads()
        if not any(self._group_storages):
            return results
        taken = self._open.id  # plans with a smaller id were handed out
        held, self._held_group_results = self._held_group_results, []
        finished = [
            (number, request, outcome)
            for number, storage in enumerate(self._group_storages)
            if storage is not None
            for request, outcome in storage.take_results()
        ]
        for number, request, outcome in held + finished:
            admission = self._group_loads.get((number, request))
            if admission is None:
                continue  # cancelled or timed out: its blocks may belong to someone else now
            if admission.load_plan >= taken:
                self._held_group_results.append((number, request, outcome))
                continue
            del self._group_loads[number, request]
            results.append(self._local_loaded(admission, number, outcome, timed_out=False))
        now = time.monotonic()
        for (number, request), admission in list(self._group_loads.items()):
            if admission.deadline <= now and admission.load_plan < taken:
                del self._group_loads[number, request]
                storage: StorageTier = self._group_storages[number]  # type: ignore[assignment]
                storage.cancel(request)
                storage.note_timeout(len(admission.local_loads[number]))
                results.append(self._local_loaded(admission, number, LoadOutcome(()), timed_out=True))
        return results

    def _local_loaded(
        self, admission: _HybridAdmission, number: int, outcome: LoadOutcome, *, timed_out: bool
    ) -> LoadResult:
        """Local group ``number``'s read of ``admission`` is reported: its leading run landed."""
        loads = admission.local_loads[number]
        payloads = outcome.payloads[: len(loads)]
        landed = loads[: len(payloads)]
        admission.local_loaded[number] = {p for _, p in landed}
        admission.local_requests[number] = -1
        result = LoadResult(
            admission.seq_id, tuple(d for d, _ in landed), payloads, len(loads), timed_out, group=number + 1
        )
        self._finish(admission)
        return result

    def _settled(self, admission: _Admission) -> bool:
        hybrid: _HybridAdmission = admission  # type: ignore[assignment]
        return super()._settled(admission) and hybrid.local_ok is not None and None not in hybrid.local_loaded

    def _loads_useless(self, admission: _Admission) -> bool:
        if super()._loads_useless(admission):
            return True
        hybrid: _HybridAdmission = admission  # type: ignore[assignment]
        if hybrid.local_ok is None or None in hybrid.local_loaded:
            return False
        start = admission.device + len(admission.host_blocks)
        return self._common_usable(hybrid, hybrid.hit) <= start

    def _usable_hit(self, admission: _Admission) -> int:
        return self._common_usable(admission, super()._usable_hit(admission))  # type: ignore[arg-type]

    def _common_usable(self, admission: _HybridAdmission, group0: int) -> int:
        """The longest hit at most ``group0`` blocks that every local group serves with the blocks it got."""
        ok: list[set[int]] = admission.local_ok  # type: ignore[assignment]
        loaded: list[set[int]] = admission.local_loaded  # type: ignore[assignment]  # settled
        failed = any(len(done) < len(swaps) for done, swaps in zip(ok, admission.local_swaps, strict=True)) or any(
            len(got) < len(loads) for got, loads in zip(loaded, admission.local_loads, strict=True)
        )
        if not failed and group0 == admission.hit:
            return group0
        answers = []
        for number, local in enumerate(self._locals):
            moved = {p for _, _, p in admission.local_swaps[number]} | {p for _, p in admission.local_loads[number]}
            held = {p for p in needed_blocks(local.rule, admission.hit * self._block_size) if p not in moved}
            held |= ok[number] | loaded[number]
            answers.append(held.__contains__)
        size = self._block_size
        return longest_common_hit([local.rule for local in self._locals], group0 * size, answers) // size

    def _cut_back(self, s: _Sequence, valid: int) -> None:
        super()._cut_back(s, valid)
        key = id(s)
        tokens = valid * self._block_size
        for local in self._locals:
            local.cut_back(key, tokens)

    def _finish(self, admission: _Admission) -> None:
        """As the tiered manager's; the local blocks whose copies landed become findable too."""
        super()._finish(admission)
        s = admission.seq
        if id(s) in self._admissions or s.table is None or not self._caching:
            return
        hashes = s.content.hashes
        for local in self._locals:
            key = id(s)
            local.index_committed(key, hashes, s.num_committed)

    # ------------------------------------------------------------------ events

    def _publish_tier_events(self) -> None:
        """Emit what every group's host and storage tiers noted (with a sink only, on the manager's thread)."""
        super()._publish_tier_events()
        for host in self._group_hosts:
            if host is not None:
                host.publish()
        for storage in self._group_storages:
            if storage is not None:
                storage.publish()

    def snapshot_events(self) -> list[BlockStored]:
        """Every group's device contents (:meth:`HybridKVCacheManager.snapshot_events`), then each group's
        host and storage contents, as tagged ``BlockStored`` events. Pure; needs the manager's sink."""
        events = HybridKVCacheManager.snapshot_events(self) + self._tier_snapshot()
        for host in self._group_hosts:
            if host is not None:
                events += host.snapshot_events()
        for storage in self._group_storages:
            if storage is not None:
                events += storage.snapshot_events()
        return events

    # ------------------------------------------------------------------ maintenance and checks

    def reset_prefix_cache(self) -> bool:
        """Also empties the local groups' host tiers; refused while their copies are pending."""
        if any(self._open.group_swap_outs) or not super().reset_prefix_cache():  # type: ignore[attr-defined]
            return False
        for host in self._group_hosts:
            if host is not None:
                host.clear()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every group's queued storage writes are done (shutdown, tests). True if they are."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = True
        for storage in (*self._group_storages, self._storage):
            if storage is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                done = storage.flush(left) and done
        return done

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop every group's storage threads (queued writes get ``timeout`` seconds each), then close the
        backend (group 0's tier owns it)."""
        for storage in self._group_storages:
            if storage is not None:
                storage.close(timeout)
        super().close(timeout)

    def check_integrity(self) -> None:
        """The tiered checks for group 0, and per local group: pool, index, tables (deferred releases
        counted), host tier, the pending copies and storage reads."""
        super().check_integrity()  # the tiered checks (group 0), then the hybrid ones (every group's tables)
        plans: list[_HybridPlan] = [self._open, *self._inflight.values()]  # type: ignore[list-item]
        for number, local in enumerate(self._locals):
            self._check_local(number, local, plans)
            self._check_local_loads(number, local)

    def _check_local_loads(self, number: int, local: LocalGroupManager) -> None:
        """Local group ``number``'s pending storage reads belong to pending admissions and fill their tables."""
        group = number + 1
        for (load_group, request), reader in self._group_loads.items():
            if load_group == number and (
                self._admissions.get(id(reader.seq)) is not reader or reader.local_requests[number] != request
            ):
                raise IntegrityError(f"group {group}: storage read {request} belongs to no pending admission")
        for admission in self._admissions.values():
            hybrid: _HybridAdmission = admission  # type: ignore[assignment]  # every admission here is one
            request = hybrid.local_requests[number]
            if request >= 0 and self._group_loads.get((number, request)) is not hybrid:
                raise IntegrityError(f"group {group}: {admission.seq_id!r}'s storage read is not tracked")
            if hybrid.local_loaded[number] is not None:
                continue
            table = local.tables[id(admission.seq)]
            for device_block, position in hybrid.local_loads[number]:
                if table[position] != device_block:
                    raise IntegrityError(f"group {group}: {admission.seq_id!r} lost the block a load fills")
                if local.index.hash_of(device_block) is not None:
                    raise IntegrityError(f"group {group}: block {device_block} is findable before its load landed")

    def _count_other_local_holders(self, index: int, expected: list[int]) -> None:
        """Blocks of a local group held for a plan's deferred release (a sequence freed mid-copy)."""
        for plan in (self._open, *self._inflight.values()):
            for order in plan.group_deferred[index]:  # type: ignore[attr-defined]
                for block in order:
                    expected[block] += 1

    def _check_local(self, number: int, local: LocalGroupManager, plans: list[_HybridPlan]) -> None:
        """A local group's host tier and pending copies agree with the plans (its tables: the hybrid check)."""
        group = number + 1
        host = self._group_hosts[number]
        holders = [0] * (host.pool.num_blocks if host is not None else 0)
        for plan in plans:
            for host_block, *_ in plan.group_swap_ins[number]:
                holders[host_block] += 1
            for _, host_block, _ in plan.group_swap_outs[number]:
                holders[host_block] += 1
        if host is None:
            if holders or any(plan.group_swap_ins[number] or plan.group_swap_outs[number] for plan in plans):
                raise IntegrityError(f"a plan moves group {group}'s blocks to or from a host tier it does not have")
            return
        host.check_integrity()
        for b, count in enumerate(holders):
            if host.pool.ref_count(b) != count:
                raise IntegrityError(
                    f"group {group}: host block {b} has {host.pool.ref_count(b)} refs, {count} holders"
                )
        for admission in self._admissions.values():
            hybrid: _HybridAdmission = admission  # type: ignore[assignment]
            table = local.tables[id(admission.seq)]
            for _, device_block, position in hybrid.local_swaps[number]:
                if table[position] != device_block:
                    raise IntegrityError(f"group {group}: {admission.seq_id!r} lost the block a swap-in fills")
                if local.index.hash_of(device_block) is not None:
                    raise IntegrityError(f"group {group}: block {device_block} is findable before its copy landed")


def _one_form(old: Mapping[int, Any] | None, new: dict[int, Any], what: str) -> Mapping[int, Any] | None:
    """The other groups' figures, given per group in ``what`` or (the previous release's form) apart."""
    if new and old:
        raise InvalidArgumentError(f"give the groups' {what} in one mapping, not also in the previous keyword")
    return new or old


def _nowhere(block_hash: BlockHash) -> int | None:
    """A tier that holds nothing."""
    return None


def _never(block_hash: BlockHash) -> bool:
    """A storage tier that knows of nothing."""
    return False
