"""vLLM's block hashes: kvblocks' ``vllm-*`` schemes against vectors made by vLLM 0.33's own code
(``tests/data/vllm_hash_vectors.json``, from ``tools/vectors/make_vllm_hash_vectors.py``), against an
independent re-statement of vLLM's algorithm on random inputs, and on bad input."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.config import CacheConfig
from kvblocks.errors import ConfigError, InvalidBlockHashError, InvalidTokenError
from kvblocks.hashing import (
    HASH_SCHEMES,
    BlockExtras,
    BlockHasher,
    HashedTokens,
    MultimodalItem,
    Namespace,
    block_hashes,
    get_scheme,
    pack_tokens,
    vllm_extra_keys,
    vllm_int_hash,
)

VECTORS = json.loads((Path(__file__).parents[1] / "data" / "vllm_hash_vectors.json").read_text())
CONFIGS = {c["id"]: c for c in VECTORS["configs"]}
CASES = {c["name"]: c for c in VECTORS["cases"]}
SCHEME_OF = {
    "sha256": "vllm-sha256",
    "sha256_cbor": "vllm-sha256-cbor",
    "xxhash": "vllm-xxhash",
    "xxhash_cbor": "vllm-xxhash-cbor",
}
VLLM_SCHEMES = list(SCHEME_OF.values())


def tokens_of(case: dict[str, Any]) -> list[int]:
    spec = case["tokens"]
    if isinstance(spec, dict):  # the generator's rule for long prompts
        n, mul, add = spec["affine"]
        return [(mul * i + add) % 2**32 for i in range(n)]
    return list(spec)


def extras_of(case: dict[str, Any]) -> BlockExtras | None:
    """The case's extras, every equal string one object: vLLM's hash must not depend on the caller's objects."""
    one = lambda text: None if text is None else sys.intern(text)  # noqa: E731
    lora, path = case["lora"] if case["lora"] is not None else (None, None)
    items = tuple(MultimodalItem(one(ident), offset, length) for ident, offset, length in case["mm"])
    extras = BlockExtras(lora=one(lora), lora_path=one(path), cache_salt=one(case["cache_salt"]), mm_items=items)
    return None if extras.is_empty else extras


def namespace_of(config: dict[str, Any]) -> Namespace:
    seed = config["PYTHONHASHSEED"]
    return Namespace() if seed is None else Namespace(salt=seed)


def expected(case_name: str, config_id: str) -> tuple[list[bytes], list[int]]:
    result = CASES[case_name]["results"][config_id]
    return [bytes.fromhex(h) for h in result["hashes"]], result["ints"]


PAIRS = [(case, config) for case in CASES for config in CONFIGS]

# ------------------------------------------------------------------------------------ the vectors


def test_the_vectors_cover_what_they_should() -> None:
    assert VECTORS["versions"]["vllm"] == "0.33.0"
    assert {c["hash_fn"] for c in CONFIGS.values()} == set(SCHEME_OF)
    assert {1, 2, 3, 4, 16, 24, 256, 10_000} <= {c["block_size"] for c in CASES.values()}
    tokens = {t for c in CASES.values() for t in tokens_of(c)}
    assert {0, 2**31 - 1, 2**31, 2**32 - 1} <= tokens
    assert any(c["lora"] and c["mm"] and c["cache_salt"] for c in CASES.values())


@pytest.mark.parametrize("config_id", list(CONFIGS))
def test_roots_are_vllm_none_hash(config_id: str) -> None:
    config = CONFIGS[config_id]
    for block_size in (1, 16):
        hasher = BlockHasher(block_size, SCHEME_OF[config["hash_fn"]], namespace_of(config))
        assert hasher.root == bytes.fromhex(config["none_hash"])
    assert (config["PYTHONHASHSEED"] or "vllm-none-hash") == config["seed"]


@pytest.mark.parametrize("case_name, config_id", PAIRS)
def test_block_hashes_reproduce_vllm(case_name: str, config_id: str) -> None:
    case, config = CASES[case_name], CONFIGS[config_id]
    hashes, ints = expected(case_name, config_id)
    scheme, namespace = SCHEME_OF[config["hash_fn"]], namespace_of(config)
    got = block_hashes(tokens_of(case), case["block_size"], scheme=scheme, namespace=namespace, extras=extras_of(case))
    assert got == hashes
    assert [vllm_int_hash(h) for h in got] == ints


