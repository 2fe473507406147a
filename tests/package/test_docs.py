"""Every ```python block in docs/ and the README runs, so the documentation cannot drift from the code."""

from __future__ import annotations

import ast
import importlib
import json
import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvblocks.integrations.vllm import ConnectorSettings

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def snippets() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        for index, match in enumerate(BLOCK.finditer(page.read_text())):
            found.append((page.name, index, match.group(1)))
    return found


@pytest.mark.parametrize("page, index, code", snippets(), ids=lambda v: str(v)[:20])
def test_doc_snippet_runs(page: str, index: int, code: str) -> None:
    exec(compile(code, f"{page}[{index}]", "exec"), {})


def test_docs_have_snippets_and_every_link_resolves() -> None:
    assert len(snippets()) >= 5
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+\.md)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_the_logging_table_names_exactly_the_loggers_the_code_uses() -> None:
    used = set()
    for path in (ROOT / "kvblocks").rglob("*.py"):
        # each module's own logger (the package logger, given only a NullHandler, and vLLM's are not kvblocks' lines)
        used.update(re.findall(r"^_\w+ = logging\.getLogger\(\"([\w.]+)\"\)", path.read_text(), re.MULTILINE))
    page = (ROOT / "docs" / "tiers.md").read_text()
    section = page[page.index("## Logging") :]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    documented = set(re.findall(r"^\| `(kvblocks[\w.]*)` \|", section, re.MULTILINE))
    assert used and documented == used


# ---------------------------------------------------------------- vLLM users find the connector (issue 30: 13)

VLLM_PAGE = ROOT / "docs" / "vllm.md"


def test_vllm_users_are_sent_to_a_page_of_their_own_from_the_readme_the_index_and_engines() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "KVBlocksConnector" in readme and "](docs/vllm.md)" in readme
    for page in ("index.md", "engines.md", "integrations.md"):
        assert "](vllm.md)" in (ROOT / "docs" / page).read_text(), page
    index = (ROOT / "docs" / "index.md").read_text()
    assert "KVBlocksConnector" in index[index.index("](vllm.md)") - 200 :]


def _documented_transfer_configs() -> list[dict]:
    """The ``--kv-transfer-config`` JSON of the ``vllm serve`` line and the ``kv_transfer_config=`` dict of the
    ``LLM(...)`` form."""
    page = VLLM_PAGE.read_text()
    (serve,) = re.findall(r"^vllm serve MODEL --kv-transfer-config '(\{.*\})'$", page, re.MULTILINE)
    (python,) = re.findall(r"```py\n(.*?)```", page, re.DOTALL)
    (call,) = [n for n in ast.walk(ast.parse(python)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "LLM"]
    (keyword,) = [k for k in call.keywords if k.arg == "kv_transfer_config"]
    return [json.loads(serve), ast.literal_eval(keyword.value)]


def test_the_documented_serve_line_and_llm_form_name_the_real_connector_with_valid_settings() -> None:
    for config in _documented_transfer_configs():
        assert config["kv_connector"] == "KVBlocksConnector" and config["kv_role"] == "kv_both"
        module = importlib.import_module(config["kv_connector_module_path"])
        assert "KVBlocksConnector" in module.__all__  # what vLLM loads by that name (vLLM itself not needed here)
        assert ConnectorSettings.from_extra_config(config["kv_connector_extra_config"]).path == "/mnt/kv"


def test_the_vllm_page_documents_every_connector_setting_storage_choices_hits_and_counter() -> None:
    page = VLLM_PAGE.read_text()
    settings_part = page.split("## Connector statistics", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)` \| ", settings_part, re.MULTILINE))
    assert rows == {f.name for f in fields(ConnectorSettings)}
    for example in re.findall(r"`(\{\"(?:path|storage)\".*?\})`", page):  # the storage table's examples
        ConnectorSettings.from_extra_config(json.loads(example))
    for needed in ("vllm:external_prefix_cache_hits", "External prefix cache hit rate", "## Connector statistics"):
        assert needed in page, needed
    from kvblocks.integrations.vllm.worker import COUNTERS

    section = page.split("## Connector statistics", 1)[1]
    assert set(re.findall(r"^\| `(\w+)` \| ", section, re.MULTILINE)) == set(COUNTERS)  # every counter, no other
