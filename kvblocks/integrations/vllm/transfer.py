"""Moving one run of blocks between vLLM's KV tensors and the storage tier (the worker's hot paths).

Free of vLLM, so the connector's tests and benchmarks call exactly what ``start_load_kv`` and
``wait_for_save`` call. On the host each block moves with one copy::

    load   file --preadv--> [header, layer0[b], ..., layer{L-1}[b]]   then header + checksum checked
    save   layer0[b], ..., layer{L-1}[b] --memcpy--> pooled entry after its header --> writer thread

A tensor on an accelerator goes through :meth:`LayerBlocks.read` / :meth:`LayerBlocks.write` (staged
on the host), with the same checks.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvblocks.errors import InvalidArgumentError
from kvblocks.hashing import BlockHash
from kvblocks.integrations.vllm.block_copy import LayerBlocks
from kvblocks.tiers.storage_tier import StorageTier

__all__ = ["load_run", "save_run"]


def _paired(hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
    if len(hashes) != len(block_ids):
        raise InvalidArgumentError(f"{len(hashes)} block hashes but {len(block_ids)} block ids")


def load_run(tier: StorageTier, blocks: LayerBlocks, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
    """Load ``hashes``' entries into ``block_ids``; how many leading blocks hold their sound KV.

    The blocks past that count must be recomputed (the connector reports them to vLLM as load
    errors): on the host they may hold part of an entry that failed its checks.
    """
    _paired(hashes, block_ids)
    if blocks.on_host:
        return tier.read_into(hashes, [blocks.views(b) for b in block_ids])
    outcome = tier.read(hashes)
    usable = len(outcome.payloads)
    blocks.write(block_ids[:usable], [parts[0] for parts in outcome.payloads])
    return usable


def save_run(tier: StorageTier, blocks: LayerBlocks, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
    """Copy ``block_ids`` out of the KV tensors now (vLLM may reuse them after this step) and queue their
    entries under ``hashes``; the writer thread stores them. Every id is checked before anything is queued."""
    _paired(hashes, block_ids)
    for b in block_ids:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < blocks.num_blocks:
            raise InvalidArgumentError(f"block id {b!r} is not an int in 0..{blocks.num_blocks - 1}")
    if blocks.on_host and tier.num_shards == 1:
        tier.save_built(hashes, lambda i, payload: blocks.copy_out(block_ids[i], payload))
    else:
        tier.save(hashes, blocks.read(block_ids))
