"""The head of Mooncake's conversation trace (tests/data): request block hashes, as the manager takes them."""

from __future__ import annotations

import json
from pathlib import Path

TRACE = Path(__file__).parents[1] / "data" / "mooncake_conversation_head1000.jsonl"
BLOCK = 512  # the trace's block size


def load() -> list[tuple[list[int], int]]:
    """(hashes of the full blocks, prompt length) per request; the trailing partial block has no hash."""
    requests = []
    for line in TRACE.read_text().splitlines():
        record = json.loads(line)
        length = record["input_length"]
        requests.append((record["hash_ids"][: length // BLOCK], length))
    return requests
