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
    allocate group 0: swap-ins h->n2, h->n3 (plan.swap_ins); group 1: h->m2 (plan.groups[0].swap_ins)

* The hit is the longest prefix every group serves when a group "serves" a block it holds on device
  or in its host tier (group 0 also what storage is known to hold): :func:`longest_common_hit` over
  those answers. :class:`~kvblocks.CachedTokens` reports group 0's device / host / storage split of
  that hit.
* An admission gives every group's needed blocks that are not on device a device block and a
  swap-in (group 0 also storage loads), in every group or none. The sequence is pending until every
  copy is reported (``complete_transfers``, ``poll_loads``). A failed copy in any group cuts the hit
  back to the longest one every group still serves with the blocks whose copies landed; the rest of
  every table goes back and the engine allocates those tokens again.
* Storage serves group 0 only: a local group's block under the same hash holds other KV, and local
  groups have no storage tier yet. A storage block counts only where every local group serves the
  hit from device or host.
* Recurrent groups are refused (:class:`~kvblocks.errors.ConfigError`): their checkpoints have no
  host tier yet.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence

from kvblocks.accounting import CachedTokens
from kvblocks.config import CacheConfig
from kvblocks.errors import ConfigError, IntegrityError, InvalidArgumentError, StaleLookupError
from kvblocks.events import EventSink
from kvblocks.hashing import DEFAULT_SCHEME, BlockHash, Namespace
from kvblocks.hybrid.hits import longest_common_hit, needed_blocks
from kvblocks.hybrid.manager import PLACEHOLDER, HybridKVCacheManager, LocalGroup, _Local
from kvblocks.hybrid.recurrent import RecurrentGroup
from kvblocks.manager import BlockTable, _count_arg, _Sequence
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.manager import TieredKVCacheManager, _Admission, _Plan
from kvblocks.tiers.transfers import AdmittedTable, GroupTransfers, TransferPlan

__all__ = ["TieredHybridKVCacheManager"]

_LocalSwap = tuple[int, int, "_HybridAdmission", int]  # host block, device block, admission, group position


class _HybridAdmission(_Admission):
    """A pending admission of a hybrid sequence: group 0's copies, and each local group's swap-ins."""

    __slots__ = ("hit", "local_ok", "local_swaps")

    def __init__(
        self,
        seq_id: Hashable,
        seq: _Sequence,
        parts: tuple[int, list[int], int],
        hit: int,
        local_swaps: list[list[tuple[int, int, int]]],
    ) -> None:
        device, host_blocks, num_loads = parts
        super().__init__(seq_id, seq, device, host_blocks, num_loads)
        self.hit = hit  # chain blocks every group serves once its copies land
        self.local_swaps = local_swaps  # per local group: (host block, device block, group position)
        # per local group, the positions whose swap-in landed; None until the plan holding them completes
        self.local_ok: list[set[int]] | None = None if any(local_swaps) else [set() for _ in local_swaps]


class _HybridPlan(_Plan):
    """A step's plan with each local group's swap-outs, swap-ins and deferred releases."""

    __slots__ = ("group_deferred", "group_swap_ins", "group_swap_outs")

    def __init__(self, plan_id: int, num_locals: int) -> None:
        super().__init__(plan_id)
        self.group_swap_outs: list[list[tuple[int, int, BlockHash]]] = [[] for _ in range(num_locals)]
        self.group_swap_ins: list[list[_LocalSwap]] = [[] for _ in range(num_locals)]
        self.group_deferred: list[list[list[int]]] = [[] for _ in range(num_locals)]

    def busy(self) -> bool:
        return super().busy() or any(self.group_swap_outs) or any(self.group_swap_ins) or any(self.group_deferred)

    def frozen(self) -> TransferPlan:
        base = super().frozen()
        groups = tuple(
            GroupTransfers(
                number,
                tuple((d, h) for d, h, _ in outs),
                tuple((h, d) for h, d, _, _ in ins),
            )
            for number, (outs, ins) in enumerate(zip(self.group_swap_outs, self.group_swap_ins, strict=True), 1)
        )
        return TransferPlan(base.id, base.saves, base.swap_outs, base.swap_ins, groups)