@pytest.mark.parametrize("case_name, config_id", PAIRS)
def test_incremental_hashing_reproduces_vllm(case_name: str, config_id: str) -> None:
    """HashedTokens fed in random pieces (and BlockHasher in one call) give vLLM's hashes."""
    case, config = CASES[case_name], CONFIGS[config_id]
    hashes, _ = expected(case_name, config_id)
    tokens, block_size = tokens_of(case), case["block_size"]
    hasher = BlockHasher(block_size, SCHEME_OF[config["hash_fn"]], namespace_of(config))
    assert hasher.hash_tokens(tokens, extras_of(case)) == hashes
    rng = random.Random(case_name + config_id)
    cut = rng.randrange(len(tokens) + 1)
    seq = HashedTokens(hasher, tokens[:cut], extras_of(case))
    while seq.num_tokens < len(tokens):
        seq.extend(tokens[seq.num_tokens : seq.num_tokens + rng.randrange(1, 2 * block_size + 2)])
    assert seq.hashes == hashes


@pytest.mark.parametrize("case_name", list(CASES))
def test_extra_keys_are_vllms(case_name: str) -> None:
    case = CASES[case_name]
    keys = vllm_extra_keys(extras_of(case), case["block_size"], len(case["extra_keys"]))

    def as_json(value: Any) -> Any:
        return [as_json(v) for v in value] if isinstance(value, tuple) else value

    assert [as_json(k) for k in keys] == case["extra_keys"]


def test_int_form_is_vllms_maybe_convert_block_hash() -> None:
    """Every recorded hash's int form (vLLM's maybe_convert_block_hash) is vllm_int_hash of it."""
    pairs = [
        (bytes.fromhex(h), i)
        for case in CASES.values()
        for result in case["results"].values()
        for h, i in zip(result["hashes"], result["ints"], strict=True)
    ]
    assert len(pairs) > 500
    assert all(vllm_int_hash(h) == i for h, i in pairs)
    assert all(vllm_int_hash(i) == i for _, i in pairs)


# ------------------------------------------------------------------------------------ an independent oracle


def _copy(text: str) -> str:
    """A distinct str object where CPython makes one (an engine decodes each value separately)."""
    return (text + "\x00")[:-1]


def _cbor(value: Any) -> bytes:
    """Canonical CBOR, straight from RFC 8949 section 4.2.1, for None/int/str/bytes/tuple."""

    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major * 32 + n])
        for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
            if n < 256 ** struct.calcsize(fmt):
                return bytes([major * 32 + extra]) + struct.pack(fmt, n)
        raise ValueError(n)

    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return head(0, value) if value >= 0 else head(1, -1 - value)
    if isinstance(value, bytes):
        return head(2, len(value)) + value
    if isinstance(value, str):
        return head(3, len(value.encode())) + value.encode()
    return head(4, len(value)) + b"".join(_cbor(v) for v in value)


SERIALIZE = {"pickle": lambda x: pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL), "cbor": _cbor}
DIGEST = {"sha256": lambda b: hashlib.sha256(b).digest(), "xxhash": xxhash.xxh3_128_digest}


def oracle(scheme: str, tokens: list[int], block_size: int, seed: str, extras: dict[str, Any]) -> list[bytes]:
    """vLLM's algorithm as its source reads: keys per block, then hash((parent, tuple(tokens), keys))."""
    digest = DIGEST["sha256" if "sha256" in scheme else "xxhash"]
    serialize = SERIALIZE["cbor" if scheme.endswith("cbor") else "pickle"]
    parent = digest(serialize(seed))
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        keys: list[tuple[Any, ...]] = []
        if extras["lora"]:
            keys.append(("lora", _copy(extras["lora"][0]), _copy(extras["lora"][1])))
        for ident, offset, length in extras["mm"]:
            if offset < end and start < offset + length:
                keys.append(("mm", _copy(ident), offset - start))
        if start == 0 and extras["salt"]:
            keys.append(("cache_salt", _copy(extras["salt"])))
        parent = digest(serialize((parent, tuple(tokens[start:end]), tuple(keys) or None)))
        out.append(parent)
    return out


edge_tokens = st.sampled_from([0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1])
tokens_st = st.lists(st.one_of(edge_tokens, st.integers(0, 2**32 - 1)), max_size=70)
text_st = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)


@st.composite
def extras_st(draw: st.DrawFn) -> dict[str, Any]:
    lora = draw(st.none() | st.tuples(text_st, text_st))
    salt = draw(st.none() | text_st)
    mm, offset = [], 0
    for _ in range(draw(st.integers(0, 4))):  # sorted, non-overlapping, as vLLM's are
        offset += draw(st.integers(0, 9))
        length = draw(st.integers(1, 12))
        mm.append((draw(st.sampled_from(["img", "x"]) | text_st), offset, length))
        offset += length
    return {"lora": lora, "salt": salt, "mm": mm}


def to_block_extras(extras: dict[str, Any]) -> BlockExtras:
    lora, path = extras["lora"] or (None, None)
    items = tuple(MultimodalItem(i, o, n) for i, o, n in extras["mm"])
    return BlockExtras(lora=lora, lora_path=path, cache_salt=extras["salt"], mm_items=items)


