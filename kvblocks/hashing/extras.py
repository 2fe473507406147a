"""Extra keys of a block (:class:`BlockExtras`, :class:`MultimodalItem`) and the typed frames that carry them.

Extra keys are *typed frames* -- ``tag (1 byte) || length (u32 LE) || payload`` -- appended after the
fixed-size token bytes of a block; a namespace's chain root is framed the same way
(:meth:`~kvblocks.hashing.schemes.Namespace.root_material`). Every frame tag is defined here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from kvblocks.errors import ConfigError
from kvblocks.hashing.tokens import _check_index

__all__ = ["BlockExtras", "MultimodalItem", "blocks_overlapping"]

# Frame tags. Never reuse a tag for another meaning: stored hashes depend on them.
_TAG_ROOT_SCHEME = 0x01
_TAG_ROOT_BLOCK_SIZE = 0x02
_TAG_ROOT_MODEL = 0x03
_TAG_ROOT_SALT = 0x04
_TAG_LORA = 0x10
_TAG_CACHE_SALT = 0x11
_TAG_MM_ITEM = 0x12
_TAG_LORA_PATH = 0x13  # framed only when set: hashes without a LoRA path are those of before the tag existed
_ROOT_MAGIC = b"kvblocks/root/v1"

_Framer = Callable[[int], bytes]


def _frame(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + len(payload).to_bytes(4, "little") + payload


def _as_bytes(value: str | bytes, what: str) -> bytes:
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 for it
            raise ConfigError(f"{what} is not valid UTF-8 text: {value!r:.60}") from None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise ConfigError(f"{what} must be str or bytes, got {type(value).__name__}")


def blocks_overlapping(offset: int, length: int, block_size: int) -> range:
    """Blocks that the half-open token range ``[offset, offset + length)`` touches.

    With block size 4::

        offset 2 length 2  -> tokens 2,3       -> block 0
        offset 3 length 2  -> tokens 3,4       -> blocks 0, 1
        offset 4 length 4  -> tokens 4..7      -> block 1   (ends where block 2 starts: not in it)
        offset 0 length 12 -> tokens 0..11     -> blocks 0, 1, 2
    """
    if length <= 0:
        return range(0)
    return range(offset // block_size, (offset + length - 1) // block_size + 1)


@dataclass(frozen=True)
class MultimodalItem:
    """A multimodal input (image, audio clip...) occupying tokens ``[offset, offset + length)``.

    ``digest`` identifies the item's content (for example a hash of the image
    bytes); every block the item overlaps includes it in its hash.
    """

    digest: bytes | str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not _as_bytes(self.digest, "multimodal item digest"):
            raise ConfigError("multimodal item digest must not be empty")
        _check_index(self.offset, "multimodal item offset", minimum=0)
        _check_index(self.length, "multimodal item length", minimum=1)

    def frame(self) -> bytes:
        payload = (
            int(self.offset).to_bytes(8, "little")
            + int(self.length).to_bytes(8, "little")
            + _as_bytes(self.digest, "multimodal item digest")
        )
        return _frame(_TAG_MM_ITEM, payload)


@dataclass(frozen=True)
class BlockExtras:
    """Per-request keys that change a block's identity beyond its tokens.

    * ``lora``: the adapter's identity; framed into every block.
    * ``lora_path``: where the adapter was loaded from (optional; needs ``lora``). vLLM 0.33 keys LoRA blocks
      by name *and* path, so its schemes require it with ``lora``; kvblocks' schemes frame it into every block
      only when set.
    * ``cache_salt``: a per-request salt (tenant isolation); framed into block 0,
      which the chain carries to every later block.
    * ``mm_items``: multimodal items; each is framed into exactly the blocks it
      overlaps (:func:`blocks_overlapping`).
    * ``lora_id``: the engine's integer id of the adapter (vLLM's ``lora_int_id``, an int >= 1; needs
      ``lora``). Not part of any hash (an engine assigns ids per run): the ``BlockStored`` events of the
      blocks carry it as vLLM's ``lora_id``, beside ``lora_name``.
    """

    lora: str | None = None
    cache_salt: str | bytes | None = None
    mm_items: tuple[MultimodalItem, ...] = field(default=())
    lora_path: str | None = None
    lora_id: int | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and (not isinstance(self.lora, str) or not _as_bytes(self.lora, "lora")):
            raise ConfigError(f"lora must be a non-empty str, got {self.lora!r}")
        if self.lora_path is not None:
            if not isinstance(self.lora_path, str) or not _as_bytes(self.lora_path, "lora_path"):
                raise ConfigError(f"lora_path must be a non-empty str, got {self.lora_path!r}")
            if self.lora is None:
                raise ConfigError("lora_path is given without lora: a path names an adapter only with its name")
        if self.lora_id is not None:
            if isinstance(self.lora_id, bool) or not isinstance(self.lora_id, int) or self.lora_id < 1:
                raise ConfigError(f"lora_id must be an int >= 1, got {self.lora_id!r}")
            if self.lora is None:
                raise ConfigError("lora_id is given without lora: an id names an adapter only with its name")
        if self.cache_salt is not None and not _as_bytes(self.cache_salt, "cache_salt"):
            raise ConfigError("cache_salt must not be empty")
        items = tuple(self.mm_items)
        for item in items:
            if not isinstance(item, MultimodalItem):
                raise ConfigError(f"mm_items must hold MultimodalItem, got {type(item).__name__}")
        canonical = tuple(sorted(items, key=lambda it: (it.offset, it.length, _as_bytes(it.digest, ""))))
        object.__setattr__(self, "mm_items", canonical)

    @property
    def is_empty(self) -> bool:
        return self.lora is None and self.cache_salt is None and not self.mm_items

    def framer(self, block_size: int) -> _Framer | None:
        """A function from block index to that block's extra frames, or None when there are none."""
        if self.is_empty:
            return None
        return _build_framer(self, block_size)


@lru_cache(maxsize=256)
def _build_framer(extras: BlockExtras, block_size: int) -> _Framer:
    lora = _frame(_TAG_LORA, extras.lora.encode("utf-8")) if extras.lora is not None else b""
    if extras.lora_path is not None:
        lora += _frame(_TAG_LORA_PATH, extras.lora_path.encode("utf-8"))
    salt = _frame(_TAG_CACHE_SALT, _as_bytes(extras.cache_salt, "cache_salt")) if extras.cache_salt else b""
    per_block: dict[int, bytes] = {}
    for item in extras.mm_items:
        frame = item.frame()
        for index in blocks_overlapping(item.offset, item.length, block_size):
            per_block[index] = per_block.get(index, b"") + frame
    first = lora + salt
    get = per_block.get

    def frames(index: int) -> bytes:
        return (first if index == 0 else lora) + get(index, b"")

    return frames
