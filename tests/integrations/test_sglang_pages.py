"""The SGLang backend's parts that need no SGLang: settings, page keys, page identity and page byte runs.

SGLang's own objects drive the whole backend in tests/sglang_engine (an environment of its own).
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.errors import ConfigError, InvalidArgumentError, MissingExtraError
from kvblocks.integrations.sglang import HiCacheSettings, SglangPageFormat
from kvblocks.integrations.sglang.pages import page_hash, page_runs

torch = pytest.importorskip("torch")


def test_settings_pass_sglangs_own_keys_and_refuse_unknown_ones() -> None:
    s = HiCacheSettings.from_extra_config(
        {"backend_name": "kvblocks", "module_path": "m", "class_name": "C", "interface_v1": 1, "path": "/kv"}
        | {"prefetch_threshold": 256, "hicache_storage_pass_prefix_keys": True}  # SGLang's prefetch knobs
    )
    assert (s.storage, s.path, s.lookup_timeout_s) == ("file", "/kv", 1.0)
    assert HiCacheSettings.from_extra_config(None) == HiCacheSettings()
    with pytest.raises(ConfigError, match=r"hicache-storage-backend-extra-config has unknown keys \['pth'\]"):
        HiCacheSettings.from_extra_config({"pth": "/kv"})
    for bad in ({"storage": "s3"}, {"lookup_timeout_s": -1}, {"max_pending_writes": True}, {"path": ""}):
        with pytest.raises(ConfigError):
            HiCacheSettings.from_extra_config(bad)
    with pytest.raises(ConfigError, match="must be a mapping"):
        HiCacheSettings.from_extra_config(["path"])  # type: ignore[arg-type]


def test_the_backend_class_names_its_extra_without_sglang() -> None:
    import importlib.util

    import kvblocks.integrations.sglang as integration

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    with pytest.raises(MissingExtraError, match=r"kvblocks\[sglang\]"):
        _ = integration.KVBlocksHiCacheStorage


def test_page_keys() -> None:
    digest = hashlib.sha256(b"x").digest()
    assert page_hash(digest.hex()) == digest  # HiCache's page key is the hex of SGLang's page hash
    other = page_hash(digest.hex() + ".mamba")
    assert len(other) == 32 and other != digest
    assert page_hash("ABC") != page_hash("abc")
    with pytest.raises(InvalidArgumentError):
        page_hash(b"00" * 32)  # type: ignore[arg-type]


# SGLang's host KV buffers (pool_host/mha.py init_kv_buffer) and how get_data_page slices one page
LAYOUTS = {
    "layer_first": (lambda L, S, P, H, D: (2, L, S, H, D), lambda b, i, P: b[:, :, i : i + P]),
    "page_first": (lambda L, S, P, H, D: (2, S, L, H, D), lambda b, i, P: b[:, i : i + P]),
    "page_first_direct": (lambda L, S, P, H, D: (2, S // P, L, P, H, D), lambda b, i, P: b[:, i // P : i // P + 1]),
    "page_head": (lambda L, S, P, H, D: (2, S // P, H, P, L, D), lambda b, i, P: b[:, i // P : i // P + 1]),
}


def storage_bytes(buffer) -> memoryview:
    raw = torch.empty(0, dtype=torch.uint8).set_(buffer.untyped_storage())
    return memoryview(raw.numpy()).cast("B")


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    layers=st.integers(1, 4),
    pages=st.integers(1, 4),
    page_size=st.integers(1, 4),
    heads=st.integers(1, 3),
    dim=st.integers(1, 4),
    data=st.data(),
)
def test_page_runs_are_the_flat_page_in_order(layout, layers, pages, page_size, heads, dim, data) -> None:
    """Whatever the layout, the page's runs joined are its flat page (what SGLang's generic path moves), and
    they view the buffer itself (written through them, the pool changes)."""
    shape, page_of = LAYOUTS[layout]
    size = pages * page_size
    buffer = torch.arange(int(torch.tensor(shape(layers, size, page_size, heads, dim)).prod()), dtype=torch.int16)
    buffer = buffer.reshape(shape(layers, size, page_size, heads, dim))
    index = data.draw(st.integers(0, pages - 1)) * page_size
    page = page_of(buffer, index, page_size)
    runs = page_runs(page, storage_bytes(buffer))
    assert b"".join(bytes(r) for r in runs) == page.contiguous().numpy().tobytes()
    runs[0][0:2] = b"\xff\xff"
    assert page.flatten()[0].item() == -1


class FakePool:
    """A host pool's surface the format reads (unit tests only; tests/sglang_engine uses SGLang's)."""

    def __init__(self, layout: str = "page_first", dtype=torch.float16, device: str = "cpu", fails: bool = False):
        self.layout, self.page_size, self.fails = layout, 4, fails
        self.buffer = torch.zeros(2, 16, 3, 2, 8, dtype=dtype, device=device)

    def get_data_page(self, index: int, flat: bool = True):
        if self.fails:
            raise ValueError(f"Unsupported layout: {self.layout}")
        page = self.buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page


def config(**over):
    base = dict(
        tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False, model_name="m"
    )
    return SimpleNamespace(**{**base, **over})


def test_the_page_format_names_what_shapes_a_pages_bytes() -> None:
    base = SglangPageFormat.of(FakePool(), config())
    assert (base.dtype, base.layout, base.page_shape, base.payload_length) == (
        "float16",
        "page_first",
        (2, 4, 3, 2, 8),
        768,
    )
    tags = {
        SglangPageFormat.of(pool, cfg).entry_format.tag
        for pool, cfg in [
            (FakePool(), config()),
            (FakePool(dtype=torch.bfloat16), config()),
            (FakePool(layout="page_first_direct"), config()),
            (FakePool(), config(tp_rank=1)),
            (FakePool(), config(model_name="other")),
            (FakePool(), config(pp_size=2)),
        ]
    }
    assert len(tags) == 6  # each difference is another key space
    mla = [SglangPageFormat.of(FakePool(), config(is_mla_model=True, tp_rank=r)) for r in (0, 1)]
    assert mla[0] == mla[1]  # MLA pages are the same on every tensor-parallel rank: one key space


def test_a_pool_kvblocks_cannot_store_is_refused_at_registration() -> None:
    with pytest.raises(ConfigError, match="page_unified"):
        SglangPageFormat.of(FakePool(layout="page_unified", fails=True), config())
    with pytest.raises(ConfigError, match="CPU"):
        SglangPageFormat.of(FakePool(device="meta"), config())
