"""The vLLM connector's settings and stored-block format, without vLLM."""

from __future__ import annotations

import importlib.util

import pytest

from kvblocks.errors import ConfigError
from kvblocks.integrations.vllm import ConnectorSettings, VllmKVFormat
from kvblocks.tiers.file_storage import FileStorage


def test_settings_come_from_the_extra_config_and_refuse_unknown_keys(tmp_path) -> None:
    s = ConnectorSettings.from_extra_config({"path": str(tmp_path), "max_pending_writes": 8})
    assert (s.storage, s.path, s.max_pending_writes) == ("file", str(tmp_path), 8)
    assert ConnectorSettings.from_extra_config(None) == ConnectorSettings()
    storage = s.open_storage()
    try:
        assert isinstance(storage, FileStorage) and storage.root == tmp_path
    finally:
        storage.close()
    with pytest.raises(ConfigError, match="unknown keys \\['pth'\\]"):
        ConnectorSettings.from_extra_config({"pth": "/x"})
    with pytest.raises(ConfigError):
        ConnectorSettings.from_extra_config(["path"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"storage": "s3"},
        {"path": ""},
        {"redis_url": 5},
        {"salt": ""},
        {"byte_budget": -1},
        {"byte_budget": 1.5},
        {"max_pending_writes": 0},
        {"max_pending_writes": True},
        {"lookup_timeout_s": -0.1},
        {"storage_timeout_s": 0},
    ],
)
def test_bad_settings_are_refused_when_the_engine_starts(bad: dict) -> None:
    with pytest.raises(ConfigError):
        ConnectorSettings.from_extra_config(bad)


def fmt(**changes) -> VllmKVFormat:
    base = {"model": "m", "dtype": "bfloat16", "num_layers": 4, "block_shape": (2, 32, 128), "block_size": 32}
    return VllmKVFormat(**{**base, **changes})


def test_whatever_shapes_a_blocks_bytes_moves_it_to_another_key_space() -> None:
    base = fmt()
    # the key of a block: namespace tag (model, salt, scheme, block size) and the format tag (the bytes' shape)
    keys = {(f.tag, f.entry_format.tag) for f in [base, fmt(dtype="float16"), fmt(num_layers=8)]}
    assert len(keys) == 3
    for other in (
        fmt(model="m2"),
        fmt(salt="s"),
        fmt(hash_algo="xxhash"),
        fmt(block_size=16),
        fmt(layout="cpu:NHD:tp2"),
        fmt(block_shape=(4, 32, 64)),
    ):
        assert (other.tag, other.entry_format.tag) != (base.tag, base.entry_format.tag)
    assert base.entry_format.payload_length == 4 * 2 * 32 * 128 * 2
    assert base.scheme == "vllm-sha256" and fmt(hash_algo="sha256_cbor").scheme == "vllm-sha256-cbor"


@pytest.mark.parametrize(
    "bad",
    [
        {"model": ""},
        {"dtype": "float64"},
        {"num_layers": 0},
        {"block_size": True},
        {"block_shape": ()},
        {"block_shape": (2, 0)},
        {"block_shape": [2, 3]},
        {"hash_algo": "md5"},
        {"layout": None},
        {"salt": ""},
    ],
)
def test_a_bad_format_is_refused(bad: dict) -> None:
    with pytest.raises(ConfigError):
        fmt(**bad)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_connector_names_what_to_install() -> None:
    import kvblocks.integrations.vllm as integration

    with pytest.raises(ConfigError, match=r"kvblocks\[vllm\]"):
        _ = integration.KVBlocksConnector
    with pytest.raises(AttributeError):
        _ = integration.NoSuchThing


def _spec(name: str, **fields: object) -> object:
    return type(name, (), fields)()


def test_group_kinds_come_from_vllms_spec_classes_and_mamba_state_is_refused() -> None:
    from kvblocks.integrations.vllm.groups import _kind_of

    assert _kind_of(0, _spec("FullAttentionSpec", sliding_window=None, attention_chunk_size=None)) == ("full", None)
    assert _kind_of(1, _spec("SlidingWindowSpec", sliding_window=64, extra_retained_tokens=3)) == ("sliding_window", 67)
    assert _kind_of(2, _spec("ChunkedLocalAttentionSpec", attention_chunk_size=256)) == ("chunked_local", 256)
    with pytest.raises(ConfigError, match=r"group 3 is MambaSpec \(Mamba / linear-attention state"):
        _kind_of(3, _spec("MambaSpec"))
    with pytest.raises(ConfigError, match="MLAAttentionSpec"):
        _kind_of(0, _spec("MLAAttentionSpec"))
    # HMA off: vLLM gives a windowed model full-attention memory; every block is stored, a hit needs them all
    assert _kind_of(0, _spec("FullAttentionSpec", sliding_window=64)) == ("full", None)


def test_each_group_of_a_hybrid_model_stores_under_a_key_space_naming_it() -> None:
    from kvblocks.integrations.vllm.groups import VllmGroup

    fmt = VllmKVFormat("tiny", "float32", 2, (2, 32, 64), 32, "sha256")
    single = VllmGroup(0, "full", None, ("l0", "l1"), fmt)
    assert single.tag == fmt.tag  # one full-attention group: the key space stores written before HMA use
    tags = {
        VllmGroup(n, kind, span, ("l0",), fmt, hybrid=True).tag
        for n, kind, span in (
            (0, "full", None),
            (1, "full", None),
            (0, "sliding_window", 64),
            (0, "sliding_window", 128),
        )
    }
    assert len(tags) == 4 and fmt.tag not in tags
    rule = VllmGroup(0, "sliding_window", 64, ("l0",), fmt, hybrid=True).rule
    assert (rule.kind, rule.block_size, rule.span) == ("sliding_window", 32, 64)
