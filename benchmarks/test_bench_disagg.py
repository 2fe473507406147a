"""Disaggregation's hot calls: a handoff crossing the wire and being accepted, against a plain admission.

A decode node accepting a handoff hashes the prompt (to check it is the handoff's), maps blocks
and reserves; a mixed node admitting the same prompt hashes it and allocates. The ratio bounds
what the handoff path adds on top of an admission.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.paired import paired_ratio
from kvblocks import DecodeManager, KVCacheManager, PrefillHandoff, PrefillManager, TieredDecodeManager
from kvblocks.tiers import TierConfig

BLOCK = 16
PROMPT = [random.Random(11).randrange(50_000) for _ in range(2048)]  # 128 blocks


def _handoff() -> bytes:
    p = PrefillManager(256, BLOCK)
    p.add_sequence("r", PROMPT)
    p.allocate("r", len(PROMPT))
    p.commit("r", len(PROMPT))
    return p.finish_prefill("r").to_bytes()


WIRE = _handoff()


def accept_one(*, tiered: bool = False) -> None:
    d = TieredDecodeManager(256, BLOCK, tiers=TierConfig(num_host_blocks=256)) if tiered else DecodeManager(256, BLOCK)
    admission = d.accept_handoff(PrefillHandoff.from_bytes(WIRE), PROMPT)
    assert admission is not None and len(admission.transfers) == 128
    d.receive_done("r")


def admit_one() -> None:
    m = KVCacheManager(256, BLOCK)
    m.add_sequence("r", PROMPT)
    assert m.allocate("r", len(PROMPT)) is not None
    m.commit("r", len(PROMPT))


@pytest.mark.parametrize("subject", ["accept handoff", "accept handoff, tiered decode node", "mixed admission"])
def test_handoff_accept_2k(benchmark, subject: str) -> None:
    benchmark.group = "handoff-2k"
    benchmark.extra_info["subject"] = subject
    if subject == "mixed admission":
        benchmark(admit_one)
    else:
        benchmark(accept_one, tiered=subject.endswith("tiered decode node"))


def test_handoff_accept_2k_paired(benchmark) -> None:
    """The same ratio, paired: a mixed admission, then an accepted handoff, in each round."""
    paired_ratio(
        benchmark,
        "handoff-2k-paired",
        "accept handoff",
        admit_one,
        accept_one,
        baseline_name="mixed admission",
        target=0.5,
        repeat=10,
    )
