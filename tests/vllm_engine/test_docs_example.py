"""The vLLM example of docs/integrations.md (its ```py block) runs on a real engine and says what it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def test_the_documented_connector_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    (code,) = re.findall(r"```py\n(.*?)```", PAGE.read_text(), re.DOTALL)
    exec(compile(code, "docs/integrations.md[vllm]", "exec"), {"__name__": "docs_example"})
    assert re.search(r"engine B loaded [1-9]\d* prompt tokens from the store", capsys.readouterr().out)