@settings(max_examples=300, deadline=None)
@given(
    scheme=st.sampled_from(VLLM_SCHEMES),
    tokens=tokens_st,
    block_size=st.integers(1, 9),
    seed=st.none() | st.sampled_from(["0", "42", "4294967295"]),
    extras=extras_st(),
)
def test_scheme_matches_the_restated_algorithm(scheme, tokens, block_size, seed, extras) -> None:
    namespace = Namespace() if seed is None else Namespace(salt=seed)
    want = oracle(scheme, tokens, block_size, seed or "vllm-none-hash", extras)
    assert block_hashes(tokens, block_size, scheme=scheme, namespace=namespace, extras=to_block_extras(extras)) == want


@settings(max_examples=100, deadline=None)
@given(
    scheme=st.sampled_from(VLLM_SCHEMES),
    tokens=tokens_st,
    block_size=st.integers(1, 6),
    extras=extras_st(),
    data=st.data(),
)
def test_piecewise_extension_equals_one_shot(scheme, tokens, block_size, extras, data) -> None:
    hasher = BlockHasher(block_size, scheme)
    seq = HashedTokens(hasher, [], to_block_extras(extras))
    while seq.num_tokens < len(tokens):
        step = data.draw(st.integers(1, len(tokens) - seq.num_tokens))
        seq.extend(tokens[seq.num_tokens : seq.num_tokens + step])
    assert seq.hashes == hasher.hash_tokens(tokens, to_block_extras(extras))


@pytest.mark.parametrize("scheme", ["vllm-sha256", "vllm-xxhash"])
@pytest.mark.parametrize("block_size", [9355, 9356, 9357])
def test_blocks_around_one_pickle_frame(scheme: str, block_size: int) -> None:
    """Block 9356 of 7-byte ints pickles to a 65534-byte frame, 9357 to two frames: both as pickle writes."""
    tokens = [2**31 + i for i in range(2 * block_size)]
    extras = {"lora": ("n", "/p"), "mm": [], "salt": None}
    got = block_hashes(tokens, block_size, scheme=scheme, extras=to_block_extras(extras))
    assert got == oracle(scheme, tokens, block_size, "vllm-none-hash", extras)


def test_one_char_strings_are_shared_as_in_cpython() -> None:
    """lora "a" at path "a": CPython has one "a", pickle writes it once and refers back: so does vLLM."""
    extras = {"lora": ("a", "a"), "mm": [], "salt": None}
    assert block_hashes([1, 2], 1, scheme="vllm-sha256", extras=to_block_extras(extras)) == oracle(
        "vllm-sha256", [1, 2], 1, "vllm-none-hash", extras
    )
    assert CASES["lora-one-char"]["lora"] == ["a", "a"]  # and the vectors pin it from vLLM's side


# ------------------------------------------------------------------------------------ registry, config, kvblocks' own


def test_schemes_are_registered() -> None:
    for name in VLLM_SCHEMES:
        assert name in HASH_SCHEMES
        assert get_scheme(name).name == name
        assert CacheConfig(num_blocks=4, block_size=16, hash_scheme=name).hash_scheme == name
    assert {len(h) for h in block_hashes(range(32), 16, scheme="vllm-sha256")} == {32}
    assert {len(h) for h in block_hashes(range(32), 16, scheme="vllm-xxhash-cbor")} == {16}


def test_namespace_model_does_not_enter_vllm_hashes() -> None:
    tokens = list(range(48))
    assert block_hashes(tokens, 16, scheme="vllm-sha256", namespace="llama") == block_hashes(
        tokens, 16, scheme="vllm-sha256", namespace="qwen"
    )
    assert block_hashes(tokens, 16, scheme="vllm-sha256", namespace=Namespace(salt="1")) != block_hashes(
        tokens, 16, scheme="vllm-sha256"
    )


# Computed with kvblocks/hashing.py at ca3c5f8, before lora_path and the vLLM schemes existed.
BEFORE = {
    ("xxh3-128", False): ["54fdd487148d99b5571876670f17f9d0", "54d9ab67684cefeb0c55d96b829221e3"],
    ("xxh3-128", True): ["14a915f39f2a4f29e836a045dff78926", "de3047bf0c91bc0e0014098a32c8339c"],
    ("sha256", False): [
        "ed418e51b3042c37a55e7e42b0de1c2a135eea92f0663a82399db41c9a01939d",
        "18415bc841537ec86987e35a0ad293c95386cd4153bc7dda59be7064499b4370",
    ],
    ("sha256", True): [
        "731966f4c294c7c1bc236f828e99dcc29845bedae33a955b99cfdd22ffd40756",
        "2b36f1ddf831a9cd68e6edae3a3a59422c19b9699f684214881ea1f6a85f3f3c",
    ],
    ("xxh3-64-1337", False): [1098402431293516424, 13267144788144972063],
    ("xxh3-64-1337", True): [17639088017887649191, 4311987701288420598],
}
BEFORE_TOKENS = [0, 1, 2**32 - 1, 70000, 5, 6, 7, 8, 9, 10, 11, 12]
BEFORE_EXTRAS = BlockExtras(
    lora="adapter", cache_salt="tenant", mm_items=(MultimodalItem("img", 2, 5), MultimodalItem(b"\x01\x02", 9, 3))
)


