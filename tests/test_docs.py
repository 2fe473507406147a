"""Every ```python block in docs/ and the README runs, so the documentation cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
        used.update(re.findall(r"logging\.getLogger\(\"([\w.]+)\"\)", path.read_text()))
    page = (ROOT / "docs" / "tiers.md").read_text()
    section = page[page.index("## Logging") :]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    documented = set(re.findall(r"^\| `(kvblocks[\w.]*)` \|", section, re.MULTILINE))
    assert used and documented == used
