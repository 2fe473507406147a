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
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvblocks.errors import ConfigError
from kvblocks.integrations.sglang.pages import SCHEME, SglangPageFormat, page_hash, page_runs
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
        self._pool: Any = None
        self._storage_bytes: memoryview | None = None
        self._window = _Window()

    # ------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Fix the page format from SGLang's host pool and open the store (one pool per backend)."""
        super().register_mem_pool_host(mem_pool_host)
        fmt = SglangPageFormat.of(mem_pool_host, self.storage_config, self.settings.salt)
        if self.tier is not None:
            if fmt != self.format:
                raise ConfigError("KVBlocksHiCacheStorage serves one host pool; another format was registered")
            return
        page = mem_pool_host.get_data_page(0, flat=False)
        storage = page.untyped_storage()
        import torch

        raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # the pool's whole buffer, as bytes
        self._storage_bytes = memoryview(raw.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
        self._pool = mem_pool_host
        self.format = fmt
        settings = self.settings
        self.tier = StorageTier(
            TierConfig(
                storage=settings.open_storage(writes=self.writer),
                entry_format=fmt.entry_format,
                max_pending_writes=settings.max_pending_writes,
                storage_timeout_s=settings.storage_timeout_s,
            ),
            fmt.namespace,
            SCHEME,
            fmt.page_size,
            writer_on_demand=not self.writer,
        )

    def _ready(self) -> StorageTier:
        if self.tier is None:
            raise ConfigError("KVBlocksHiCacheStorage: SGLang has not registered its host pool yet")
        return self.tier

    def _page_views(self, index: int) -> list[memoryview]:
        page = self._pool.get_data_page(int(index), flat=False)
        return page_runs(page, self._storage_bytes)  # type: ignore[arg-type]  # set with the pool

    # ------------------------------------------------------------------ zero-copy batch calls (interface_v1)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` are stored (SGLang prefetches that many pages); waits at most
        ``lookup_timeout_s`` for the store, then answers with what it knows."""
        tier = self._ready()
        hashes = [page_hash(k) for k in keys]
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
        size = self.format.page_size  # type: ignore[union-attr]
        hashes = [page_hash(k) for k in keys]
        targets = [self._page_views(host_indices[i * size]) for i in range(len(hashes))]
        start = time.perf_counter()
        got = tier.read_into(hashes, targets)
        self._window.note(
            self._window.prefetch_pages,
            self._window.prefetch_bandwidth,
            got,
            got * self.format.payload_length,  # type: ignore[union-attr]
            time.perf_counter() - start,
        )
        return [i < got for i in range(len(hashes))]

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Queue pages from the host pool at ``host_indices`` for the writer thread (each copied once, into
        its entry's buffer, before this returns). Pages already stored are not written again. A rank that
        is not its page's writer (MLA replicas) writes nothing and reports success, as SGLang's backends do."""
        tier = self._ready()
        if not self.writer:
            return [True] * len(keys)
        size = self.format.page_size  # type: ignore[union-attr]
        hashes = [page_hash(k) for k in keys]
        fresh = [i for i, h in enumerate(hashes) if not tier.is_known(h)]
        start = time.perf_counter()
        views = [self._page_views(host_indices[i * size]) for i in fresh]

        def fill(j: int, payload: memoryview) -> None:
            offset = 0
            for run in views[j]:
                payload[offset : offset + len(run)] = run
                offset += len(run)

        try:
            tier.save_built([hashes[i] for i in fresh], fill)
        except Exception:  # never into SGLang's backup thread: the pages stay unsaved (future misses)
            _log.exception("kvblocks: queueing HiCache pages failed")
            return [False] * len(keys)
        self._window.note(
            self._window.backup_pages,
            self._window.backup_bandwidth,
            len(fresh),
            len(fresh) * self.format.payload_length,  # type: ignore[union-attr]
            time.perf_counter() - start,
        )
        return [True] * len(keys)

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
        targets = [[_tensor_bytes(t)] for t in target_locations]
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
        length = self.format.payload_length  # type: ignore[union-attr]
        payloads = [_tensor_bytes(v.contiguous()) for v in values]
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
        return True if self.tier is None else self.tier.flush(timeout)

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()


def _tensor_bytes(tensor: Any) -> memoryview:
    """A CPU tensor's bytes, shared (not copied)."""
    import torch

    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")
