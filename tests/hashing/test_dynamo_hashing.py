"""Dynamo's block hashes: kvblocks' ``dynamo-xxh3-64`` scheme against vectors made by Dynamo's own function
(``tests/data/dynamo_hash_vectors.json``, from ``tools/vectors/make_dynamo_hash_vectors.py`` with
ai-dynamo-runtime 1.6.1), and the chain the scheme builds on those local hashes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks import BlockExtras, BlockHasher, HashedTokens, MultimodalItem
from kvblocks.errors import ConfigError
from kvblocks.events import BlockStored
from kvblocks.hashing import HASH_SCHEMES
from kvblocks.hashing.dynamo import dynamo_local_hashes, dynamo_seed, mm_hash
from kvblocks.routing import Router, RouterConfig

VECTORS = json.loads((Path(__file__).parents[1] / "data" / "dynamo_hash_vectors.json").read_text())
CASES = VECTORS["cases"]


def chain(local: list[int]) -> list[int]:
    """Dynamo's sequence hashes over its local hashes, written out here: seq_0 = local_0, then XXH3-64 (seed
    1337) of the parent and the local hash as two u64 LE."""
    out: list[int] = []
    for h in local:
        out.append(h if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], h), 1337))
    return out


def extras_of(case: dict) -> BlockExtras | None:
    """The case's inputs as kvblocks' extras: each multimodal hash an item inside its block whose identifier
    is a 64-digit hex digest starting with it (Dynamo takes the first 16 digits)."""
    size = case["block_size"]
    items = [
        MultimodalItem(f"{value:016x}" + "0" * 48, offset=i * size, length=1)
        for i, hashes in enumerate(case.get("block_mm_hashes") or ())
        for value in hashes or ()
    ]
    extras = BlockExtras(lora=case["lora_name"] or None, cache_salt=case["cache_namespace"] or None, mm_items=items)
    return None if extras.is_empty else extras


def test_the_vectors_cover_what_they_should() -> None:
    assert VECTORS["versions"]["ai-dynamo-runtime"] == "1.6.1"
    assert {c["block_size"] for c in CASES} >= {1, 4, 16, 64}
    assert any(c["lora_name"] and c["cache_namespace"] for c in CASES)
    assert any(c["lora_name"] == "" for c in CASES) and any(c["cache_namespace"] == "" for c in CASES)
    assert sum(1 for c in CASES if c.get("block_mm_hashes")) >= 20
    assert any(len(c["local_hashes"]) == 0 for c in CASES) and any(len(c["local_hashes"]) >= 8 for c in CASES)
    assert any(any(t >= 1 << 31 for t in c["tokens"]) for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_local_hashes_equal_dynamos(case: dict) -> None:
    seed = dynamo_seed(case["lora_name"], case["cache_namespace"])
    got = dynamo_local_hashes(
        case["tokens"],
        case["block_size"],
        seed=seed,
        block_mm_hashes=case.get("block_mm_hashes") or (),
        eagle=case.get("is_eagle", False),
    )
    assert got == case["local_hashes"]


def _scheme(case: dict) -> str:
    return "dynamo-xxh3-64-eagle" if case.get("is_eagle") else "dynamo-xxh3-64"


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_the_scheme_chains_dynamos_local_hashes(case: dict) -> None:
    hasher = BlockHasher(case["block_size"], scheme=_scheme(case))
    assert hasher.hash_tokens(case["tokens"], extras_of(case)) == chain(case["local_hashes"])
    hashed = HashedTokens(hasher, case["tokens"][:1], extras_of(case))  # a decode, token by token
    for token in case["tokens"][1:]:
        hashed.append_token(token)
    assert hashed.hashes == chain(case["local_hashes"])


def test_eagle_vectors_hash_the_next_blocks_first_token_and_wait_for_it() -> None:
    eagle = [c for c in CASES if c.get("is_eagle")]
    assert len(eagle) >= 20 and {c["block_size"] for c in eagle} >= {1, 4, 16}
    for case in eagle:
        n, size = len(case["tokens"]), case["block_size"]
        assert len(case["local_hashes"]) == max(0, n - 1) // size  # a block's hash needs the token after it
    assert any(len(c["tokens"]) % c["block_size"] == 0 and c["tokens"] for c in eagle)  # a last block waiting


def test_a_cache_manager_refuses_a_scheme_that_looks_past_its_blocks() -> None:
    from kvblocks import CacheConfig

    with pytest.raises(ConfigError, match="covers tokens past each block"):
        CacheConfig(num_blocks=8, block_size=4, hash_scheme="dynamo-xxh3-64-eagle")


def test_a_truncated_eagle_sequence_drops_the_hash_that_covered_the_removed_token() -> None:
    hasher = BlockHasher(4, scheme="dynamo-xxh3-64-eagle")
    hashed = HashedTokens(hasher, range(9))
    assert len(hashed.hashes) == 2
    hashed.truncate(8)
    assert hashed.hashes == hasher.hash_tokens(range(8)) and len(hashed.hashes) == 1


def test_without_extras_the_scheme_is_the_xxh3_64_standard() -> None:
    plain = [c for c in CASES if not c["lora_name"] and not c["cache_namespace"] and not c.get("block_mm_hashes")]
    assert plain
    for case in plain:
        standard = BlockHasher(case["block_size"], scheme="xxh3-64-1337").hash_tokens(case["tokens"])
        assert standard == BlockHasher(case["block_size"], scheme="dynamo-xxh3-64").hash_tokens(case["tokens"])


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, (1 << 32) - 1), max_size=40),
    cut=st.integers(0, 40),
    lora=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    salt=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    image=st.one_of(st.none(), st.tuples(st.integers(0, 39), st.integers(1, 12), st.binary(min_size=1, max_size=8))),
    scheme=st.sampled_from(["dynamo-xxh3-64", "dynamo-xxh3-64-eagle"]),
)
def test_hashing_piecewise_equals_hashing_at_once(tokens, cut, lora, salt, image, scheme) -> None:
    items = () if image is None else (MultimodalItem(image[2], offset=image[0], length=image[1]),)
    extras = BlockExtras(lora=lora, cache_salt=salt, mm_items=items)
    hasher = BlockHasher(4, scheme=scheme)
    whole = HashedTokens(hasher, tokens, extras)
    pieces = HashedTokens(hasher, tokens[:cut], extras)
    pieces.extend(tokens[cut:])
    assert pieces.hashes == whole.hashes == hasher.hash_tokens(tokens, extras)


def test_each_identity_separates_the_hashes_and_empty_names_do_not() -> None:
    tokens = list(range(16))
    hashes = {
        key: BlockHasher(4, scheme="dynamo-xxh3-64").hash_tokens(tokens, extras)
        for key, extras in {
            "plain": None,
            "lora": BlockExtras(lora="a"),
            "other lora": BlockExtras(lora="b"),
            "namespace": BlockExtras(cache_salt="a"),  # the same text as the adapter: a different hash
            "both": BlockExtras(lora="a", cache_salt="a"),
        }.items()
    }
    assert len({tuple(h) for h in hashes.values()}) == len(hashes)
    assert dynamo_seed("", "") == dynamo_seed(None, None) == 1337


def test_a_lora_path_has_no_place_in_dynamos_hash() -> None:
    with pytest.raises(ConfigError, match="lora_path"):
        BlockHasher(4, scheme="dynamo-xxh3-64").hash_tokens(range(8), BlockExtras(lora="a", lora_path="/adapters/a"))


def test_multimodal_identifiers_become_dynamos_hashes() -> None:
    digest = "0123456789abcdef" + "f" * 48  # vLLM's 64-digit hex digest: its first 16 digits
    assert mm_hash(digest) == 0x0123456789ABCDEF
    assert mm_hash("image-7") == xxhash.xxh3_64_intdigest(b"image-7")
    assert mm_hash("g" * 64) == xxhash.xxh3_64_intdigest(b"g" * 64)  # 64 characters, not hex: hashed
    assert mm_hash(b"\x01\x02") == xxhash.xxh3_64_intdigest(b"\x01\x02")
    assert "dynamo-xxh3-64" in HASH_SCHEMES


def test_a_router_on_dynamos_hashes_keeps_adapters_apart() -> None:
    """Two workers hold the same prompt's blocks, one under adapter ``a``: each request goes to the worker
    holding its own adapter's blocks (the hashes its events carry are Dynamo's for that adapter)."""
    prompt = list(range(100, 133))
    router = Router(["base", "lora-a"], RouterConfig(block_size=4, hash_scheme="dynamo-xxh3-64"))
    for worker, extras in (("base", None), ("lora-a", BlockExtras(lora="a"))):
        hashes = BlockHasher(4, scheme="dynamo-xxh3-64").hash_tokens(prompt, extras)
        router.apply_events(worker, [BlockStored(tuple(hashes), None, "device")])
    with router.route(prompt, extras=BlockExtras(lora="a")) as lease:
        assert lease.worker == "lora-a" and lease.overlap_blocks == 8
    with router.route(prompt) as lease:
        assert lease.worker == "base" and lease.overlap_blocks == 8


def test_a_router_on_dynamos_eagle_hashes_routes_to_the_worker_that_holds_them() -> None:
    """Workers of an EAGLE fleet publish Dynamo's ``is_eagle`` hashes (vectors above); a router on the eagle
    scheme matches them, and a router on the plain scheme matches nothing of them."""
    prompt = list(range(200, 233))  # 33 tokens: 8 eagle blocks (the 8th covers token 32)
    eagle = BlockHasher(4, scheme="dynamo-xxh3-64-eagle").hash_tokens(prompt[:21])  # a worker that saw 21 tokens
    assert len(eagle) == 5
    for scheme, expected in (("dynamo-xxh3-64-eagle", 5), ("dynamo-xxh3-64", 0)):
        router = Router(["w0", "w1"], RouterConfig(block_size=4, hash_scheme=scheme))
        router.apply_events("w1", [BlockStored(tuple(eagle), None, "device")])
        with router.route(prompt) as lease:
            assert lease.overlap_blocks == expected and (expected == 0 or lease.worker == "w1")
