"""``KVBlocksHiCacheStorage``: an SGLang HiCache storage backend over kvblocks' storage tier.

SGLang loads it by name::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvblocks",
            "module_path": "kvblocks.integrations.sglang", "class_name": "KVBlocksHiCacheStorage",
            "interface_v1": 1, "storage": "file", "path": "/mnt/kv"}'

Every page goes through a :class:`~kvblocks.tiers.storage_tier.StorageTier`: an entry is checksummed and bound
to its key and to the page format (:mod:`~kvblocks.integrations.sglang.pages`), so a page another model,
dtype, layout or rank wrote is a miss, never wrong KV; a damaged or missing entry is a counted miss; writes are
queued to the tier's writer thread (the call returns once the page is copied); reads and existence checks wait
at most ``storage_timeout_s`` / ``lookup_timeout_s``. With ``"interface_v1": 1`` SGLang calls the zero-copy
batch calls, which read pages straight into the host pool and write them straight from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvblocks.errors import ConfigError
from kvblocks.integrations.sglang.pages import SCHEME, PageMover, SglangPageFormat, page_hash, tensor_bytes
from kvblocks.integrations.sglang.settings import HiCacheSettings
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.storage_tier import StorageTier

__all__ = ["KVBlocksHiCacheStorage"]

_log = logging.getLogger(__name__)


class _Window:
    """Pages and seconds moved since SGLang last asked for ``get_stats`` (what its storage metrics log)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefetch_pages: list[int] = []
        self.backup_pages: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    def note(self, pages: list[int], bandwidth: list[float], count: int, nbytes: int, seconds: float) -> None:
        with self.lock:
            pages.append(count)
            bandwidth.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)


class KVBlocksHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is not type-checked here
    """SGLang's ``HiCacheStorage`` over kvblocks' storage tier (see the module docstring).

    SGLang builds it as ``KVBlocksHiCacheStorage(storage_config, kwargs)`` and then registers its host KV pool
    (:meth:`register_mem_pool_host`), which fixes the page format; the tier opens the store then.
    """

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.settings = HiCacheSettings.from_extra_config(getattr(storage_config, "extra_config", None))
        self.storage_config = storage_config
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.format: SglangPageFormat | None = None
        self.tier: StorageTier | None = None
        self._mover: PageMover | None = None
        self._extra: dict[str, tuple[PageMover, StorageTier]] = {}  # SGLang's extra pools (v2), by name
        self._window = _Window()

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Fix the page format from SGLang's host KV pool and open the store (one KV pool per backend)."""
        super().register_mem_pool_host(mem_pool_host)
        fmt = SglangPageFormat.of(mem_pool_host, self.storage_config, self.settings.salt)
        if self.tier is not None:
            if fmt != self.format:
                raise ConfigError("KVBlocksHiCacheStorage serves one host KV pool; another format was registered")
            return
        mover = PageMover(mem_pool_host)
        self.tier = self._open_tier(fmt, self.settings.open_storage(writes=self.writer), owns_backend=True)
        self.format, self._mover = fmt, mover

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """An extra host pool (Mamba state, SWA, indexer, draft): its pages are stored under the KV pages' keys,
        in a key space of its own (the pool's name and format), through the same store."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == "kv":
            self.register_mem_pool_host(host_pool)
            return
        main = self._ready()
        fmt = SglangPageFormat.of(host_pool, self.storage_config, self.settings.salt, name)
        tier = self._open_tier(fmt, main.backend, owns_backend=False)  # the KV tier closes the store
        old = self._extra.pop(name, None)
        if old is not None:
            old[1].close()
        self._extra[name] = (PageMover(host_pool), tier)

    def _open_tier(self, fmt: SglangPageFormat, storage: Any, *, owns_backend: bool) -> StorageTier:
        """A storage tier for one pool's pages: its format's key space and header, over ``storage``."""
        settings = self.settings
        return StorageTier(
            TierConfig(
                storage=storage,
                entry_format=fmt.entry_format,
                max_pending_writes=settings.max_pending_writes,
                storage_timeout_s=settings.storage_timeout_s,
            ),
            fmt.namespace,
            SCHEME,
            fmt.page_size,
            owns_backend=owns_backend,
            writer_on_demand=not self.writer,
        )

    def _ready(self) -> StorageTier:
        if self.tier is None:
            raise ConfigError("KVBlocksHiCacheStorage: SGLang has not registered its host pool yet")
        return self.tier

    # ------------------------------------------------------------------ zero-copy batch calls (interface_v1)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` are stored (SGLang prefetches that many pages); waits at most
        ``lookup_timeout_s`` for the store, then answers with what it knows."""
        return self._stored_run(self._ready(), [page_hash(k) for k in keys])

    def _stored_run(self, tier: StorageTier, hashes: list[Any]) -> int:
        if not hashes:
            return 0
        known = tier.known_run(hashes, 0, len(hashes))
        if known == len(hashes):
            return known
        request = tier.probe(hashes[known:])
        if request is not None:
            deadline = time.monotonic() + self.settings.lookup_timeout_s
            while not tier.is_answered(request) and time.monotonic() < deadline:
                tier.wait_idle(min(0.01, max(0.0, deadline - time.monotonic())))
        return known + tier.known_run(hashes, known, len(hashes))

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices`` (one page per ``page_size`` indices);
        True for the sound leading run, False from the first page that is missing, damaged or foreign."""
        tier = self._ready()
        mover: PageMover = self._mover  # type: ignore[assignment]  # set with the tier
        start = time.perf_counter()
        got = self._read(tier, mover, keys, host_indices)
        w = self._window
        w.note(
            w.prefetch_pages, w.prefetch_bandwidth, got, got * tier.format.payload_length, time.perf_counter() - start
        )
        return [i < got for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Queue pages from the host pool at ``host_indices`` for the writer thread (each copied once, into
        its entry's buffer, before this returns). Pages already stored are not written again. A rank that
        is not its page's writer (MLA replicas) writes nothing and reports success, as SGLang's backends do."""
        tier = self._ready()
        mover: PageMover = self._mover  # type: ignore[assignment]  # set with the tier
        if not self.writer:
            return [True] * len(keys)
        start = time.perf_counter()
        written = self._write(tier, mover, keys, host_indices)
        if written is None:
            return [False] * len(keys)
        w = self._window
        w.note(
            w.backup_pages,
            w.backup_bandwidth,
            written,
            written * tier.format.payload_length,
            time.perf_counter() - start,
        )
        return [True] * len(keys)

    @staticmethod
    def _read(tier: StorageTier, mover: PageMover, keys: list[str], host_indices: Any) -> int:
        """Read the pages of ``keys`` into the pool at ``host_indices``; how many leading pages arrived sound."""
        return mover.read(tier, [page_hash(k) for k in keys], _first_slots(host_indices, mover.page_size, len(keys)))

    @staticmethod
    def _write(tier: StorageTier, mover: PageMover, keys: list[str], host_indices: Any) -> int | None:
        """Queue the pages not known stored; how many were queued (None: queueing failed, nothing more sent)."""
        hashes = [page_hash(k) for k in keys]
        slots = _first_slots(host_indices, mover.page_size, len(hashes))
        fresh = [i for i, h in enumerate(hashes) if not tier.is_known(h)]
        try:
            mover.write(tier, [hashes[i] for i in fresh], [slots[i] for i in fresh])
        except Exception:  # never into SGLang's backup thread: the pages stay unsaved (future misses)
            _log.exception("kvblocks: queueing HiCache pages failed")
            return None
        return len(fresh)

    # ------------------------------------------------------------------ extra pools (v2)

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The KV prefix stored, cut to what every extra pool can restore with it (SGLang's hit policies:
        ``all_pages``, every page of the prefix; ``trailing_pages``, the last ``len(transfer.keys)`` of it)."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult

        hashes = [page_hash(k) for k in keys]
        kv_pages = self._stored_run(self._ready(), hashes)
        hit_count: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(getattr(transfer.name, "value", transfer.name))
            present = self._present(name, hashes[:kv_pages])
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                pool_restorable = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing) : n])}
                boundary = max(pool_restorable, default=0)
            else:
                raise ConfigError(f"unknown SGLang pool hit policy {transfer.hit_policy!r}")
            if boundary:
                hit_count[transfer.name] = boundary
            restorable = [n for n in restorable if n in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def _present(self, name: str, hashes: list[Any]) -> list[bool]:
        """Which of ``hashes`` pool ``name`` has stored (one bounded call to the store; none when it fails)."""
        entry = self._extra.get(name)
        if entry is None or not hashes:
            return [False] * len(hashes)
        tier = entry[1]
        try:
            return [bool(x) for x in tier.backend.exists([tier.keys_of(h)[0] for h in hashes])]
        except Exception:  # a store that fails answers "nothing": SGLang recomputes
            _log.exception("kvblocks: checking HiCache pool %s failed", name)
            return [False] * len(hashes)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Read each transfer's pages into its pool: True for the sound leading run, per pool."""

        def read(tier: StorageTier, mover: PageMover, keys: list[str], indices: Any) -> list[bool]:
            got = self._read(tier, mover, keys, indices)
            return [i < got for i in range(len(keys))]

        return self._per_pool(transfers, read)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        """Queue each transfer's pages from its pool for the writer thread."""

        def write(tier: StorageTier, mover: PageMover, keys: list[str], indices: Any) -> list[bool]:
            if not self.writer:
                return [True] * len(keys)
            return [self._write(tier, mover, keys, indices) is not None] * len(keys)

        return self._per_pool(transfers, write)

    def _per_pool(
        self, transfers: list[Any], move: Callable[[StorageTier, PageMover, list[str], Any], list[bool]]
    ) -> dict[str, list[bool]]:
        """``move`` each transfer's pages (all False for a pool not registered or indices that do not fit)."""
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            found = self._transfer(transfer)
            results[transfer.name] = (
                [False] * len(keys) if found is None else move(found[1], found[0], keys, transfer.host_indices)
            )
        return results

    def _transfer(self, transfer: Any) -> tuple[PageMover, StorageTier] | None:
        """The mover and tier of a transfer's pool, when it is registered and its indices cover its keys."""
        name = str(getattr(transfer.name, "value", transfer.name))
        found = (self._mover, self._ready()) if name == "kv" else self._extra.get(name)
        if found is None or found[0] is None:
            _log.error("kvblocks: SGLang pool %s was not registered with the HiCache backend", name)
            return None
        mover, tier = found[0], found[1]
        keys = transfer.keys or []
        indices = transfer.host_indices
        if indices is None or int(indices.numel()) != len(keys) * mover.page_size:
            _log.error("kvblocks: HiCache transfer of pool %s has indices that do not cover its pages", name)
            return None
        return mover, tier

    # ------------------------------------------------------------------ the generic (copying) calls

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Read one page into ``target_location`` (a flat page tensor); it, or None on a miss."""
        result = self.batch_get([key], [target_location])
        return result[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Read pages into ``target_locations`` (flat page tensors, SGLang's dummy pages); each target, or None
        from the first page that did not arrive sound."""
        tier = self._ready()
        if target_locations is None or len(target_locations) != len(keys):
            return [None] * len(keys)
        hashes = [page_hash(k) for k in keys]
        targets = [[tensor_bytes(t)] for t in target_locations]
        got = tier.read_into(hashes, targets)
        return [t if i < got else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Queue pages given as tensors (SGLang's ``get_data_page`` copies) for the writer thread."""
        tier = self._ready()
        if not self.writer:
            return True
        if values is None or len(values) != len(keys):
            return False
        hashes = [page_hash(k) for k in keys]
        length = tier.format.payload_length
        payloads = [tensor_bytes(v) for v in values]
        if any(len(p) != length for p in payloads):
            return False
        fresh = [i for i, h in enumerate(hashes) if not tier.is_known(h)]
        try:
            tier.save([hashes[i] for i in fresh], [payloads[i] for i in fresh])
        except Exception:  # never into SGLang's backup thread
            _log.exception("kvblocks: queueing HiCache pages failed")
            return False
        return True

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ upkeep

    def clear(self) -> None:
        """Forget what this instance knows is stored. The entries stay: other instances share the store."""
        if self.tier is not None:
            self.tier.forget(self.tier.known_hashes())

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` for the pages moved since the last call (kvblocks' own counters, hits,
        misses, damaged entries, are ``self.tier.stats``)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        w = self._window
        with w.lock:
            metrics.prefetch_pgs.extend(w.prefetch_pages)
            metrics.backup_pgs.extend(w.backup_pages)
            metrics.prefetch_bandwidth.extend(w.prefetch_bandwidth)
            metrics.backup_bandwidth.extend(w.backup_bandwidth)
            w.prefetch_pages.clear()
            w.backup_pages.clear()
            w.prefetch_bandwidth.clear()
            w.backup_bandwidth.clear()
        return metrics

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued writes (tests, shutdown)."""
        tiers = [t for _, t in self._extra.values()] + ([self.tier] if self.tier is not None else [])
        return all([t.flush(timeout) for t in tiers])

    def close(self) -> None:
        for _, tier in self._extra.values():
            tier.close()
        self._extra.clear()
        if self.tier is not None:
            self.tier.close()


def _first_slots(host_indices: Any, page_size: int, pages: int) -> list[int]:
    """The first host slot of each of ``pages`` pages laid out ``page_size`` slots apart in ``host_indices``."""
    flat = host_indices.reshape(-1)
    return [int(flat[i * page_size]) for i in range(pages)]
