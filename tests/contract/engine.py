"""Shadow-KV engine for the manager contract suite: one node's memories per group, run as an engine runs them.

The "KV" of block position ``p`` of group ``g`` is ``kv(g, block_hashes(seq)[p])``: a function of the group and the
token prefix up to the end of that block only, so any block that reaches a sequence with another prefix's (or another
group's) KV is caught by :meth:`Node.check_sequence`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import xxhash

from kvblocks import CacheConfig, DisaggConfig, manager_for_role
from kvblocks.hybrid import PLACEHOLDER, LocalGroup
from kvblocks.tiers import EntryFormat, MemoryStorage, TierConfig
from kvblocks.tiers.kinds import TierPlace, register_tier_kind, unregister_tier_kind
from tests.support.peer_tier import PeerTier

B = 4  # tokens per block, every group
PAYLOAD = 16
FORMAT = EntryFormat("xxh3-128", "uint8", (PAYLOAD,), 1, PAYLOAD)
GARBAGE = b"\xee" * PAYLOAD  # a block nothing wrote (or a copy that failed)
PARTIAL = b"\xdd" * PAYLOAD  # a block whose tokens are only partly computed

HYBRIDS = (False, True)
TIERS = ("none", "host", "storage")
PEER = "peer"  # a host tier above a keyed tier registered from test code (tests/support/peer_tier.py)
ROLES = ("mixed", "prefill", "decode")
COMBINATIONS = list(itertools.product(HYBRIDS, TIERS, ROLES))

NUM_BLOCKS = 9  # device blocks of group 0
LOCAL_BLOCKS = 7  # device blocks of each local group
HOST_BLOCKS = (6, 4, 4)  # host blocks per group


def kv(group: int, block_hash: object) -> bytes:
    """The KV of a full block of ``group`` whose prefix ends at ``block_hash``."""
    raw = block_hash if isinstance(block_hash, bytes) else str(block_hash).encode()
    return xxhash.xxh3_128_digest(bytes([group]) + raw)[:PAYLOAD]


def groups_for(hybrid: bool, local_blocks: int = LOCAL_BLOCKS) -> tuple[LocalGroup, ...]:
    if not hybrid:
        return ()
    return (LocalGroup("sliding_window", 6, local_blocks), LocalGroup("chunked_local", 8, local_blocks))


def tiers_for(kind: str, hybrid: bool) -> TierConfig | None:
    per_group = HOST_BLOCKS[1:] if hybrid else ()
    if kind == "none":
        return None
    if kind == "host":
        return TierConfig(num_host_blocks=HOST_BLOCKS[0], group_host_blocks=per_group)
    if kind == PEER:  # the kind must be registered (peer_kind)
        return TierConfig(num_host_blocks=HOST_BLOCKS[0], group_host_blocks=per_group, kinds=("host", PEER))
    return TierConfig(
        num_host_blocks=HOST_BLOCKS[0],
        group_host_blocks=per_group,
        storage=MemoryStorage(),
        entry_format=FORMAT,
        group_entry_formats=(FORMAT, FORMAT) if hybrid else (),
    )


@contextmanager
def peer_kind() -> Iterator[None]:
    """The "peer" tier kind while the block runs: every attention group gets a peer tier of its own memory."""

    def build(place: TierPlace) -> PeerTier:
        return PeerTier({}, payload=PAYLOAD)

    register_tier_kind(PEER, build)
    try:
        yield
    finally:
        unregister_tier_kind(PEER)


def build(hybrid: bool, tier: str, role: str, num_blocks: int = NUM_BLOCKS) -> object:
    """Every combination comes from the one factory."""
    return manager_for_role(
        CacheConfig(num_blocks, B), DisaggConfig(role=role), tiers=tiers_for(tier, hybrid), groups=groups_for(hybrid)
    )


def build_peer(hybrid: bool) -> object:
    """The plain prefill node a decode node's sequences come from (same layout, more room, no tiers)."""
    return manager_for_role(
        CacheConfig(3 * NUM_BLOCKS, B), DisaggConfig(role="prefill"), groups=groups_for(hybrid, 3 * LOCAL_BLOCKS)
    )


Failing = Callable[[int, str, tuple[int, ...]], set[int]]  # (group, "in" / "out", targets) -> the ones that fail


