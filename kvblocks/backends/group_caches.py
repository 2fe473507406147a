"""The tensors of a hybrid layout: one KV cache per attention group, one state pool per recurrent group.

:class:`HybridCaches` allocates, for a :class:`~kvblocks.layouts.plan.HybridLayout` and a count
per group (from :meth:`HybridLayout.split` or given), a :class:`~kvblocks.backends.cache.KVCache`
per attention group through a :class:`~kvblocks.backends.base.Backend`, and a :class:`StatePool`
per recurrent group on the same device. Every group's allocation is exactly ``count x unit_bytes``.

A state pool keeps, for each tensor of the group's :class:`RecurrentState`, one tensor of shape
``(num_states, num_layers, *shape)`` in the state's dtype: state-major, like a block-major KV
cache. So one state's bytes over all the group's layers are contiguous per state tensor, and
zeroing, copying (checkpoint / restore), gathering or scattering any number of states is one
``index_fill_`` / ``index_select`` / ``index_copy_`` per state tensor, whatever the layer count.
A layer's tensor (``pool.layer(i)[name]``, ``(num_states, *shape)``) is a view strided on the
state dimension with contiguous inner dimensions, as the Mamba and linear-attention kernels
accept (they take the state stride as an argument). One tensor per state tensor, not one byte
allocation per pool, keeps every tensor aligned to its dtype without padding.

A recurrent group's manager plans state operations (:class:`~kvblocks.core.groups.recurrent_group.StateCopy`:
zero a new slot, save a slot into a checkpoint, restore one) that must run in order, since one plan
may save a slot and then zero it for the next sequence. :meth:`StatePool.apply` runs one group's
operations, batching consecutive ones into one kernel per state tensor where the batch cannot differ
from running them one by one; :func:`apply_state_plan` runs a whole plan over a pool per group.

A state's *payload* (what :meth:`StatePool.gather` returns and :meth:`StatePool.scatter` takes) is
``bytes_per_state`` bytes: state tensor by state tensor, in the state's order, each layer by layer.

This module imports torch; ``import kvblocks.hybrid`` does not (it loads this on first use).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

from kvblocks.backends._torch import torch
from kvblocks.backends.base import Backend
from kvblocks.backends.cache import KVCache
from kvblocks.backends.registry import get_backend
from kvblocks.core.groups.recurrent_group import StateCopy
from kvblocks.errors import ConfigError, InvalidBlockIdError
from kvblocks.layouts.plan import CacheGroup, HybridLayout, MemoryPlan

__all__ = ["HybridCaches", "StateIds", "StateOp", "StatePool", "apply_state_plan"]

StateIds = Sequence[int] | torch.Tensor
StateOp: TypeAlias = "StateCopy | tuple[int | None, int]"
"""One planned state operation: copy ``src`` into ``dst``, or zero ``dst`` when ``src`` is None."""

# A batch of operations one kernel per state tensor runs: (None, dsts) zeroes, (srcs, dsts) copies.
_Batch = tuple[list[int] | None, list[int]]

# Movement copies whole words: fewer elements for the index kernels (as KVCache rows do).
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word_dtype(alignment: int) -> torch.dtype:
    """The widest integer word whose size divides ``alignment``."""
    return next(dtype for size, dtype in _WORDS if alignment % size == 0)


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")
    return value


class StatePool:
    """``num_states`` recurrent states of one group on one device, zeroed at allocation.

    ``tensors[name]`` is ``(num_states, num_layers, *shape)`` in the tensor's dtype; ``rows`` are
    the same memory as ``[num_states, bytes]`` word tensors, one per state tensor, that movement
    works on. A state id is an index into the first dimension.
    """

    def __init__(self, group: CacheGroup, num_states: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(group, CacheGroup) or group.state is None:
            raise ConfigError("a state pool needs a recurrent CacheGroup")
        self.group = group
        self.state = group.state
        self.num_states = _count(num_states, "num_states")
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        rows: list[torch.Tensor] = []
        offsets: list[int] = []
        offset = 0
        for spec in self.state.tensors:
            tensor = torch.zeros(
                (self.num_states, group.num_layers, *spec.shape), dtype=getattr(torch, spec.dtype), device=self.device
            )
            width = group.num_layers * spec.nbytes
            word = _word_dtype(math.gcd(width, offset, self.bytes_per_state))
            rows.append(tensor.view(self.num_states, -1).view(torch.uint8).view(word))
            self.tensors[spec.name] = tensor
            offsets.append(offset)
            offset += width
        self.rows = tuple(rows)
        self.row_offsets = tuple(offsets)

    @property
    def num_layers(self) -> int:
        return self.group.num_layers

    @property
    def bytes_per_state(self) -> int:
        """One state over the group's layers: the layout's ``bytes_per_state``."""
        return int(self.group.bytes_per_state or 0)

    @property
    def nbytes(self) -> int:
        """Bytes allocated: ``num_states x bytes_per_state``."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """The state tensors of the group's ``index``-th layer (0-based within the group), ``(num_states, *shape)``."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_layers:
            raise ConfigError(f"layer index must be in 0..{self.num_layers - 1}, got {index!r}")
        return {name: tensor[:, index] for name, tensor in self.tensors.items()}

    def __repr__(self) -> str:
        return f"StatePool({self.num_states} states x {self.bytes_per_state} bytes, device={self.device})"

    # ---------------------------------------------------------------- validation

    def ids(self, ids: StateIds, *, what: str = "state ids", distinct: bool = False) -> torch.Tensor:
        """``ids`` checked (ints in ``0..num_states-1``; no repeats when ``distinct``) as an index tensor."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise InvalidBlockIdError(
                    f"{what} must be a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}"
                )
            values = [int(v) for v in ids.tolist()]
        elif isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise InvalidBlockIdError(f"{what} must be a sequence of ints, got {type(ids).__name__}")
        else:
            values = list(ids)
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InvalidBlockIdError(f"{what} must be ints, got {v!r}")
        bad = [v for v in values if not 0 <= v < self.num_states]
        if bad:
            raise InvalidBlockIdError(f"{what}: state {bad[0]} is not in 0..{self.num_states - 1}")
        if distinct and len(set(values)) != len(values):
            raise InvalidBlockIdError(f"{what} repeat a state: the result would depend on copy order")
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _check_payload(self, data: torch.Tensor, count: int) -> None:
        expected = (count, self.bytes_per_state)
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or tuple(data.shape) != expected:
            got = f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
            raise ConfigError(f"payload must be a uint8 tensor of shape {expected}, got {got}")
        if not data.is_contiguous():
            raise ConfigError("payload must be contiguous")
        if data.device != self.device:
            raise ConfigError(f"payload is on {data.device}, the pool on {self.device}")
        if data.numel():
            start, end = data.data_ptr(), data.data_ptr() + data.numel()
            for tensor in self.tensors.values():
                own = tensor.data_ptr()
                if start < own + tensor.numel() * tensor.element_size() and own < end:
                    raise ConfigError("payload overlaps the pool's own memory: copy it out first (or use copy)")

    def _columns(self, data: torch.Tensor, row: int) -> torch.Tensor:
        """The payload columns of state tensor ``row``, viewed as that row's words."""
        rows = self.rows[row]
        start = self.row_offsets[row]
        return data[:, start : start + rows.shape[1] * rows.element_size()].view(rows.dtype)

    # ---------------------------------------------------------------- movement

    def zero(self, states: StateIds) -> None:
        """Zero ``states`` in every layer and tensor: a new slot must not show another dtype's stale bytes."""
        self._fill(self.ids(states))

    def copy(self, src_states: StateIds, dst_states: StateIds) -> None:
        """Every ``dst_states[i]`` ends up holding what ``src_states[i]`` held before the call.

        Checkpoints a running slot into a cacheable one, or restores one. As with
        ``Backend.copy_blocks``: destinations must not repeat (``InvalidBlockIdError``), and when
        the two sets overlap everything is read before anything is written.
        """
        src = self.ids(src_states, what="source state ids")
        dst = self.ids(dst_states, what="destination state ids", distinct=True)
        if len(src) != len(dst):
            raise ConfigError(f"{len(src)} source states but {len(dst)} destination states")
        self._move(src, dst)

    def _fill(self, index: torch.Tensor) -> None:
        for rows in self.rows:
            rows.index_fill_(0, index, 0)

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if not len(src):
            return
        for rows in self.rows:
            rows.index_copy_(0, dst, rows.index_select(0, src))  # index_select reads into a new tensor first

    # ---------------------------------------------------------------- a plan's operations

    def apply(self, ops: Iterable[StateOp]) -> None:
        """Run ``ops`` -- ``(src, dst)`` pairs or one group's :class:`StateCopy` s -- as if one by one, in order.

        Order matters: a plan may save a slot into a checkpoint and then zero the slot (its sequence
        left, another came). Consecutive zeros run as one batch; consecutive copies too, as long as
        no destination repeats and no copy reads a state an earlier copy of the batch wrote (a batch
        reads everything before writing). Every id is checked first: bad input moves nothing.
        """
        self._run(self._batches(ops))

    def _batches(self, ops: Iterable[StateOp]) -> list[_Batch]:
        """``ops`` checked and cut into batches that give the same result as running them in order."""
        pairs = _pairs(ops)
        self.ids([dst for _, dst in pairs], what="destination state ids")
        self.ids([src for src, _ in pairs if src is not None], what="source state ids")
        batches: list[_Batch] = []
        written: set[int] = set()  # destinations of the last batch, when it copies
        for src, dst in pairs:
            last = batches[-1] if batches else None
            if src is None:
                if last is not None and last[0] is None:
                    last[1].append(dst)  # zeroing twice is zeroing once
                else:
                    batches.append((None, [dst]))
                continue
            if last is not None and last[0] is not None and dst not in written and src not in written:
                last[0].append(src)
                last[1].append(dst)
            else:
                batches.append(([src], [dst]))
                written = set()
            written.add(dst)
        return batches

    def _run(self, batches: list[_Batch]) -> None:
        device = self.device
        for src, dst in batches:
            index = torch.tensor(dst, dtype=torch.long, device=device)
            if src is None:
                self._fill(index)
            else:
                self._move(torch.tensor(src, dtype=torch.long, device=device), index)

    def gather(self, states: StateIds, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous ``[len(states), bytes_per_state]`` uint8 payload of ``states`` (``out`` reused if given)."""
        index = self.ids(states)
        if out is None:
            out = torch.empty((len(index), self.bytes_per_state), dtype=torch.uint8, device=self.device)
        else:
            self._check_payload(out, len(index))
        for r, rows in enumerate(self.rows):
            torch.index_select(rows, 0, index, out=self._columns(out, r))
        return out

    def scatter(self, states: StateIds, data: torch.Tensor) -> None:
        """Write payload rows into ``states`` (the inverse of :meth:`gather`); states must not repeat."""
        index = self.ids(states, distinct=True)
        self._check_payload(data, len(index))
        for r, rows in enumerate(self.rows):
            rows.index_copy_(0, index, self._columns(data, r))


def _pairs(ops: Iterable[StateOp]) -> list[tuple[int | None, int]]:
    """``ops`` as ``(src, dst)`` pairs; StateCopy s must all be of one group (a pool is one group's)."""
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Iterable):
        raise ConfigError(f"state operations must be an iterable, got {type(ops).__name__}")
    pairs: list[tuple[int | None, int]] = []
    groups: set[int] = set()
    for op in ops:
        if isinstance(op, StateCopy):
            groups.add(op.group)
            pairs.append((op.src, op.dst))
        elif isinstance(op, tuple) and len(op) == 2:
            pairs.append(op)
        else:
            raise ConfigError(f"a state operation is a StateCopy or a (src | None, dst) pair, got {op!r}")
    if len(groups) > 1:
        raise ConfigError(f"one pool holds one group's states; the operations name groups {sorted(groups)}")
    return pairs


def apply_state_plan(plan: Iterable[StateCopy], pools: Mapping[int, StatePool]) -> None:
    """Run a manager's ``take_state_plan()`` over ``pools`` (manager group index -> that group's pool).

    Each group's operations run in plan order (groups' states are disjoint, so only the order within
    a group matters). Every operation is checked before any state moves.
    """
    if isinstance(plan, (str, bytes)) or not isinstance(plan, Iterable):
        raise ConfigError(f"a state plan must be an iterable of StateCopy, got {type(plan).__name__}")
    by_group: dict[int, list[StateCopy]] = {}
    for op in plan:
        if not isinstance(op, StateCopy):
            raise ConfigError(f"a state plan holds StateCopy operations, got {op!r}")
        by_group.setdefault(op.group, []).append(op)
    missing = sorted(set(by_group) - set(pools))
    if missing:
        raise ConfigError(f"the plan names group {missing[0]}, which has no state pool here")
    chosen = [pools[group] for group in by_group]
    if len({id(pool) for pool in chosen}) != len(chosen):
        raise ConfigError("two groups of the plan share one state pool: their operations would interleave")
    for pool in chosen:
        if not isinstance(pool, StatePool):
            raise ConfigError(f"pools must map group indices to StatePool, got {type(pool).__name__}")
    checked = [(pool, pool._batches(ops)) for pool, ops in zip(chosen, by_group.values())]
    for pool, batches in checked:
        pool._run(batches)


GroupTensors = KVCache | StatePool


class HybridCaches:
    """Every group's tensors for one layout on one backend's device: ``caches[i]`` is group ``i``'s.

    ``counts`` is a :class:`MemoryPlan` of this layout (``layout.split(memory, context)``) or one
    positive count per group: blocks for attention groups, states for recurrent ones.
    """

    def __init__(
        self, layout: HybridLayout, counts: MemoryPlan | Sequence[int], backend: Backend | str = "cpu"
    ) -> None:
        if not isinstance(layout, HybridLayout):
            raise ConfigError(f"layout must be a HybridLayout, got {type(layout).__name__}")
        self.layout = layout
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        if not isinstance(self.backend, Backend):
            raise ConfigError(f"backend must be a Backend or a backend name, got {type(backend).__name__}")
        units = _units(layout, counts)
        self.groups: tuple[GroupTensors, ...] = tuple(
            self._allocate(group, count) for group, count in zip(layout.groups, units)
        )

    @classmethod
    def for_budget(
        cls, layout: HybridLayout, memory_bytes: int, context: int, backend: Backend | str = "cpu"
    ) -> HybridCaches:
        """Tensors for ``layout.split(memory_bytes, context)``."""
        return cls(layout, layout.split(memory_bytes, context), backend)

    def _allocate(self, group: CacheGroup, count: int) -> GroupTensors:
        if group.spec is None:
            return StatePool(group, count, self.backend.device)
        return self.backend.allocate(group.spec, count)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> GroupTensors:
        return self.groups[self._index(index)]

    def _index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.groups):
            raise ConfigError(f"group index must be in 0..{len(self.groups) - 1}, got {index!r}")
        return index

    def cache(self, index: int) -> KVCache:
        """Attention group ``index``'s KV cache."""
        found = self[index]
        if not isinstance(found, KVCache):
            raise ConfigError(f"group {index} is recurrent: it has a state pool (use states({index}))")
        return found

    def states(self, index: int) -> StatePool:
        """Recurrent group ``index``'s state pool."""
        found = self[index]
        if not isinstance(found, StatePool):
            raise ConfigError(f"group {index} is {self.layout.groups[index].kind}: it has a KV cache")
        return found

    def nbytes(self, index: int) -> int:
        """Bytes allocated for group ``index``: its count x the layout's ``unit_bytes``."""
        return self[index].nbytes

    @property
    def total_nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def zero(self, index: int, ids: StateIds) -> None:
        """Zero blocks (attention group) or states (recurrent group) ``ids`` of group ``index``."""
        found = self[index]
        if isinstance(found, StatePool):
            found.zero(ids)
        else:
            self.backend.zero(found, ids)

    def copy(self, index: int, src_ids: StateIds, dst_ids: StateIds) -> None:
        """Copy blocks or states within group ``index`` (``copy_blocks`` / :meth:`StatePool.copy`)."""
        found = self[index]
        if isinstance(found, StatePool):
            found.copy(src_ids, dst_ids)
        else:
            self.backend.copy_blocks(found, src_ids, dst_ids)

    def __repr__(self) -> str:
        parts = ", ".join(f"{g.kind}: {t!r}" for g, t in zip(self.layout.groups, self.groups))
        return f"HybridCaches({parts})"


def _units(layout: HybridLayout, counts: Any) -> list[int]:
    """One positive count per group, from a plan of this layout or a sequence, checked before allocating."""
    if isinstance(counts, MemoryPlan):
        if counts.layout != layout:
            raise ConfigError("the memory plan was made for another layout")
        values: list[object] = [plan.units for plan in counts.groups]
    elif isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
        raise ConfigError(f"counts must be a MemoryPlan or one count per group, got {type(counts).__name__}")
    else:
        values = list(counts)
    if len(values) != len(layout.groups):
        raise ConfigError(f"{len(values)} counts for {len(layout.groups)} groups")
    return [
        _count(value, f"group {i} ({group.kind}) {group.unit}s")
        for i, (group, value) in enumerate(zip(layout.groups, values))
    ]
