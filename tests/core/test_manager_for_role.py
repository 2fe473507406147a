"""manager_for_role builds every combination of {one group, hybrid} x {no tiers, host, host + storage} x role."""

from __future__ import annotations

import itertools

import pytest

from kvblocks import CacheConfig, DisaggConfig, manager_for_role
from kvblocks.errors import ConfigError
from kvblocks.hybrid import CrossAttentionGroup, LocalGroup, RecurrentGroup
from kvblocks.tiers import EntryFormat, MemoryStorage, TierConfig

FORMAT = EntryFormat("xxh3-128", "uint8", (16,), 1, 16)
ROLES = ["mixed", "prefill", "decode"]
HYBRID = (LocalGroup("sliding_window", 6, 16), LocalGroup("chunked_local", 8, 16))


def tiers_for(kind: str, hybrid: bool) -> TierConfig | None:
    per_group = (8, 8) if hybrid else ()
    if kind == "none":
        return None
    if kind == "host":
        return TierConfig(num_host_blocks=8, group_host_blocks=per_group)
    formats = (FORMAT, FORMAT) if hybrid else ()
    return TierConfig(
        num_host_blocks=8,
        group_host_blocks=per_group,
        storage=MemoryStorage(),
        entry_format=FORMAT,
        group_entry_formats=formats,
    )


@pytest.mark.parametrize(
    ("hybrid", "tier", "role"),
    list(itertools.product([False, True], ["none", "host", "storage"], ROLES)),
)
def test_every_combination_is_built_from_one_configuration(hybrid: bool, tier: str, role: str) -> None:
    tiers = tiers_for(tier, hybrid)
    m = manager_for_role(CacheConfig(16, 4), DisaggConfig(role=role), tiers=tiers, groups=HYBRID if hybrid else ())
    try:
        assert m.num_groups == (3 if hybrid else 1)
        assert m.group_kinds == (("full", "sliding_window", "chunked_local") if hybrid else ("full",))
        assert m.role == role
        assert (m.tiers is not None) == (tiers is not None) and (m.host is not None) == (tiers is not None)
        if tiers is not None:
            assert (m.host is not None, m.storage is not None) == (True, tier == "storage")  # type: ignore[attr-defined]
            if hybrid:
                assert all(m.group_host(g) is not None for g in (1, 2))  # type: ignore[attr-defined]
                assert all((m.group_storage(g) is not None) == (tier == "storage") for g in (1, 2))  # type: ignore[attr-defined]
        assert hasattr(m, "finish_prefill") == (role == "prefill")
        assert hasattr(m, "accept_handoff") == (role == "decode")
        # the same prompt, admitted and committed, caches in every group
        m.add_sequence("a", list(range(17)))
        if role != "decode":
            assert m.allocate("a", 17) is not None
            if tiers is not None:
                m.complete_transfers(m.take_transfers())  # type: ignore[attr-defined]
            m.commit("a", 17)
            m.check_integrity()
    finally:
        close = getattr(m, "close", None)
        if close is not None:
            close()


def test_groups_come_in_group_order_and_are_layer_groups() -> None:
    config = CacheConfig(16, 4)
    recurrent = RecurrentGroup(num_slots=2, num_checkpoints=2, checkpoint_every=2)
    with pytest.raises(ConfigError, match="local groups, then recurrent groups"):
        manager_for_role(config, groups=[recurrent, HYBRID[0]])
    with pytest.raises(ConfigError, match="a layer group is a LocalGroup"):
        manager_for_role(config, groups=["sliding_window"])
    with pytest.raises(ConfigError, match="groups must be a sequence"):
        manager_for_role(config, groups="sliding_window")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="does not carry cross-attention"):
        manager_for_role(config, DisaggConfig(role="prefill"), groups=[CrossAttentionGroup(8)])
    m = manager_for_role(config, groups=[HYBRID[0], recurrent, CrossAttentionGroup(8)])
    assert m.group_kinds == ("full", "sliding_window", "recurrent", "cross_attention")
