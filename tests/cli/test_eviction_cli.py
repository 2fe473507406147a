"""``--eviction`` on ``kvblocks replay`` and ``kvblocks sweep``."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from kvblocks.cli import main
from kvblocks.replay import replay
from kvblocks.traces import load_trace


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(list(argv), out=out)  # type: ignore[arg-type]
    return status, out.getvalue()


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("kvblocks"), captured
    return captured.err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["sweep", "mooncake-synthetic", "--capacities", "50%", "--eviction", "lru,mru"], "unknown eviction policy"),
        (["replay", "--eviction", "LRU"], "known: lru, s3fifo"),
        (["sweep", "mooncake-synthetic", "--capacities", "50%", "--eviction", "lru,lru"], "names a policy twice"),
        (["sweep", "mooncake-synthetic", "--capacities", "50%", "--eviction", ","], "at least one eviction policy"),
        (["replay", "--eviction", "lru,s3fifo"], "replay runs one policy"),
    ],
)
def test_a_bad_eviction_option_is_one_error_line(capsys, argv: list[str], fragment: str) -> None:
    status, text = run(*argv)
    assert status == 2 and text == ""
    assert fragment in one_error_line(capsys)


def test_sweep_gives_one_row_per_policy_and_capacity_matching_replay(tmp_path: Path) -> None:
    target = tmp_path / "sweep.csv"
    status, text = run(
        "sweep", "mooncake-synthetic", "--capacities", "5%,25%", "--eviction", "lru,s3fifo", "--csv", str(target)
    )
    assert status == 0 and text == ""
    rows = list(csv.reader(target.open()))
    assert rows[0][:3] == ["eviction", "capacity_blocks", "share_of_unlimited"]
    assert [r[0] for r in rows[1:]] == ["lru", "lru", "s3fifo", "s3fifo"]
    trace = load_trace("mooncake-synthetic")
    for row in rows[1:]:
        expected = replay(trace, blocks=int(row[1]), block_size=512, eviction=row[0])
        assert float(row[3]) == pytest.approx(expected.token_hit_rate, abs=1e-6)
    lru = {r[1]: float(r[3]) for r in rows[1:] if r[0] == "lru"}
    s3 = {r[1]: float(r[3]) for r in rows[1:] if r[0] == "s3fifo"}
    assert lru.keys() == s3.keys() and lru != s3  # the policies differ somewhere on this trace


def test_sweep_without_eviction_keeps_its_columns_and_replay_names_the_policy() -> None:
    status, text = run("sweep", "mooncake-synthetic", "--capacities", "50%")
    assert status == 0 and text.splitlines()[0].startswith("capacity_blocks,")
    status, text = run("replay", "mooncake-synthetic", "--eviction", "s3fifo", "--blocks", "20000", "--json")
    assert status == 0 and json.loads(text)["eviction"] == "s3fifo"
    status, text = run("replay", "mooncake-synthetic", "--eviction", "s3fifo", "--blocks", "20000", "--check")
    assert status == 0 and "s3fifo (every tier)" in text and "check_integrity passed" in text


def test_sweep_draws_one_labelled_curve_per_policy(tmp_path: Path, monkeypatch) -> None:
    pyplot = pytest.importorskip("matplotlib.pyplot")
    kept: list[object] = []
    monkeypatch.setattr(pyplot, "close", kept.append)
    argv = ["sweep", "mooncake-synthetic", "--capacities", "10%,50%", "--eviction", "lru,s3fifo"]
    assert run(*argv, "--plot", str(tmp_path / "c.png"))[0] == 0
    (figure,) = kept
    axes = figure.axes[0]  # type: ignore[attr-defined]
    assert [line.get_label() for line in axes.get_lines()] == ["lru", "s3fifo"]
