"""What a route by block hashes costs: its matched prefix, not the prompt's length.

512 workers hold 2,000 unrelated 64-bit blocks each (about 1M index entries); one of them also holds the first
127 blocks of a 2,048-block prompt. Three routes by ``block_hashes``: a miss (nobody holds the first block), the
127-block hit, and a prompt every block of which one worker holds. The baseline is one check of the whole
prompt (``validate_block_hashes``, C passes over 2,048 hashes): what every route paid before it walked, until
routes read only the hashes their walk needs. Ratio = baseline time / route time.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.paired import paired_ratio
from kvblocks.events import BlockStored
from kvblocks.hashing import validate_block_hashes
from kvblocks.routing import Router, RouterConfig

BLOCK = 16
BLOCKS = 2048
WORKERS = 512


def make_fleet() -> tuple[Router, dict[str, list[int]]]:
    rng = random.Random(7)
    r = Router(range(WORKERS), RouterConfig(block_size=BLOCK))
    for w in range(WORKERS):
        r.apply_events(w, [BlockStored(tuple(rng.getrandbits(63) for _ in range(2000)), None, "device")])
    hit = [rng.getrandbits(63) for _ in range(BLOCKS)]
    whole = [rng.getrandbits(63) for _ in range(BLOCKS)]
    r.apply_events(7, [BlockStored(tuple(hit[:127]), None, "device")])
    r.apply_events(9, [BlockStored(tuple(whole), None, "device")])
    prompts = {"miss": [rng.getrandbits(63) for _ in range(BLOCKS)], "hit-127": hit, "all-cached": whole}
    return r, prompts


ROUTER, PROMPTS = make_fleet()
TARGETS = {"miss": 4.0, "hit-127": 1.5, "all-cached": 0.5}


@pytest.mark.parametrize("case", list(PROMPTS))
def test_route_cost_against_checking_the_prompt(benchmark, case: str) -> None:
    prompt = PROMPTS[case]
    num_tokens = BLOCKS * BLOCK + 1

    def route() -> None:
        ROUTER.route(block_hashes=prompt, num_tokens=num_tokens).release()

    ratio = paired_ratio(
        benchmark,
        f"route-2k-blocks-{case}",
        "route by block hashes",
        lambda: validate_block_hashes(prompt, distinct=False),
        route,
        baseline_name="checking the prompt's 2,048 hashes",
        target=TARGETS[case],
        repeat=200,
    )
    assert ratio > 0


def test_the_routes_find_what_the_fleet_holds() -> None:
    """The miss goes to the least loaded worker with no overlap; the hits go to their holders."""
    for case, holder in (("hit-127", 7), ("all-cached", 9)):
        with ROUTER.route(block_hashes=PROMPTS[case], num_tokens=BLOCKS * BLOCK + 1) as lease:
            assert lease.worker == holder
            assert lease.overlap_blocks == (127 if case == "hit-127" else BLOCKS)
    with ROUTER.route(block_hashes=PROMPTS["miss"], num_tokens=BLOCKS * BLOCK + 1) as lease:
        assert lease.overlap_blocks == 0
