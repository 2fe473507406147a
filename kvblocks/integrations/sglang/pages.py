"""SGLang's host KV pages as kvblocks storage entries: their identity (key space, entry header) and their bytes.

SGLang's HiCache names a page by the hex SHA-256 chain of its tokens (``get_hash_str``: kvblocks' scheme
``sglang-sha256``), whatever model, dtype or layout computed it. The entry format therefore names everything
that shapes a page's bytes, and the page key carries that format's tag::

    SglangPageFormat(model="org/llama", dtype="bfloat16", layout="page_first", page_shape=(2, 64, 32, 8, 128),
                     page_size=64, shard="tp0of2")
      .entry_format    dtype, page shape, fingerprint of (model, layout, shard, ...): part of every key

A page is what the host pool's own ``get_data_page(index, flat=False)`` returns: a view of its KV buffer,
contiguous or not (``layer_first`` puts each layer's tokens apart). :func:`page_runs` finds that view's
contiguous runs of bytes, in order, so a page is read into place and written from place without a copy
beside the entry's own buffer; the stored payload is the flat page SGLang's generic path moves
(``get_data_page(index)``), so both paths read each other's entries.

Layouts: every layout whose pool answers ``get_data_page`` (MHA ``layer_first``, ``page_first``,
``page_first_direct``, ``page_head``; MLA ``layer_first``, ``page_first``, ``page_first_direct``).
``page_unified`` and pools without a CPU KV buffer are refused with :class:`~kvblocks.errors.ConfigError`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import xxhash

from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.hashing import BlockHash, Namespace
from kvblocks.tiers.entry import EntryFormat

__all__ = ["SCHEME", "PageMover", "SglangPageFormat", "page_hash", "page_runs", "tensor_bytes"]

SCHEME = "sglang-sha256"
"""SGLang's page hash chain (:mod:`kvblocks.hashing.sglang`): what HiCache's page keys are the hex of."""

_HEX = frozenset("0123456789abcdef")


def page_hash(key: str) -> BlockHash:
    """The block hash of an SGLang page key: its 32 bytes when it is a hex SHA-256 (HiCache's page keys),
    else the SHA-256 of the key's text (a key with a suffix, e.g. another pool's), never equal to the first.

    >>> page_hash("00" * 32) == bytes(32)
    True
    >>> len(page_hash("abc.mamba"))
    32
    """
    if not isinstance(key, str):
        raise InvalidArgumentError(f"an SGLang page key is a str, got {type(key).__name__}")
    if len(key) == 64 and _HEX.issuperset(key):
        return bytes.fromhex(key)
    return hashlib.sha256(b"kvblocks-sglang-key\x00" + key.encode("utf-8", "surrogatepass")).digest()


def page_runs(page: Any, storage: memoryview) -> list[memoryview]:
    """The contiguous byte runs of ``page`` (a strided view of a tensor over ``storage``), in C order.

    ``storage`` is the bytes of the tensor's whole storage (offset 0). Worked example, ``layer_first``
    ``(2, L, size, H, D)``, page ``[:, :, i:i+P]``: the innermost contiguous block is one layer's P tokens
    (``P*H*D`` items), so the page is ``2*L`` runs, K's layers then V's.
    """
    shape, strides = tuple(page.shape), tuple(page.stride())
    itemsize = page.element_size()
    run, k = 1, len(shape)
    while k and (shape[k - 1] == 1 or strides[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    starts = [page.storage_offset()]
    for d in range(k):
        starts = [s + i * strides[d] for s in starts for i in range(shape[d])]
    nbytes = run * itemsize
    return [storage[s * itemsize : s * itemsize + nbytes] for s in starts]


@dataclass(frozen=True)
class SglangPageFormat:
    """The KV of one SGLang deployment's host pool as stored pages (see the module docstring)."""

    model: str
    """The served model's name or path (SGLang's ``model_name``; ``"default"`` when it has none)."""
    dtype: str
    """The host pool's torch dtype name (``"bfloat16"``)."""
    layout: str
    """The host pool's layout (``"page_first"``, ``"layer_first"``, ...)."""
    page_shape: tuple[int, ...]
    """One page as ``get_data_page(index, flat=False)`` shapes it."""
    page_size: int
    """Tokens per page."""
    shard: str
    """Which part of a page this rank holds: tensor, pipeline and context parallel rank and size (MLA
    pages are the same on every tensor-parallel rank, so it leaves the tensor rank out)."""
    item_bytes: int
    salt: str | None = None
    pool: str = "kv"
    """Which of SGLang's host pools (its ``PoolName``): the KV pages, or an extra pool's (Mamba state, SWA,
    indexer), which are stored under the same page keys in key spaces of their own."""

    @classmethod
    def of(cls, pool: Any, storage_config: Any, salt: str | None = None, name: str = "kv") -> SglangPageFormat:
        """The format of ``pool`` (an SGLang host pool, ``name`` in SGLang's ``PoolName``) under
        ``storage_config`` (its ``HiCacheStorageConfig``); a pool kvblocks cannot store is a :class:`ConfigError`."""
        layout = str(getattr(pool, "layout", ""))
        page_size = int(pool.page_size)
        try:
            page = pool.get_data_page(0, flat=False)
        except (ValueError, NotImplementedError, AttributeError) as e:
            raise ConfigError(f"kvblocks cannot store pages of this SGLang host pool (layout {layout!r}): {e}") from e
        if getattr(page, "device", None) is None or page.device.type != "cpu" or page.numel() == 0:
            raise ConfigError(f"kvblocks stores SGLang host pools on the CPU; this one's pages are on {page.device}")
        # MLA pages are replicated across tensor-parallel ranks; Mamba state is sharded even then (as SGLang keys it)
        replicated = bool(storage_config.is_mla_model) and name != "mamba"
        tp = "" if replicated else f"tp{storage_config.tp_rank}of{storage_config.tp_size}"
        shard = (
            f"{tp}pp{storage_config.pp_rank}of{storage_config.pp_size}"
            f"cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}"
            f"dcp{getattr(storage_config, 'dcp_rank', 0)}of{getattr(storage_config, 'dcp_size', 1)}"
        )
        dtype = str(page.dtype).removeprefix("torch.")
        return cls(
            model=str(storage_config.model_name or "default"),
            dtype=dtype,
            layout=layout,
            page_shape=tuple(int(n) for n in page.shape),
            page_size=page_size,
            shard=shard,
            item_bytes=int(page.element_size()),
            salt=salt,
            pool=str(name),
        )

    @property
    def payload_length(self) -> int:
        n = self.item_bytes
        for d in self.page_shape:
            n *= d
        return n

    @cached_property
    def namespace(self) -> Namespace:
        return Namespace(self.model, self.salt)

    @cached_property
    def entry_format(self) -> EntryFormat:
        """Every stored page's header; its tag is part of the key, so pages of two formats never meet."""
        description = repr(
            (
                "sglang-hicache",
                self.model,
                self.dtype,
                self.layout,
                self.page_shape,
                self.page_size,
                self.shard,
                self.pool,
            )
        )
        return EntryFormat(
            scheme=SCHEME,
            dtype=self.dtype,
            shape=self.page_shape,
            fingerprint=xxhash.xxh3_64_intdigest(description.encode()),
            payload_length=self.payload_length,
        )


