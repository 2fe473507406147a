"""Block hash test vectors for kvblocks' ``dynamo-xxh3-64`` scheme, computed by Dynamo's own function.

For each case (token ids, block size, LoRA adapter name, cache namespace, multimodal hashes per block, and for
the last cases ``is_eagle``) this
calls ``dynamo._core.compute_block_hash_for_seq`` of ``ai-dynamo-runtime`` 1.6.1 and writes the inputs and the
local block hashes it returns as JSON. The tests (``tests/hashing/test_dynamo_hashing.py``) read the file; they
never need Dynamo.

``tests/data/dynamo_hash_vectors.json`` was produced with (Python 3.11, x86_64)::

    python3.11 -m venv /tmp/dynenv
    /tmp/dynenv/bin/pip install ai-dynamo-runtime==1.6.1   # the wheel ai_dynamo_runtime-1.6.1-cp310-abi3-...
    /tmp/dynenv/bin/python tools/vectors/make_dynamo_hash_vectors.py tests/data/dynamo_hash_vectors.json

Multimodal objects reach Dynamo as its Python binding takes them: per block, None or
``{"mm_objects": [{"mm_hash": int, "offsets": [[start, end], ...]}]}`` (the offsets do not enter the hash).
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import sys
from typing import Any

from dynamo._core import compute_block_hash_for_seq


def cases() -> list[dict[str, Any]]:
    rng = random.Random(2026)
    out: list[dict[str, Any]] = []
    names = [None, "", "adapter-a", "adapter-b", "ÄdäpterΩ-ünïcode", "x" * 300]
    namespaces = [None, "", "tenant-1", "tenant-2", "名前空間"]
    for block_size in (1, 4, 16, 64):
        for lora in names:
            for namespace in namespaces:
                length = rng.choice([0, block_size - 1, block_size, 3 * block_size + 1, 8 * block_size])
                tokens = [
                    rng.randrange(1 << 32) if rng.random() < 0.1 else rng.randrange(200_000) for _ in range(length)
                ]
                out.append(
                    {"tokens": tokens, "block_size": block_size, "lora_name": lora, "cache_namespace": namespace}
                )
    edges = [0, 1, (1 << 64) - 1, 1 << 63, 0x0123456789ABCDEF]
    for block_size in (2, 16):
        for _ in range(12):
            blocks = rng.randint(1, 6)
            tokens = [rng.randrange(50_000) for _ in range(blocks * block_size + rng.randrange(block_size))]
            mm: list[list[int] | None] = []
            for _ in range(blocks):
                if rng.random() < 0.4:
                    mm.append(None)
                else:
                    mm.append(
                        [
                            rng.choice(edges) if rng.random() < 0.3 else rng.getrandbits(64)
                            for _ in range(rng.randint(1, 4))
                        ]
                    )
            out.append(
                {
                    "tokens": tokens,
                    "block_size": block_size,
                    "lora_name": rng.choice([None, "adapter-a"]),
                    "cache_namespace": rng.choice([None, "tenant-1"]),
                    "block_mm_hashes": mm,
                }
            )
    # EAGLE fleets (``is_eagle``): each block's hash also covers the next block's first token
    for block_size in (1, 4, 16):
        for _ in range(8):
            length = rng.choice(
                [0, 1, block_size, block_size + 1, 3 * block_size, 3 * block_size + 1, 5 * block_size + 2]
            )
            tokens = [rng.randrange(1 << 32) if rng.random() < 0.1 else rng.randrange(200_000) for _ in range(length)]
            blocks = max(0, length - 1) // block_size
            mm = [None if rng.random() < 0.5 else [rng.getrandbits(64)] for _ in range(blocks)] if blocks else None
            out.append(
                {
                    "tokens": tokens,
                    "block_size": block_size,
                    "lora_name": rng.choice([None, "adapter-a"]),
                    "cache_namespace": rng.choice([None, "tenant-1"]),
                    "block_mm_hashes": mm if rng.random() < 0.5 else None,
                    "is_eagle": True,
                }
            )
    return out


def main(path: str) -> None:
    vectors = []
    for case in cases():
        mm = case.get("block_mm_hashes")
        infos = None
        if mm is not None:
            infos = [None if h is None else {"mm_objects": [{"mm_hash": v, "offsets": []} for v in h]} for h in mm]
        case["local_hashes"] = compute_block_hash_for_seq(
            case["tokens"],
            case["block_size"],
            block_mm_infos=infos,
            lora_name=case["lora_name"],
            cache_namespace=case["cache_namespace"],
            is_eagle=case.get("is_eagle", False),
        )
        vectors.append(case)
    document = {
        "about": "Dynamo's compute_block_hash_for_seq on each case; made by tools/vectors/make_dynamo_hash_vectors.py",
        "versions": {
            "ai-dynamo-runtime": importlib.metadata.version("ai-dynamo-runtime"),
            "python": sys.version.split()[0],
        },
        "cases": vectors,
    }
    with open(path, "w") as f:
        json.dump(document, f, separators=(",", ":"))
        f.write("\n")
    print(f"{len(vectors)} cases -> {path}")


if __name__ == "__main__":
    main(sys.argv[1])
