"""Block identity: schemes against their definitions, namespaces, typed extras, boundaries, increments."""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import kvblocks
from kvblocks import BlockExtras, BlockHasher, HashedTokens, MultimodalItem, Namespace, block_hashes, blocks_overlapping
from kvblocks.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidBlockHashError,
    InvalidTokenError,
    SequenceStateError,
)
from kvblocks.hashing import HASH_SCHEMES, PrecomputedHashes, pack_tokens

SCHEMES = ["xxh3-128", "sha256", "xxh3-64-1337"]
token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=80)


def u32le(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def frame(tag: int, payload: bytes) -> bytes:
    """The documented extra-key frame: tag byte, u32 LE payload length, payload."""
    return bytes([tag]) + len(payload).to_bytes(4, "little") + payload


# ----------------------------------------------------------------- the interop standard


def dynamo_sequence_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The XXH3-64 (seed 1337) standard, written straight from its definition."""
    out: list[int] = []
    for i in range(len(tokens) // block_size):
        local = xxhash.xxh3_64_intdigest(u32le(tokens[i * block_size : (i + 1) * block_size]), seed=1337)
        if i == 0:
            out.append(local)
        else:
            out.append(xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed=1337))
    return out


def test_xxh3_64_1337_known_vector() -> None:
    tokens = list(range(1, 9))
    local0 = xxhash.xxh3_64_intdigest(struct.pack("<4I", 1, 2, 3, 4), seed=1337)
    local1 = xxhash.xxh3_64_intdigest(struct.pack("<4I", 5, 6, 7, 8), seed=1337)
    seq1 = xxhash.xxh3_64_intdigest(local0.to_bytes(8, "little") + local1.to_bytes(8, "little"), seed=1337)
    assert block_hashes(tokens, 4, scheme="xxh3-64-1337") == [local0, seq1]
    assert all(type(h) is int for h in block_hashes(tokens, 4, scheme="xxh3-64-1337"))


@given(tokens=token_lists, block_size=st.sampled_from([1, 2, 4, 16]))
def test_xxh3_64_1337_matches_standard(tokens: list[int], block_size: int) -> None:
    assert block_hashes(tokens, block_size, scheme="xxh3-64-1337") == dynamo_sequence_hashes(tokens, block_size)


def test_xxh3_64_1337_non_default_namespace_leaves_the_standard() -> None:
    tokens = list(range(32))
    standard = block_hashes(tokens, 16, scheme="xxh3-64-1337")
    named = block_hashes(tokens, 16, scheme="xxh3-64-1337", namespace="llama-3-8b")
    assert not set(standard) & set(named)


# ----------------------------------------------------------------- digest chains


@pytest.mark.parametrize(
    "scheme, digest",
    [("xxh3-128", xxhash.xxh3_128_digest), ("sha256", lambda b: hashlib.sha256(b).digest())],
)
def test_digest_chain_definition(scheme: str, digest) -> None:
    tokens = [7, 1, 4, 4, 9, 9, 0, 2, 5, 3]
    hasher = BlockHasher(4, scheme=scheme, namespace=Namespace("m", salt="s"))
    root = hasher.root
    h0 = digest(root + u32le(tokens[0:4]))
    h1 = digest(h0 + u32le(tokens[4:8]))
    assert hasher.hash_tokens(tokens) == [h0, h1]
    material = (
        b"kvblocks/root/v1"
        + frame(0x01, scheme.encode())
        + frame(0x02, (4).to_bytes(4, "little"))
        + frame(0x03, b"m")
        + frame(0x04, b"s")
    )
    assert root == digest(material)


def test_default_scheme_is_xxh3_128_bytes() -> None:
    hashes = block_hashes(list(range(64)), 16)
    assert len(hashes) == 4 and all(isinstance(h, bytes) and len(h) == 16 for h in hashes)
    assert hashes == block_hashes(list(range(64)), 16, scheme="xxh3-128")
    assert all(len(h) == 32 for h in block_hashes(list(range(64)), 16, scheme="sha256"))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_only_full_blocks_are_hashed(scheme: str) -> None:
    assert block_hashes(list(range(15)), 16, scheme=scheme) == []
    assert len(block_hashes(list(range(16)), 16, scheme=scheme)) == 1
    assert len(block_hashes(list(range(47)), 16, scheme=scheme)) == 2
    # A partial trailing block never changes the hashes of the full ones.
    assert block_hashes(list(range(47)), 16, scheme=scheme) == block_hashes(list(range(32)), 16, scheme=scheme)


def test_hashes_identical_across_processes_and_hash_seeds() -> None:
    code = "import kvblocks; print(kvblocks.block_hashes(list(range(100)), 16)[-1].hex())"
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outputs.add(
            subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        )
    assert outputs == {block_hashes(list(range(100)), 16)[-1].hex() + "\n"}


@pytest.mark.parametrize("scheme", ["xxh3-128", "sha256"])
def test_namespace_model_salt_and_block_size_separate_key_spaces(scheme: str) -> None:
    tokens = list(range(64))
    variants = [
        block_hashes(tokens, 16, scheme=scheme),
        block_hashes(tokens, 16, scheme=scheme, namespace="llama"),
        block_hashes(tokens, 16, scheme=scheme, namespace=Namespace("llama", salt="tenant-a")),
        block_hashes(tokens, 16, scheme=scheme, namespace=Namespace("llama", salt=b"tenant-b")),
        block_hashes(tokens, 8, scheme=scheme),
    ]
    seen: set[bytes] = set()
    for hashes in variants:
        assert not seen & set(hashes)
        seen |= set(hashes)
    assert block_hashes(tokens, 16, namespace="default") == block_hashes(tokens, 16, namespace=Namespace())


# ----------------------------------------------------------------- extras


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lora_and_salt_with_the_same_name_differ(scheme: str) -> None:
    tokens = list(range(32))
    lora = block_hashes(tokens, 16, scheme=scheme, extras=BlockExtras(lora="x"))
    salt = block_hashes(tokens, 16, scheme=scheme, extras=BlockExtras(cache_salt="x"))
    plain = block_hashes(tokens, 16, scheme=scheme)
    assert len({lora[0], salt[0], plain[0]}) == 3
    assert len({lora[1], salt[1], plain[1]}) == 3


@pytest.mark.parametrize("scheme", ["xxh3-128", "sha256"])
def test_first_block_extra_digest_never_poses_as_a_parent(scheme: str) -> None:
    """Block 0 carrying extra digest d must not hash like a later block whose parent hash is d."""
    hasher = BlockHasher(4, scheme=scheme)
    parent = hasher.hash_tokens([1, 2, 3, 4])[0]
    later = hasher.hash_packed(pack_tokens([5, 6, 7, 8]), 0, 1, parent)[0]
    item = MultimodalItem(digest=parent, offset=0, length=4)
    first = hasher.hash_packed(pack_tokens([5, 6, 7, 8]), 0, 1, hasher.root, BlockExtras(mm_items=(item,)).framer(4))
    assert first[0] != later
    # Even a caller who hands the digest over as the chain root gets a different hash: the frame is typed.
    posing = hasher.hash_packed(pack_tokens([5, 6, 7, 8]), 0, 1, parent, BlockExtras(lora="x").framer(4))
    assert posing[0] != later


@given(
    tokens=st.lists(st.integers(0, 50), min_size=8, max_size=40),
    a=st.sampled_from(["m1", "m2"]),
    b=st.sampled_from(["m1", "m2"]),
    salt_a=st.sampled_from([None, "s1", "s2"]),
    salt_b=st.sampled_from([None, "s1", "s2"]),
    lora_a=st.sampled_from([None, "l1", "l2"]),
    lora_b=st.sampled_from([None, "l1", "l2"]),
)
def test_different_model_salt_or_lora_never_share_a_hash(tokens, a, b, salt_a, salt_b, lora_a, lora_b) -> None:
    ha = block_hashes(tokens, 4, namespace=a, extras=BlockExtras(lora=lora_a, cache_salt=salt_a))
    hb = block_hashes(tokens, 4, namespace=b, extras=BlockExtras(lora=lora_b, cache_salt=salt_b))
    if (a, salt_a, lora_a) == (b, salt_b, lora_b):
        assert ha == hb
    else:
        assert not set(ha) & set(hb)


def test_empty_extras_hash_like_no_extras() -> None:
    tokens = list(range(32))
    assert block_hashes(tokens, 16, extras=BlockExtras()) == block_hashes(tokens, 16)


def test_salt_is_framed_into_block_zero_only() -> None:
    framer = BlockExtras(cache_salt="t", lora="l").framer(4)
    assert framer is not None
    assert framer(0) == frame(0x10, b"l") + frame(0x11, b"t")
    assert framer(1) == frame(0x10, b"l")


def test_mm_items_are_framed_into_exactly_the_blocks_they_overlap() -> None:
    item = MultimodalItem(digest=b"img", offset=4, length=4)
    framer = BlockExtras(mm_items=(item,)).framer(4)
    assert framer is not None
    item_frame = frame(0x12, (4).to_bytes(8, "little") + (4).to_bytes(8, "little") + b"img")
    assert [framer(i) for i in range(3)] == [b"", item_frame, b""]
    # Hash level: block 0 is untouched by an item that starts where block 1 starts.
    tokens = list(range(12))
    with_item = block_hashes(tokens, 4, extras=BlockExtras(mm_items=(item,)))
    plain = block_hashes(tokens, 4)
    assert with_item[0] == plain[0] and with_item[1] != plain[1]
    assert with_item[1] == xxhash.xxh3_128_digest(plain[0] + u32le(tokens[4:8]) + item_frame)


def test_mm_item_order_is_canonical() -> None:
    x = MultimodalItem(b"x", 0, 4)
    y = MultimodalItem(b"y", 2, 4)
    assert block_hashes(range(8), 4, extras=BlockExtras(mm_items=(x, y))) == block_hashes(
        range(8), 4, extras=BlockExtras(mm_items=(y, x))
    )


def test_mm_digest_and_position_both_matter() -> None:
    tokens = list(range(16))
    base = block_hashes(tokens, 4, extras=BlockExtras(mm_items=(MultimodalItem(b"a", 4, 4),)))
    other_digest = block_hashes(tokens, 4, extras=BlockExtras(mm_items=(MultimodalItem(b"b", 4, 4),)))
    other_place = block_hashes(tokens, 4, extras=BlockExtras(mm_items=(MultimodalItem(b"a", 5, 3),)))
    assert base[0] == other_digest[0] == other_place[0]
    assert len({base[1], other_digest[1], other_place[1]}) == 3


@pytest.mark.parametrize(
    "offset, length, expected",
    [(2, 2, [0]), (3, 2, [0, 1]), (4, 4, [1]), (0, 12, [0, 1, 2]), (0, 4, [0]), (7, 1, [1]), (8, 1, [2])],
)
def test_blocks_overlapping_half_open(offset: int, length: int, expected: list[int]) -> None:
    assert list(blocks_overlapping(offset, length, 4)) == expected


@given(offset=st.integers(0, 200), length=st.integers(0, 100), block_size=st.integers(1, 32))
def test_blocks_overlapping_matches_per_token_attribution(offset: int, length: int, block_size: int) -> None:
    brute = sorted({token // block_size for token in range(offset, offset + length)})
    assert list(blocks_overlapping(offset, length, block_size)) == brute


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lora": ""},
        {"lora": 3},
        {"cache_salt": ""},
        {"cache_salt": 5},
        {"mm_items": ("not an item",)},
    ],
)
def test_bad_extras_are_refused(kwargs) -> None:
    with pytest.raises(ConfigError):
        BlockExtras(**kwargs)


@pytest.mark.parametrize("args", [(b"", 0, 1), (b"d", -1, 1), (b"d", 0, 0), (b"d", 1.5, 1), (b"d", True, 1), (7, 0, 1)])
def test_bad_mm_items_are_refused(args) -> None:
    with pytest.raises(ConfigError):
        MultimodalItem(*args)


# ----------------------------------------------------------------- tokens


@pytest.mark.parametrize("scheme", SCHEMES)
def test_numpy_tokens_hash_like_python_ints(scheme: str) -> None:
    tokens = [0, 5, 2**31, 2**32 - 1] * 8
    expected = block_hashes(tokens, 4, scheme=scheme)
    assert block_hashes([np.int64(t) for t in tokens], 4, scheme=scheme) == expected
    assert block_hashes(np.array(tokens, dtype=np.int64), 4, scheme=scheme) == expected
    assert block_hashes(np.array(tokens, dtype=np.uint32), 4, scheme=scheme) == expected
    assert block_hashes(tuple(tokens), 4, scheme=scheme) == expected
    small = [1, 2, 3, 4, 5, 6, 7, 8]
    assert block_hashes(np.array(small, dtype=np.int16), 4, scheme=scheme) == block_hashes(small, 4, scheme=scheme)


@pytest.mark.parametrize(
    "tokens, position",
    [
        ([1, 2, -1, 4], 2),
        ([1, 2**32], 1),
        ([1.0, 2], 0),
        ([1, "2"], 1),
        ([1, None], 1),
        (np.array([3, -7]), 1),
        (np.array([0, 2**33]), 1),
    ],
)
def test_bad_tokens_name_their_position(tokens, position: int) -> None:
    with pytest.raises(InvalidTokenError, match=f"position {position}"):
        block_hashes(tokens, 2)


def test_iterators_of_tokens_are_accepted_and_errors_name_the_position() -> None:
    assert block_hashes(iter(range(8)), 4) == block_hashes(list(range(8)), 4)
    with pytest.raises(InvalidTokenError, match="position 3"):
        block_hashes((t for t in [0, 1, 2, -3]), 2)


@pytest.mark.parametrize("tokens", [np.array([1.0, 2.0]), np.zeros((2, 2), dtype=np.int64), "1234", b"1234", 5, None])
def test_bad_token_containers_are_refused(tokens) -> None:
    with pytest.raises(InvalidTokenError):
        block_hashes(tokens, 2)


def test_unknown_scheme_and_bad_block_size() -> None:
    with pytest.raises(ConfigError, match="unknown hash scheme"):
        block_hashes([1, 2], 2, scheme="md5")
    with pytest.raises(ConfigError, match="unknown hash scheme"):
        block_hashes([1, 2], 2, scheme=["xxh3-128"])  # type: ignore[arg-type]
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ConfigError, match="block_size"):
            block_hashes([1, 2], bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="namespace"):
        block_hashes([1, 2], 2, namespace="")


# ----------------------------------------------------------------- incremental hashing


@settings(max_examples=200)
@given(
    tokens=st.lists(st.integers(0, 1000), max_size=120),
    cuts=st.lists(st.integers(0, 120), max_size=6),
    block_size=st.sampled_from([1, 3, 4, 16]),
    scheme=st.sampled_from(SCHEMES),
    with_extras=st.booleans(),
)
def test_piecewise_hashing_equals_one_shot(tokens, cuts, block_size, scheme, with_extras) -> None:
    extras = BlockExtras(lora="l", cache_salt="s", mm_items=(MultimodalItem(b"m", 3, 9),)) if with_extras else None
    hasher = BlockHasher(block_size, scheme=scheme)
    points = sorted({min(c, len(tokens)) for c in cuts} | {0, len(tokens)})
    seq = HashedTokens(hasher, tokens[: points[0]], extras)
    for a, b in itertools.pairwise(points):
        seq.extend(tokens[a:b])
    assert seq.hashes == hasher.hash_tokens(tokens, extras)
    assert seq.num_tokens == len(tokens)
    assert seq.token_ids == tuple(tokens)


def test_long_prompt_numpy_path_matches_small_path() -> None:
    """Long runs go through numpy views, short runs through slices: same hashes either way."""
    tokens = list(range(16 * 40))
    hasher = BlockHasher(16)
    seq = HashedTokens(hasher)
    for i in range(0, len(tokens), 16):
        seq.extend(tokens[i : i + 16])  # one block at a time: the slicing path
    assert seq.hashes == hasher.hash_tokens(tokens)  # 40 blocks at once: the numpy path


def test_hashed_tokens_keep_their_own_copy() -> None:
    tokens = [1, 2, 3, 4, 5]
    seq = HashedTokens(BlockHasher(2), tokens)
    before = list(seq.hashes)
    tokens[0] = 99
    tokens.append(7)
    assert seq.token_ids == (1, 2, 3, 4, 5) and seq.hashes == before


def test_extend_with_bad_tokens_changes_nothing() -> None:
    seq = HashedTokens(BlockHasher(2), [1, 2, 3])
    with pytest.raises(InvalidTokenError):
        seq.extend([4, -5])
    assert seq.token_ids == (1, 2, 3) and seq.num_tokens == 3 and len(seq.hashes) == 1


def test_precomputed_hashes_are_validated() -> None:
    ok = PrecomputedHashes([1, 2, b"\x03"], 50, 16)
    assert ok.hashes == [1, 2, b"\x03"] and ok.num_tokens == 50
    with pytest.raises(InvalidBlockHashError, match="exactly 3"):
        PrecomputedHashes([1, 2], 50, 16)
    with pytest.raises(InvalidBlockHashError, match="position 2 repeats"):
        PrecomputedHashes([1, 2, 1], 50, 16)
    for bad in ([-1, 2, 3], [1.5, 2, 3], [b"", 2, 3], [True, 2, 3]):
        with pytest.raises(InvalidBlockHashError):
            PrecomputedHashes(bad, 50, 16)
    with pytest.raises(SequenceStateError):
        ok.extend([1])
    assert PrecomputedHashes([np.uint64(5)], 16, 16).hashes == [5]


def test_public_api_is_exported() -> None:
    assert kvblocks.block_hashes is block_hashes
    for name in kvblocks.__all__:
        assert hasattr(kvblocks, name), name


@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.data())
@settings(max_examples=100, deadline=None)
def test_truncate_takes_an_append_back_exactly(tokens: list[int], data) -> None:
    hasher = BlockHasher(4)
    keep = data.draw(st.integers(0, len(tokens)))
    extra = data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=12))
    content = HashedTokens(hasher, tokens)
    content.extend(extra)
    content.truncate(len(tokens))
    assert content.token_ids == tuple(tokens) and content.hashes == HashedTokens(hasher, tokens).hashes
    content.truncate(keep)
    assert content.num_tokens == keep and content.hashes == HashedTokens(hasher, tokens[:keep]).hashes
    with pytest.raises(InvalidArgumentError):
        content.truncate(keep + 1)


_HASH_LIKE = st.one_of(
    st.integers(min_value=-3, max_value=3),
    st.integers(min_value=0, max_value=(1 << 64) - 1),
    st.integers(min_value=1 << 64, max_value=1 << 80),
    st.integers(max_value=-1),
    st.booleans(),
    st.binary(max_size=3),
    st.integers(min_value=0, max_value=(1 << 63) - 1).map(np.int64),
    st.integers(min_value=0, max_value=(1 << 64) - 1).map(np.uint64),
    st.floats(allow_nan=False),
    st.none(),
)


def _oracle_hash(h: object) -> object:
    """What one item of a valid chain becomes, or None when it is refused (written apart from the code)."""
    if type(h) is bytes:
        return h if h else None
    if isinstance(h, bool) or not isinstance(h, int | np.integer):
        return None
    return int(h) if h >= 0 else None


@settings(max_examples=400, deadline=None)
@given(st.lists(_HASH_LIKE, max_size=8), st.booleans())
def test_validate_block_hashes_takes_exactly_the_valid_chains(hashes: list[object], distinct: bool) -> None:
    """The C fast path (plain ints, or all bytes) and the per-item path agree with the per-item rules: ints >= 0
    (numpy integers become ints, bools are refused), non-empty bytes, no repeat unless ``distinct=False``."""
    from kvblocks.hashing import validate_block_hashes

    expected = [_oracle_hash(h) for h in hashes]
    ok = None not in expected and (not distinct or len(set(expected)) == len(expected))  # type: ignore[arg-type]
    if not ok:
        with pytest.raises(InvalidBlockHashError):
            validate_block_hashes(hashes, distinct=distinct)  # type: ignore[arg-type]
        return
    got = validate_block_hashes(hashes, distinct=distinct)  # type: ignore[arg-type]
    assert got == expected and [type(h) for h in got] == [type(h) for h in expected]


@pytest.mark.parametrize("bad", [[5, -1], (5, 1 << 32), [5, 1.5], (5, "6"), [5, None]])
def test_a_bad_token_in_an_appended_list_or_tuple_changes_nothing(bad) -> None:
    """The list/tuple append packs straight into the sequence's tokens; a bad token takes back what it
    packed before it, and the error names the bad position as pack_tokens does."""
    content = HashedTokens(BlockHasher(4), list(range(6)))
    hashes = list(content.hashes)
    with pytest.raises(InvalidTokenError, match="position 1"):
        content.extend(bad)
    assert content.token_ids == tuple(range(6)) and content.num_tokens == 6 and content.hashes == hashes
    assert content.extend((6, 7)) == 1 and content.hashes[1] == HashedTokens(BlockHasher(4), range(8)).hashes[1]


@settings(max_examples=50, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    decoded=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    size=st.integers(1, 8),
)
def test_appending_one_token_at_a_time_hashes_as_extending_does(prompt, decoded, size) -> None:
    """The decode step's append_token gives the tokens, hashes and new-block counts extend gives."""
    hasher = BlockHasher(size)
    one, many = HashedTokens(hasher, prompt), HashedTokens(hasher, prompt)
    for token in decoded:
        assert one.append_token(token) == many.extend([token])
        assert (one.num_tokens, one.hashes, one.token_ids) == (many.num_tokens, many.hashes, many.token_ids)


@settings(max_examples=80, deadline=None)
@given(
    scheme=st.sampled_from(sorted(HASH_SCHEMES)),
    tokens=st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=70),
    size=st.sampled_from([1, 4, 16]),
)
def test_decoding_token_by_token_hashes_as_one_call_does(scheme: str, tokens: list[int], size: int) -> None:
    """A decode hashes each block as its last token (or the one its hash also covers) arrives, through the
    scheme's one-block shortcut where it has one: the hashes are the one-shot chain's, for every scheme."""
    hasher = BlockHasher(size, scheme=scheme)
    hashed = HashedTokens(hasher, tokens[:1])
    for token in tokens[1:]:
        hashed.append_token(token)
    assert hashed.hashes == hasher.hash_tokens(tokens)
    one = HASH_SCHEMES[scheme].one_block
    if one is not None and hashed.hashes:
        parent = hasher.root
        block = struct.pack(f"<{size + hasher.lookahead}I", *tokens[: size + hasher.lookahead])
        assert one(parent, block) == hashed.hashes[0]
