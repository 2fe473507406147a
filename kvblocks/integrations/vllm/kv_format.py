"""Which stored blocks one vLLM deployment may read: the key space and the entry header of its KV.

vLLM names a block by its chained hash (``request.block_hashes``); two deployments produce the same
hash for the same tokens whenever they share the hash algorithm and block size, even when their KV
differs (another model, dtype, attention layout or tensor-parallel split). The key space therefore
names everything that shapes a block's bytes, and both halves of the connector -- the scheduler, which
only looks keys up, and the workers, which hold the tensors -- derive it from the same description::

    VllmKVFormat(model="org/llama", dtype="bfloat16", num_layers=32, block_shape=(8, 16, 256),
                 block_size=16, hash_algo="sha256")
      .scheme       "vllm-sha256"             the hashes' scheme (key prefix)
      .tag          namespace tag              model (+ salt), scheme, block size
      .entry_format EntryFormat                dtype, (layers, *block_shape), fingerprint of the rest

A worker whose tensors do not have the described shape refuses to start (:class:`ConfigError`), so
a layout the description missed can never write entries under another layout's keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import xxhash

from kvblocks.backends.spec import DTYPE_SIZES
from kvblocks.errors import ConfigError
from kvblocks.hashing import Namespace
from kvblocks.tiers.entry import EntryFormat, namespace_tag

__all__ = ["HASH_ALGOS", "VllmKVFormat"]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""vLLM's ``prefix_caching_hash_algo`` values; each is a scheme of its own (``vllm-`` + the name, ``-`` for ``_``)."""


@dataclass(frozen=True)
class VllmKVFormat:
    """The KV of one vLLM deployment as stored blocks (see the module docstring).

    >>> f = VllmKVFormat("tiny", "float32", 2, (4, 32, 16), 32, "sha256_cbor")
    >>> f.scheme, f.bytes_per_layer_block, f.entry_format.payload_length
    ('vllm-sha256-cbor', 8192, 16384)
    >>> f.tag != VllmKVFormat("tiny", "bfloat16", 2, (4, 32, 16), 32, "sha256_cbor").tag
    False
    >>> f.entry_format.tag != VllmKVFormat("tiny", "bfloat16", 2, (4, 32, 16), 32, "sha256_cbor").entry_format.tag
    True
    """

    model: str
    """The served model's name or path (what vLLM's ``model_config.model`` says)."""
    dtype: str
    """The KV cache's torch dtype name."""
    num_layers: int
    """Attention layers whose KV a block holds (all of them, in layer-name order)."""
    block_shape: tuple[int, ...]
    """One layer's block as its tensor lays it out, e.g. ``(kv_heads, block_size, 2 * head_dim)`` on CPU."""
    block_size: int
    """Tokens per block (vLLM's ``cache_config.block_size``)."""
    hash_algo: str = "sha256"
    """vLLM's ``prefix_caching_hash_algo``."""
    layout: str = ""
    """Anything else that shapes the bytes (the attention backend, the rank's place in a TP/PP split)."""
    salt: str | None = None
    """Keeps deployments that share a store apart (optional)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a non-empty str, got {self.model!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"dtype {self.dtype!r} is not a KV cache dtype; known: {', '.join(DTYPE_SIZES)}")
        for value, what in ((self.num_layers, "num_layers"), (self.block_size, "block_size")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{what} must be an int >= 1, got {value!r}")
        shape = self.block_shape
        if (
            not isinstance(shape, tuple)
            or not 1 <= len(shape) <= 7
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape)
        ):
            raise ConfigError(f"block_shape must be a tuple of 1 to 7 ints >= 1, got {shape!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(f"hash_algo must be one of {', '.join(HASH_ALGOS)}; got {self.hash_algo!r}")
        if not isinstance(self.layout, str):
            raise ConfigError(f"layout must be a str, got {self.layout!r}")
        if self.salt is not None and (not isinstance(self.salt, str) or not self.salt):
            raise ConfigError(f"salt must be a non-empty str or None, got {self.salt!r}")

    @property
    def scheme(self) -> str:
        return "vllm-" + self.hash_algo.replace("_", "-")

    @property
    def bytes_per_layer_block(self) -> int:
        return math.prod(self.block_shape) * DTYPE_SIZES[self.dtype]

    @cached_property
    def tag(self) -> str:
        """The namespace tag of the keys: model (+ salt), scheme and block size."""
        return namespace_tag(Namespace(self.model, self.salt), self.scheme, self.block_size)

    @cached_property
    def entry_format(self) -> EntryFormat:
        """Every stored block's header: its format tag is part of the key, so formats never meet."""
        description = repr(
            ("vllm-kv", self.model, self.dtype, self.num_layers, self.block_shape, self.block_size, self.layout)
        )
        return EntryFormat(
            scheme=self.scheme,
            dtype=self.dtype,
            shape=(self.num_layers, *self.block_shape),
            fingerprint=xxhash.xxh3_64_intdigest(description.encode()),
            payload_length=self.num_layers * self.bytes_per_layer_block,
        )