class TieredHybridKVCacheManager(TieredKVCacheManager, HybridKVCacheManager):
    """A hybrid manager (full attention + local groups) whose evicted blocks live on in host tiers and storage.

    >>> from kvblocks.tiers import TierConfig
    >>> m = TieredHybridKVCacheManager(
    ...     5, 4, tiers=TierConfig(num_host_blocks=8, group_host_blocks=(8,)),
    ...     local_groups=[LocalGroup("sliding_window", span=6, num_blocks=5)])
    >>> m.add_sequence("a", list(range(17))); _ = m.allocate("a", 17); m.commit("a", 17); m.free("a")
    >>> m.add_sequence("b", list(range(100, 117))); _ = m.allocate("b", 17)   # evicts a's blocks in both groups
    >>> plan = m.take_transfers(); len(plan.swap_outs), len(plan.groups[0].swap_outs)
    (4, 4)
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
        if not isinstance(tiers, TierConfig):
            raise ConfigError(f"tiers must be a TierConfig, got {type(tiers).__name__}")
        per_group = tiers.group_host_blocks
        if per_group and len(per_group) != len(self._locals):
            raise ConfigError(
                f"group_host_blocks names {len(per_group)} groups, the manager has {len(self._locals)} local groups"
            )
        on = tiers.host_policy != "off"
        self._group_hosts = [HostTier(count) if on and count else None for count in per_group] or [
            None for _ in self._locals
        ]
        self._group_write_back = tiers.host_policy == "write-back"
        self._group_write_through = tiers.host_policy == "write-through"
        super()._setup_tiers(tiers)

    def _new_plan(self, plan_id: int) -> _Plan:
        return _HybridPlan(plan_id, len(self._locals))

    def group_host(self, group: int) -> HostTier | None:
        """Group ``group``'s host tier (0: :attr:`host`); read it, change it only through the manager."""
        number = self._group(group)
        return self._host if number == 0 else self._group_hosts[number - 1]

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
        """Whether local group ``number`` (0-based) holds block position ``p`` on device or in its host tier."""
        local = self._locals[number]
        keys = local.keys(hashes)
        count = len(keys)
        on_device = local.index.block_of
        host = self._group_hosts[number]
        if host is None:
            return lambda p: p < count and on_device(keys[p]) is not None
        on_host = host.block_of
        return lambda p: p < count and (on_device(keys[p]) is not None or on_host(keys[p]) is not None)

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

    def _local_sources(self, seq_id: Hashable, s: _Sequence, hit: int) -> list[list[tuple[int, int, bool]]]:
        """Per local group, (position, block, on device) for each block a ``hit``-block hit needs. Pure.

        Raises :class:`StaleLookupError` when a group holds one of them nowhere (a caller-named hit below
        the one every group serves now)."""
        hashes = s.content.hashes
        out = []
        for number, local in enumerate(self._locals):
            keys = local.keys(hashes)
            host = self._group_hosts[number]
            sources = []
            for p in needed_blocks(local.rule, hit * self._block_size):
                block = local.index.block_of(keys[p])
                if block is not None:
                    sources.append((p, block, True))
                    continue
                block = host.block_of(keys[p]) if host is not None else None
                if block is None:
                    raise StaleLookupError(
                        f"sequence {seq_id!r}: group {number + 1} no longer holds what the "
                        f"{hit * self._block_size}-token hit seen needs"
                    )
                sources.append((p, block, False))
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
            kept = [b for _, b, on_device in sources if on_device]
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
            kept = [b for _, b, on_device in group_sources if on_device]
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
        local_swaps = [
            self._admit_local(s, number, group_sources, hit, total) for number, group_sources in enumerate(sources)
        ]
        s.table = matched
        s.view = BlockTable(matched, hit * size)
        s.num_covered = covered
        s.lookahead = k
        s.num_committed = device * size
        self._watch(s, hit * size)
        if not host_blocks and not num_loads and not any(local_swaps):
            self._admitted(seq_id, CachedTokens(device=hit * size, num_prompt_tokens=s.content.num_tokens), s.preempted)
            return s.view
        return self._pend(seq_id, s, (device, host_blocks, num_loads), hit, local_swaps)

    def _admit_local(
        self, s: _Sequence, number: int, sources: list[tuple[int, int, bool]], hit: int, total: int
    ) -> list[tuple[int, int, int]]:
        """Local group ``number`` (0-based) takes its table for an admission; returns its swap-ins."""
        local = self._locals[number]
        kept = [b for _, b, on_device in sources if on_device]
        from_host = [b for _, b, on_device in sources if not on_device]
        local.pool._acquire_valid(kept)
        if from_host:
            self._group_hosts[number].acquire(from_host)  # type: ignore[union-attr]  # before eviction writes back
        cached = hit // local.ratio  # a hit ends on a boundary of every group (hit_step)
        first = cached - len(sources)
        fresh = self._take_local(number, local.blocks_for(total) - cached + len(from_host))
        table = [PLACEHOLDER] * first
        swaps = []
        taken = iter(fresh)
        for position, block, on_device in sources:
            if on_device:
                table.append(block)
            else:
                target = next(taken)
                table.append(target)
                swaps.append((block, target, position))
        table.extend(taken)
        local.tables[id(s)] = table
        local.released[id(s)] = first
        return swaps

    def _pend(
        self,
        seq_id: Hashable,
        s: _Sequence,
        parts: tuple[int, list[int], int],
        hit: int,
        local_swaps: list[list[tuple[int, int, int]]],
    ) -> AdmittedTable:
        """Record a pending admission and plan its copies (as the tiered manager does for group 0)."""
        device, host_blocks, num_loads = parts
        admission = _HybridAdmission(seq_id, s, parts, hit, local_swaps)
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
        self._admissions[id(s)] = admission
        return view

    def _take_local(self, number: int, count: int) -> list[int]:
        """``count`` fresh blocks of local group ``number``; what its index evicts moves to its host tier."""
        local = self._locals[number]
        pool = local.pool
        short = count - pool.num_fresh
        if short > 0:
            host = self._group_hosts[number]
            if host is None:
                local.index.evict(short)
            else:
                hashes: list[BlockHash] = []
                evicted = local.index.evict(short, hashes)
                for block, block_hash in zip(evicted, hashes, strict=True):
                    if block_hash in host:
                        host.touch(block_hash)
                    elif self._group_write_back and not self._copy_local(number, block, block_hash):
                        self._counts.write_backs_without_host_room += 1
        return pool.take_fresh(count)

    def _copy_local(self, number: int, block: int, block_hash: BlockHash) -> bool:
        reserved = self._group_hosts[number].reserve(block_hash)  # type: ignore[union-attr]
        if reserved is None:
            return False
        self._open.group_swap_outs[number].append((block, reserved[0], block_hash))  # type: ignore[attr-defined]
        return True

    def _window_tokens(self, s: _Sequence) -> int:
        """A pending admission holds its windows at the hit it will have, not at its device prefix."""
        admission = self._admissions.get(id(s))
        return admission.hit * self._block_size if isinstance(admission, _HybridAdmission) else s.num_committed

    # ------------------------------------------------------------------ commit and release

    def _commit(self, s: _Sequence, n: int) -> None:
        before = s.num_committed
        super()._commit(s, n)
        if not (self._group_write_through and self._caching):
            return
        hashes = s.content.hashes
        for number, local in enumerate(self._locals):
            host = self._group_hosts[number]
            if host is None:
                continue
            keys = local.keys(hashes)
            for position in range(before // local.block_size, n // local.block_size):
                block_hash = keys[position]
                block = local.index.block_of(block_hash)
                if block is not None and block_hash not in host and not self._copy_local(number, block, block_hash):
                    self._counts.write_backs_without_host_room += 1

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
            table = local.tables.pop(key)
            del local.released[key]
            order = [b for b in reversed(table) if b != PLACEHOLDER]
            if defer_to is not None:
                defer_to.group_deferred[number].append(order)  # blocks a copy in flight writes into
            else:
                local.pool._release_valid(order)
        super()._release(s)

    # ------------------------------------------------------------------ transfers

    def complete_transfers(
        self,
        plan: TransferPlan,
        *,
        saved: Sequence[object] | None = None,
        failed_swap_ins: Collection[int] = (),
        failed_swap_outs: Collection[int] = (),
        failed_group_swap_ins: Mapping[int, Collection[int]] | None = None,
        failed_group_swap_outs: Mapping[int, Collection[int]] | None = None,
    ) -> None:
        """As :meth:`TieredKVCacheManager.complete_transfers`; ``failed_group_swap_ins`` /
        ``failed_group_swap_outs`` map a local group's index to its device / host blocks whose copy failed.

        A failed copy in any group cuts the admission's hit back to the longest one every group still
        serves with what landed.
        """
        failed_in = set(failed_swap_ins)
        failed_out = set(failed_swap_outs)
        state: _HybridPlan | None = self._completing(plan, failed_in, failed_out)  # type: ignore[assignment]
        group_in = self._group_failures(failed_group_swap_ins, state, "swap_ins")
        group_out = self._group_failures(failed_group_swap_outs, state, "swap_outs")
        if state is None:
            return
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
        super().complete_transfers(plan, saved=saved, failed_swap_ins=failed_in, failed_swap_outs=failed_out)
        for admission in reported:  # those with no group-0 swap-in in this plan
            if not admission.cancelled and self._admissions.get(id(admission.seq)) is admission:
                self._finish(admission)

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

    def _settled(self, admission: _Admission) -> bool:
        return super()._settled(admission) and admission.local_ok is not None  # type: ignore[attr-defined]

    def _loads_useless(self, admission: _Admission) -> bool:
        if super()._loads_useless(admission):
            return True
        hybrid: _HybridAdmission = admission  # type: ignore[assignment]
        if hybrid.local_ok is None:
            return False
        start = admission.device + len(admission.host_blocks)
        return self._common_usable(hybrid, hybrid.hit) <= start

    def _usable_hit(self, admission: _Admission) -> int:
        return self._common_usable(admission, super()._usable_hit(admission))  # type: ignore[arg-type]

    def _common_usable(self, admission: _HybridAdmission, group0: int) -> int:
        """The longest hit at most ``group0`` blocks that every local group serves with the blocks it got."""
        ok: list[set[int]] = admission.local_ok  # type: ignore[assignment]
        failed = any(len(done) < len(swaps) for done, swaps in zip(ok, admission.local_swaps, strict=True))
        if not failed and group0 == admission.hit:
            return group0
        answers = []
        for number, local in enumerate(self._locals):
            moved = {p for _, _, p in admission.local_swaps[number]}
            held = {p for p in needed_blocks(local.rule, admission.hit * self._block_size) if p not in moved}
            held |= ok[number]
            answers.append(held.__contains__)
        size = self._block_size
        return longest_common_hit([local.rule for local in self._locals], group0 * size, answers) // size

    def _cut_back(self, s: _Sequence, valid: int) -> None:
        super()._cut_back(s, valid)
        key = id(s)
        tokens = valid * self._block_size
        for local in self._locals:
            table = local.tables[key]
            first = local.first_needed(tokens)
            end = local.blocks_for(valid)
            leaving = [b for b in table[:first] if b != PLACEHOLDER]
            dropped = [b for b in reversed(table[end:]) if b != PLACEHOLDER]
            table[:] = [PLACEHOLDER] * first + table[first:end]
            local.pool._release_valid(leaving)
            local.pool._release_valid(dropped)
            local.released[key] = first

    def _finish(self, admission: _Admission) -> None:
        """As the tiered manager's; the local blocks whose copies landed become findable too."""
        super()._finish(admission)
        s = admission.seq
        if id(s) in self._admissions or s.table is None or not self._caching:
            return
        hashes = s.content.hashes
        for local in self._locals:
            key = id(s)
            local.index.insert_run(
                local.keys(hashes), local.tables[key], local.released[key], s.num_committed // local.block_size
            )

    # ------------------------------------------------------------------ maintenance and checks

    def reset_prefix_cache(self) -> bool:
        """Also empties the local groups' host tiers; refused while their copies are pending."""
        if any(self._open.group_swap_outs) or not super().reset_prefix_cache():  # type: ignore[attr-defined]
            return False
        for host in self._group_hosts:
            if host is not None:
                host.clear()
        return True

    def check_integrity(self) -> None:
        """The tiered checks for group 0, and per local group: pool, index, tables (deferred releases
        counted), host tier and the pending copies."""
        super().check_integrity()  # the tiered checks (group 0), then the hybrid ones (every group's tables)
        plans: list[_HybridPlan] = [self._open, *self._inflight.values()]  # type: ignore[list-item]
        for number, local in enumerate(self._locals):
            self._check_local(number, local, plans)

    def _count_other_local_holders(self, index: int, expected: list[int]) -> None:
        """Blocks of a local group held for a plan's deferred release (a sequence freed mid-copy)."""
        for plan in (self._open, *self._inflight.values()):
            for order in plan.group_deferred[index]:  # type: ignore[attr-defined]
                for block in order:
                    expected[block] += 1

    def _check_local(self, number: int, local: _Local, plans: list[_HybridPlan]) -> None:
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