class PageMover:
    """Moves one host pool's pages between the pool and a storage tier.

    In place when the pool's ``get_data_page(index, flat=False)`` is a view of its buffer (MHA and MLA pools):
    a read lands straight in the pool, a write copies straight from it into the entry. Through SGLang's flat
    pages when it is a copy (a Mamba state pool concatenates its tensors): a read fills a flat page that
    ``set_from_flat_data_page`` puts back, a write stores ``get_data_page(index)``. Either way the stored
    payload is the flat page.
    """

    def __init__(self, pool: Any) -> None:
        import torch

        self.pool = pool
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        first, again = pool.get_data_page(0, flat=False), pool.get_data_page(0, flat=False)
        self.in_place = first.data_ptr() == again.data_ptr() and first.is_cpu
        self._storage: memoryview | None = None
        if self.in_place:
            raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())  # the pool's buffer, as bytes
            self._storage = memoryview(raw.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers

    def _runs(self, index: int) -> list[memoryview]:
        return page_runs(self.pool.get_data_page(int(index), flat=False), self._storage)  # type: ignore[arg-type]

    def read(self, tier: Any, hashes: list[BlockHash], first_indices: list[int]) -> int:
        """Read ``hashes``' pages into the pool at ``first_indices`` (each page's first slot); how many
        leading pages arrived sound (past them the pool's slots may hold anything: SGLang recomputes)."""
        if self.in_place:
            return int(tier.read_into(hashes, [self._runs(i) for i in first_indices]))
        pages = [self.pool.get_dummy_flat_data_page() for _ in hashes]
        got = int(tier.read_into(hashes, [[tensor_bytes(p)] for p in pages]))
        for index, page in zip(first_indices[:got], pages, strict=False):
            self.pool.set_from_flat_data_page(int(index), page)
        return got

    def write(self, tier: Any, hashes: list[BlockHash], first_indices: list[int]) -> None:
        """Queue ``hashes``' pages from the pool at ``first_indices`` for the tier's writer thread."""
        if self.in_place:
            views = [self._runs(i) for i in first_indices]
        else:
            views = [[tensor_bytes(self.pool.get_data_page(int(i), flat=True))] for i in first_indices]

        def fill(j: int, payload: memoryview) -> None:
            offset = 0
            for run in views[j]:
                payload[offset : offset + len(run)] = run
                offset += len(run)

        tier.save_built(hashes, fill)


def tensor_bytes(tensor: Any) -> memoryview:
    """A CPU tensor's bytes, shared (not copied)."""
    import torch

    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")
