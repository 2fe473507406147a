"""Which workers hold which blocks, in which tier, for a :class:`~kvblocks.routing.router.Router`: the
:class:`~kvblocks.routing.holder_index.HolderIndex` the walk reads (every tier's blocks together) and, once a
worker reports a tier other than the device, per-tier masks that say at which tier's weight a block counts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from kvblocks.errors import IntegrityError
from kvblocks.hashing import BlockHash
from kvblocks.routing.config import TIERS
from kvblocks.routing.holder_index import HolderIndex
from kvblocks.routing.workers import WorkerState

__all__ = ["TieredHolders"]


class TieredHolders:
    """The router's view of its workers' caches: an update per KV event (:meth:`add`, :meth:`remove`,
    :meth:`clear`, each counting the worker's blocks per tier in ``WorkerState.held``), the tier-weighted
    overlap of a prompt's leading run (:meth:`weighted`, :meth:`overlaps`) and the integrity check."""

    def __init__(self, weights: dict[str, float]) -> None:
        self._weights = weights
        self.index = HolderIndex()  # hash -> workers holding it in any tier: what the walk reads
        self.tiers: dict[str, dict[int, int]] | None = None  # per-tier masks by folded key, once a
        # worker reports a tier other than the device (until then the index is the device tier)

    def add(self, w: WorkerState, tier: str, hashes: Sequence[BlockHash], parent: BlockHash | None) -> None:
        """``w`` holds the chain ``hashes`` (``parent``'s children) in ``tier``."""
        if tier not in w.held:
            return  # a tier the router does not score
        if self.tiers is None:
            if tier == "device":
                w.held["device"] += self.index.add(w.bit, hashes, parent)
                return
            self._split_tiers()
        tiers = cast(dict[str, dict[int, int]], self.tiers)
        bit = 1 << w.bit
        masks = tiers[tier]
        keys = self.index.fold_all(hashes)
        for key in keys:
            m = masks.get(key, 0)
            if not m & bit:
                masks[key] = m | bit
                w.held[tier] += 1
        self.index.add_keys(w.bit, keys, None if parent is None else self.index.fold(parent))

    @property
    def device_only(self) -> bool:
        """Only device blocks are held (every overlap is its run at the device weight)."""
        tiers = self.tiers
        return tiers is None or (not tiers["host"] and not tiers["storage"])

    def _split_tiers(self) -> None:
        """A tier other than the device appears: from now on each tier keeps its own masks (the index
        keeps their union, for the walk)."""
        self.tiers = {t: {} for t in TIERS}
        self.tiers["device"] = dict(self.index.items())

    def remove(self, w: WorkerState, tier: str, hashes: Iterable[BlockHash]) -> None:
        """``w`` no longer holds ``hashes`` in ``tier`` (those it did not hold there are ignored)."""
        if tier not in w.held:
            return
        if self.tiers is None:
            if tier == "device":
                w.held["device"] -= self.index.remove(w.bit, hashes)
            return
        bit = 1 << w.bit
        masks = self.tiers[tier]
        keys = dict.fromkeys(self.index.fold_all(hashes))
        self._remove_keys(w, tier, [k for k in keys if masks.get(k, 0) & bit])

    def clear(self, w: WorkerState, tiers: Iterable[str]) -> None:
        """``w`` holds nothing in ``tiers``."""
        tiers = [t for t in tiers if t in w.held]
        if self.tiers is None:
            if "device" in tiers:
                self.index.clear(w.bit)
                w.held["device"] = 0
            return
        bit = 1 << w.bit
        for tier in tiers:
            keys = [key for key, m in self.tiers[tier].items() if m & bit]
            self._remove_keys(w, tier, keys)

    def _remove_keys(self, w: WorkerState, tier: str, keys: list[int]) -> None:
        """Tiered: ``w`` drops ``keys`` (which it holds in ``tier``); the index, those it holds nowhere now."""
        bit = 1 << w.bit
        tiers = cast(dict[str, dict[int, int]], self.tiers)
        masks = tiers[tier]
        for key in keys:
            m = masks[key] & ~bit
            if m:
                masks[key] = m
            else:
                del masks[key]
        w.held[tier] -= len(keys)
        self.index.remove_keys(w.bit, [k for k in keys if not any(t.get(k, 0) & bit for t in tiers.values())])

    def weighted(self, hashes: Sequence[BlockHash], bit: int, run: int) -> float:
        """A run's overlap with each block weighted by the best tier of ``bit``'s worker holding it."""
        weights = self._weights
        device = weights.get("device", 0.0)
        if self.device_only:
            return run * device
        tiers = cast(dict[str, dict[int, int]], self.tiers)
        device_masks, host_masks = tiers["device"], tiers["host"]
        host_w, storage_w = weights.get("host", 0.0), weights.get("storage", 0.0)
        fold = self.index.fold
        b = 1 << bit
        total = 0.0
        for h in hashes[:run]:
            key = fold(h)
            if device_masks.get(key, 0) & b:
                total += device
            elif host_masks.get(key, 0) & b:
                total += host_w
            else:
                total += storage_w
        return total

    def overlaps(self, hashes: Sequence[BlockHash], alive: int) -> dict[int, float]:
        """Weighted overlap by worker bit, for the workers of ``alive`` with a nonzero run."""
        out: dict[int, float] = {}
        for run, mask in self.index.runs(hashes, alive):
            if not run:
                continue
            while mask:
                low = mask & -mask
                bit = low.bit_length() - 1
                out[bit] = self.weighted(hashes, bit, run)
                mask ^= low
        return out

    def check(self, workers: Iterable[WorkerState]) -> None:
        """The index equals the union of the tiers' masks, and each worker's counts per tier are its blocks."""
        self.index.check()
        workers = list(workers)
        union: dict[int, int] = {}
        if self.tiers is not None:
            for tier, masks in self.tiers.items():
                for key, m in masks.items():
                    union[key] = union.get(key, 0) | m
                for w in workers:
                    if w.held[tier] != sum(1 for m in masks.values() if m >> w.bit & 1):
                        raise IntegrityError(f"worker {w.id!r}: its {tier} count is stale")
            if union != dict(self.index.items()):
                raise IntegrityError("router index is not the union of its tiers")
        for w in workers:
            if self.tiers is None and w.held["device"] != self.index.held(w.bit):
                raise IntegrityError(f"worker {w.id!r}: its device count is stale")
