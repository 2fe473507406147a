"""Block hash test vectors for kvblocks' vLLM schemes, computed by vLLM's own code (vLLM 0.33.0).

For each case (token ids, block size, LoRA, multimodal items, cache salt) and each hash function with and
without ``PYTHONHASHSEED``, this runs vLLM's ``init_none_hash``, ``get_request_block_hasher`` (one shot, and
piecewise as tokens arrive), ``hash_block_tokens`` with ``generate_block_hash_extra_keys`` (asserted equal),
and ``maybe_convert_block_hash``, and writes inputs, extra keys, hex hashes and int forms as JSON. The tests
(``tests/hashing/test_vllm_hashing.py``) read the file; they never need vLLM.

``tests/data/vllm_hash_vectors.json`` was produced with (Python 3.11, x86_64)::

    python3.11 -m venv /tmp/vllmvenv
    /tmp/vllmvenv/bin/pip install torch==2.13.0
    /tmp/vllmvenv/bin/pip install vllm==0.33.0 --no-deps   # the wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64
    /tmp/vllmvenv/bin/pip install numpy==2.4.6 packaging==26.3 cbor2==6.3.0 xxhash==4.1.0 msgspec==0.22.0 \\
        pydantic==2.14.3 regex==2026.11.15 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0 transformers==5.23.0 \\
        aiohttp==3.14.5 requests==2.34.2 openai-harmony==0.0.8 openai==3.54.0 pillow==13.0.0 pybase64==1.5.1 \\
        cachetools==8.0.1 cloudpickle==3.1.2 uvloop==0.23.0 py-cpuinfo==9.0.0 prometheus_client==0.26.0 \\
        xgrammar==0.2.8 fastapi==0.165.0 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1
    /tmp/vllmvenv/bin/python tools/vectors/make_vllm_hash_vectors.py tests/data/vllm_hash_vectors.json

(The third line is what ``import vllm.v1.core.kv_cache_utils`` needs, found by importing until it worked.)
With ``--bench`` it also times vLLM's own request hasher on an 8k-token prompt (no file written).

Strings reach vLLM's objects as an engine core receives them: decoded (JSON here, msgpack for the LoRA
request), never as shared literals -- pickle writes a repeated *object* as a back-reference, so this matters.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import msgspec
import vllm
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils import hashing as vllm_hashing
from vllm.v1.core import kv_cache_utils as kcu

U32_MAX = 2**32 - 1
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, U32_MAX]

# (hash function, PYTHONHASHSEED or None). xxhash without a seed is random per process: not reproducible.
CONFIGS = [
    ("sha256", None),
    ("sha256", "0"),
    ("sha256_cbor", None),
    ("sha256_cbor", "4242"),
    ("xxhash", "4242"),
    ("xxhash_cbor", "4242"),
]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(EDGES) if rng.random() < 0.3 else rng.randrange(2**32) for _ in range(n)]


def _cases() -> list[dict[str, Any]]:
    rng = random.Random(20260316)
    cases: list[dict[str, Any]] = []

    def add(name: str, block_size: int, tokens: Any, lora: Any = None, mm: Any = (), salt: Any = None) -> None:
        cases.append(
            {"name": name, "block_size": block_size, "tokens": tokens, "lora": lora, "mm": list(mm), "cache_salt": salt}
        )

    add("edges-block-1", 1, EDGES)
    for size in (2, 3, 4, 5):
        add(f"random-block-{size}", size, _tokens(rng, 4 * size + 1))
    add("random-block-16", 16, _tokens(rng, 16 * 6 + 7))
    add("small-ids-block-16", 16, [rng.randrange(256) for _ in range(48)])
    add("partial-only", 16, _tokens(rng, 15))
    for size in (23, 24, 255, 256, 300):  # CBOR array heads change at 24 and 256
        add(f"random-block-{size}", size, _tokens(rng, 2 * size + 3))
    add("lora", 16, _tokens(rng, 40), lora=["sql-adapter", "/adapters/sql"])
    add("lora-one-char", 4, _tokens(rng, 12), lora=["a", "a"])
    add("cache-salt", 16, _tokens(rng, 40), salt="tenant-a")
    add("cache-salt-unicode", 4, _tokens(rng, 9), salt="t\u00e9nant-\u20ac-\U0001f600")
    add(
        "mm-spanning",
        4,
        _tokens(rng, 19),
        mm=[["img-a", 2, 5], ["img-a", 8, 4], ["img-b", 13, 2], ["img-c", 16, 9]],
    )
    add("mm-several-in-a-block", 16, _tokens(rng, 40), mm=[["x", 1, 2], ["x", 4, 3], ["y" * 40, 9, 2], ["z", 11, 30]])
    add("mm-one-image-twice-in-a-block", 16, _tokens(rng, 33), mm=[["img-a", 2, 3], ["img-a", 6, 3], ["img-a", 20, 2]])
    add("lora-name-is-path", 8, _tokens(rng, 17), lora=["adapter", "adapter"], salt="adapter")
    add("mm-at-zero", 8, _tokens(rng, 24), mm=[["image:0f3a", 0, 8], ["image:0f3a", 8, 1]])
    add("mm-long-identifier", 4, _tokens(rng, 12), mm=[["h" * 300, 3, 2]])
    add(
        "everything",
        4,
        _tokens(rng, 30),
        lora=["l\u00f6ra", "/p/l\u00f6ra"],
        mm=[["img-a", 0, 3], ["img-b", 5, 6], ["img-b", 12, 4]],
        salt="s",
    )
    add("everything-block-1", 1, _tokens(rng, 6), lora=["n", "/p"], mm=[["m", 2, 2]], salt="salt")
    # 7-byte pickled ints: one block's pickle is over 64 KiB, which pickle splits into frames.
    add("big-block-frames", 10_000, {"affine": [20_003, 2_654_435_761, 2**31]})
    add("big-block-frames-lora", 9_500, {"affine": [19_000, 2_246_822_519, 2**31 + 7]}, lora=["big", "/big"])
    return cases


def expand_tokens(spec: Any) -> list[int]:
    """Explicit token ids, or ``{"affine": [n, mul, add]}``: token i is (mul * i + add) mod 2**32."""
    if isinstance(spec, dict):
        n, mul, add = spec["affine"]
        return [(mul * i + add) % 2**32 for i in range(n)]
    return list(spec)


class StandInRequest:
    """What ``get_request_block_hasher`` reads from a ``vllm.v1.request.Request``."""

    def __init__(self, case: dict[str, Any], tokens: list[int]) -> None:
        self.all_token_ids = tokens
        self.block_hashes: list[bytes] = []
        self.mm_features = [
            MultiModalFeatureSpec(
                data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset=off, length=n)
            )
            for ident, off, n in case["mm"]
        ]
        self.lora_request = None
        if case["lora"] is not None:
            name, path = case["lora"]
            wire = msgspec.msgpack.encode(LoRARequest(lora_name=name, lora_int_id=1, lora_path=path))
            self.lora_request = msgspec.msgpack.decode(wire, type=LoRARequest)  # as the engine core gets it
        self.cache_salt = case["cache_salt"]
        self.prompt_embeds = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def _init(hash_name: str, seed: str | None) -> Any:
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    fn = vllm_hashing.get_hash_fn_by_name(hash_name)
    kcu.init_none_hash(fn)
    return fn


def _to_json(value: Any) -> Any:
    return [_to_json(v) for v in value] if isinstance(value, tuple) else value


def _run_case(case: dict[str, Any], fn: Any, rng: random.Random) -> list[bytes]:
    tokens = expand_tokens(case["tokens"])
    block_size = case["block_size"]
    hasher = kcu.get_request_block_hasher(block_size, fn)
    whole = StandInRequest(case, tokens)
    hashes = hasher(whole)
    # Piecewise, as decode appends tokens: vLLM's own incremental path must agree with one shot.
    piece = StandInRequest(case, [])
    while piece.num_tokens < len(tokens):
        piece.all_token_ids.extend(tokens[piece.num_tokens : piece.num_tokens + rng.randrange(1, 2 * block_size + 2)])
        piece.block_hashes.extend(hasher(piece))
    if piece.block_hashes != hashes:
        raise SystemExit(f"{case['name']}: vLLM's piecewise hashes differ from its one-shot ones")
    # hash_block_tokens block by block with the extra keys vLLM generates.
    parent = None
    for index, expected in enumerate(hashes):
        start = index * block_size
        keys, _ = kcu.generate_block_hash_extra_keys(whole, start, start + block_size, 0)
        parent = kcu.hash_block_tokens(fn, parent, tokens[start : start + block_size], keys)
        if parent != expected:
            raise SystemExit(f"{case['name']}: hash_block_tokens disagrees at block {index}")
    return hashes


def make() -> dict[str, Any]:
    import cbor2
    import xxhash

    # JSON round trip: every string an engine would hold as a decoded, distinct object
    cases = json.loads(json.dumps(_cases()))
    rng = random.Random(7)
    configs = []
    for hash_name, seed in CONFIGS:
        _init(hash_name, seed)
        configs.append(
            {
                "id": f"{hash_name}/{seed or '-'}",
                "hash_fn": hash_name,
                "PYTHONHASHSEED": seed,
                "seed": kcu.get_none_hash_seed(),
                "none_hash": kcu.NONE_HASH.hex(),
            }
        )
    for case in cases:
        tokens = expand_tokens(case["tokens"])
        block_size = case["block_size"]
        whole = StandInRequest(case, tokens)
        case["extra_keys"] = [
            _to_json(kcu.generate_block_hash_extra_keys(whole, i * block_size, (i + 1) * block_size, 0)[0])
            for i in range(len(tokens) // block_size)
        ]
        case["results"] = {}
        for config in configs:
            fn = _init(config["hash_fn"], config["PYTHONHASHSEED"])
            hashes = _run_case(case, fn, rng)
            case["results"][config["id"]] = {
                "hashes": [h.hex() for h in hashes],
                "ints": [kcu.maybe_convert_block_hash(h) for h in hashes],
            }
    return {
        "about": "vLLM block hashes made by vLLM's own code; see tools/vectors/make_vllm_hash_vectors.py",
        "versions": {
            "vllm": vllm.__version__,
            "python": sys.version.split()[0],
            "cbor2": _version("cbor2", cbor2),
            "xxhash": xxhash.VERSION,
            "msgspec": msgspec.__version__,
        },
        "int_hashes": "maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1",
        "configs": configs,
        "cases": cases,
    }


def _version(name: str, module: Any) -> str:
    from importlib.metadata import version

    return getattr(module, "__version__", None) or version(name)


def bench() -> None:
    """vLLM's request hasher over an 8k-token prompt, block 16 (median of 25 runs, microseconds)."""
    rng = random.Random(1234)
    tokens = [rng.randrange(128_000) for _ in range(8192)]
    case = {"mm": [], "lora": None, "cache_salt": None}
    for hash_name in ("sha256", "xxhash"):
        fn = _init(hash_name, "0")
        hasher = kcu.get_request_block_hasher(16, fn)
        times = []
        for _ in range(25):
            request = StandInRequest(case, tokens)
            start = time.perf_counter()
            hasher(request)
            times.append(time.perf_counter() - start)
        print(f"vLLM get_request_block_hasher {hash_name:<8} 8k tokens: {sorted(times)[12] * 1e6:8.0f} us")


def main(argv: list[str]) -> None:
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    if argv[1:] == ["--bench"]:
        bench()
        return
    if len(argv) != 2:
        raise SystemExit(f"usage: {argv[0]} OUT.json | --bench")
    data = make()
    with open(argv[1], "w") as fh:
        json.dump(data, fh, separators=(",", ":"))
        fh.write("\n")
    print(f"wrote {argv[1]}: {len(data['cases'])} cases x {len(data['configs'])} hash configurations")


if __name__ == "__main__":
    main(sys.argv)