class Node:
    """One manager and its shadow memories: ``device[g][block]`` / ``host[g][block]`` hold bytes of KV."""

    def __init__(self, m: object) -> None:
        self.m = m
        self.groups = m.num_groups  # type: ignore[attr-defined]
        self.tiered = hasattr(m, "take_transfers")
        self.device: list[dict[int, bytes]] = [{} for _ in range(self.groups)]
        self.host: list[dict[int, bytes]] = [{} for _ in range(self.groups)]

    def read(self, g: int, block: int) -> bytes:
        return self.device[g].get(block, GARBAGE)

    def ready(self, seq: Hashable) -> bool:
        return not self.tiered or self.m.is_ready(seq)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- the tier step protocol

    def run_plan(self, plan: object, failing: Failing | None = None) -> None:
        """Run ``plan`` per group (saves, swap-outs, swap-ins, on that group's memories), then complete it."""
        saved: dict[int, list[bytes]] = {}
        failed_in: dict[int, set[int]] = {}
        failed_out: dict[int, set[int]] = {}
        for t in plan.group_transfers:  # type: ignore[attr-defined]
            g = t.group
            saved[g] = [self.read(g, s.block) if s.tier == "device" else self.host[g][s.block] for s in t.saves]
            failed_out[g] = failing(g, "out", tuple(h for _, h in t.swap_outs)) if failing else set()
            failed_in[g] = failing(g, "in", tuple(d for _, d in t.swap_ins)) if failing else set()
            for d, h in t.swap_outs:
                self.host[g][h] = GARBAGE if h in failed_out[g] else self.read(g, d)
            for h, d in t.swap_ins:
                self.device[g][d] = GARBAGE if d in failed_in[g] else self.host[g].get(h, GARBAGE)
        self.m.complete_transfers(  # type: ignore[attr-defined]
            plan, saved=saved, failed_swap_ins=failed_in, failed_swap_outs=failed_out
        )

    def quiesce(self) -> None:
        """Wait for queued storage writes and reads (probes, loads), so that what the manager reports next does
        not depend on thread timing (hypothesis needs the same draws for the same choices)."""
        storage = getattr(self.m, "storage", None)
        if storage is not None:
            self.m.flush(2)  # type: ignore[attr-defined]
            storage.wait_idle(2)

    def poll(self) -> int:
        self.quiesce()
        results = self.m.poll_loads()  # type: ignore[attr-defined]
        for r in results:
            for block, parts in zip(r.blocks, r.payloads, strict=True):
                self.device[r.group][block] = bytes(parts[0])
        return len(results)

    # ---------------------------------------------------------------- the forward pass

    def compute(self, seq: Hashable, upto: int) -> None:
        """Write every group's KV of tokens [num_computed_tokens, upto) into the sequence's blocks, then commit."""
        m = self.m
        hashes = m.block_hashes(seq)  # type: ignore[attr-defined]
        done = m.num_computed_tokens(seq)  # type: ignore[attr-defined]
        for g, table in enumerate(m.block_tables(seq)):  # type: ignore[attr-defined]
            for p in range(done // B, -(-upto // B)):
                assert table[p] != PLACEHOLDER, (seq, g, p, "a block being computed is not held")
                self.device[g][table[p]] = kv(g, hashes[p]) if (p + 1) * B <= upto else PARTIAL
        m.commit(seq, upto)  # type: ignore[attr-defined]

    def check_sequence(self, seq: Hashable) -> None:
        """Every held block below the computed line holds its own group's KV of its own prefix."""
        m = self.m
        hashes = m.block_hashes(seq)  # type: ignore[attr-defined]
        full = m.num_computed_tokens(seq) // B  # type: ignore[attr-defined]
        for g, table in enumerate(m.block_tables(seq)):  # type: ignore[attr-defined]
            for p, b in enumerate(table[:full]):
                if b != PLACEHOLDER:
                    assert self.read(g, b) == kv(g, hashes[p]), (seq, "group", g, "position", p, "block", b)

    def check_blocks(self, group_blocks: object, hashes: object, label: object) -> None:
        """Blocks named per group (a handoff's) still hold their positions' KV."""
        for g, blocks in enumerate(group_blocks):  # type: ignore[arg-type]
            for p, b in enumerate(blocks[: len(hashes)]):  # type: ignore[arg-type]  # full blocks only
                if b != PLACEHOLDER:
                    assert self.read(g, b) == kv(g, hashes[p]), (label, "group", g, "position", p, "block", b)

    def snapshot(self, seqs: object) -> object:
        """What a refused call must leave as it was."""
        m = self.m
        per_seq = {
            s: (m.block_tables(s), m.num_computed_tokens(s), m.is_admitted(s), self.ready(s))  # type: ignore[attr-defined]
            for s in seqs  # type: ignore[attr-defined]
        }
        return (repr(m.stats), m.num_free_blocks, per_seq)  # type: ignore[attr-defined]

    def close(self) -> None:
        close = getattr(self.m, "close", None)
        if close is not None:
            close(timeout=2)