@pytest.mark.parametrize("scheme, with_extras", list(BEFORE))
def test_kvblocks_own_hashes_are_unchanged(scheme: str, with_extras: bool) -> None:
    extras = BEFORE_EXTRAS if with_extras else None
    got = block_hashes(BEFORE_TOKENS, 4, scheme=scheme, namespace=Namespace("m", salt="x"), extras=extras)
    assert [h.hex() if isinstance(h, bytes) else h for h in got[:2]] == BEFORE[scheme, with_extras]
    if with_extras:  # a LoRA path is a new frame: it changes every block, and only when given
        with_path = BlockExtras(lora="adapter", lora_path="/a", cache_salt="tenant", mm_items=BEFORE_EXTRAS.mm_items)
        changed = block_hashes(BEFORE_TOKENS, 4, scheme=scheme, namespace=Namespace("m", salt="x"), extras=with_path)
        assert all(a != b for a, b in zip(changed, got, strict=True))


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("scheme", VLLM_SCHEMES)
@pytest.mark.parametrize("bad", [[2**32], [-1], [1.5], ["7"], [2**64]])
def test_tokens_out_of_u32_are_refused_and_leave_the_sequence_unchanged(scheme: str, bad: list[Any]) -> None:
    with pytest.raises(InvalidTokenError):
        block_hashes([1, 2, *bad], 1, scheme=scheme)
    seq = HashedTokens(BlockHasher(2, scheme), [1, 2, 3])
    before = (list(seq.hashes), seq.num_tokens, seq.token_ids)
    with pytest.raises(InvalidTokenError):
        seq.extend([4, *bad])
    assert (list(seq.hashes), seq.num_tokens, seq.token_ids) == before


@pytest.mark.parametrize("scheme", VLLM_SCHEMES)
@pytest.mark.parametrize(
    "extras, words",
    [
        (BlockExtras(lora="sql"), "lora_path"),
        (BlockExtras(cache_salt=b"tenant"), "cache_salt"),
        (BlockExtras(mm_items=(MultimodalItem(b"\x01", 0, 4),)), "digest"),
        (BlockExtras(mm_items=(MultimodalItem("a", 0, 4), MultimodalItem("b", 3, 4))), "overlap"),
        (BlockExtras(mm_items=(MultimodalItem("a", 0, 4), MultimodalItem("b", 0, 4))), "overlap"),
    ],
)
def test_extras_vllm_cannot_express_are_refused(scheme: str, extras: BlockExtras, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        block_hashes(range(8), 4, scheme=scheme, extras=extras)
    with pytest.raises(ConfigError, match=words):
        HashedTokens(BlockHasher(4, scheme), range(8), extras)


def test_bad_extras_and_seeds_are_refused() -> None:
    with pytest.raises(ConfigError, match="lora_path"):
        BlockExtras(lora_path="/a")
    with pytest.raises(ConfigError, match="lora_path"):
        BlockExtras(lora="a", lora_path="")
    with pytest.raises(ConfigError, match="seed"):
        BlockHasher(16, "vllm-sha256", Namespace(salt=b"0"))
    for field in ("cache_salt", "lora"):  # a lone surrogate has no UTF-8 (nor CBOR) form
        with pytest.raises(ConfigError, match="UTF-8"):
            BlockExtras(**{field: "\ud800"})
    with pytest.raises(ConfigError, match="UTF-8"):
        BlockExtras(lora="a", lora_path="\udfff")
    with pytest.raises(ConfigError, match="UTF-8"):
        MultimodalItem("\ud800", 0, 1)


def test_chain_refuses_foreign_parents_and_framers() -> None:
    hasher = BlockHasher(4, "vllm-sha256")
    tokens = hasher.hash_tokens(range(8))
    with pytest.raises(InvalidBlockHashError):
        hasher.hash_packed(pack_tokens(range(8)), 0, 2, b"\x00" * 16)
    with pytest.raises(InvalidBlockHashError):
        hasher.hash_packed(pack_tokens(range(8)), 0, 2, 7)
    kvblocks_framer = BlockExtras(lora="x").framer(4)
    with pytest.raises(ConfigError, match="make_framer"):
        hasher.hash_packed(pack_tokens(range(8)), 0, 2, hasher.root, kvblocks_framer)
    assert hasher.hash_tokens(range(8)) == tokens
