"""The ``kvblocks`` command: replay, sweep, plan; the published Mooncake figures; clear input errors."""

from __future__ import annotations

import csv
import gzip
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvblocks import block_hashes
from kvblocks.cli import MODEL_PRESETS, main
from kvblocks.traces import TraceFormatError, load_trace, synthetic_chat


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(list(argv), out=out)  # type: ignore[arg-type]
    return status, out.getvalue()


def model_hit_tokens(requests, block_size: int) -> tuple[int, int]:
    """An infinite cache under kvblocks' rules (full blocks, never the last token): hit and prompt tokens."""
    cached: set[object] = set()
    hits = total = 0
    for r in requests:
        hashes = block_hashes(r.token_ids, block_size)
        limit = (r.num_tokens - 1) // block_size
        n = 0
        while n < limit and hashes[n] in cached:
            n += 1
        hits += n * block_size
        total += r.num_tokens
        cached.update(hashes)
    return hits, total


# ---------------------------------------------------------------- replay


def test_replay_without_a_trace_runs_the_built_in_workload() -> None:
    status, text = run("replay")
    assert status == 0
    assert "synthetic-chat: 701 requests" in text and "hit rate" in text and "requests/s" in text


def test_replay_json_matches_an_independent_infinite_cache() -> None:
    status, text = run("replay", "--json")
    assert status == 0
    result = json.loads(text)
    hits, total = model_hit_tokens(synthetic_chat().requests, 16)
    assert (result["hit_tokens"], result["prompt_tokens"]) == (hits, total)
    assert result["token_hit_rate"] == pytest.approx(hits / total)
    assert result["evicted_blocks"] == 0


def test_a_small_cache_evicts_and_hits_less() -> None:
    _, unlimited = run("replay", "--json")
    status, limited = run("replay", "--json", "--blocks", "1500", "--concurrency", "4")
    assert status == 0
    small, big = json.loads(limited), json.loads(unlimited)
    assert small["evicted_blocks"] > 0 and small["hit_tokens"] < big["hit_tokens"]
    assert small["peak_blocks_in_use"] <= 1500


def mooncake_reference(name: str) -> float:
    """The published definition, computed here: every hash id, unlimited cache, contiguous prefix hits."""
    cached: set[int] = set()
    hits = total = 0
    for r in load_trace(name).requests:
        ids = r.hash_ids
        n = 0
        while n < len(ids) and ids[n] in cached:
            n += 1
        hits += n
        total += len(ids)
        cached.update(ids)
    return hits / total


@pytest.mark.parametrize("name, published", [("mooncake-conversation", 0.366), ("mooncake-synthetic", 0.640)])
def test_replaying_mooncake_reproduces_the_published_hit_rate(name: str, published: float) -> None:
    status, text = run("replay", name, "--reference", "--json")
    assert status == 0
    result = json.loads(text)
    assert result["block_hit_rate"] == pytest.approx(mooncake_reference(name), abs=1e-12)
    assert result["block_hit_rate"] == pytest.approx(published, abs=0.001)
    assert result["requests"] == {"mooncake-conversation": 12031, "mooncake-synthetic": 3993}[name]


def test_replay_over_workers_reports_load_balance() -> None:
    status, text = run("replay", "mooncake-synthetic", "--workers", "4", "--blocks", "20000", "--json")
    result = json.loads(text)
    assert status == 0 and result["workers"] == 4 and len(result["worker_prefill_tokens"]) == 4
    assert result["load_balance"] == max(result["worker_prefill_tokens"]) / min(result["worker_prefill_tokens"])
    assert result["hit_tokens"] > 0


def test_token_and_gzip_traces(tmp_path: Path) -> None:
    lines = [json.dumps({"token_ids": list(range(40)), "timestamp": 2}), json.dumps({"token_ids": list(range(33))})]
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(lines) + "\n\n")
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        status, text = run("replay", str(path), "--json", "--block-size", "8")
        result = json.loads(text)
        # timestamp order: the 33-token prompt (stamp 0) first; the 40-token one then hits its 4 full blocks
        assert status == 0 and result["hit_tokens"] == 32 and result["prompt_tokens"] == 73


# ---------------------------------------------------------------- malformed input


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"hash_ids": [1, 2], "input_length": 600}\nnot json\n', "line 2: not JSON"),
        ('{"hash_ids": [1], "input_length": 600}\n', "line 1: 1 hash_ids for 600 tokens"),
        ('{"hash_ids": [1, -2], "input_length": 600}\n', "line 1: 'hash_ids' must be a list of ints >= 0"),
        ('{"hash_ids": [1, 2]}\n', "line 1: 'input_length' must be an int >= 1"),
        ('{"prompt": "hi"}\n', "line 1: a request needs 'hash_ids' (Mooncake) or 'token_ids'"),
        ('{"token_ids": [1, 2]}\n{"hash_ids": [1], "input_length": 5}\n', "line 2: has 'hash_ids' but"),
        ('{"token_ids": []}\n', "line 1: 'token_ids' is empty"),
        ('{"token_ids": [1], "timestamp": "now"}\n', "line 1: 'timestamp' must be a number"),
        ("[1, 2, 3]\n", "line 1: expected a JSON object"),
        ("\n\n", "no requests"),
    ],
)
def test_a_malformed_trace_is_an_error_with_its_line_and_nothing_is_printed(
    tmp_path: Path, capsys, content: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    status, text = run("replay", str(path))
    assert status == 2 and text == ""
    assert message in capsys.readouterr().err
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl"):
        load_trace(path)


def test_a_missing_trace_names_the_bundled_ones(capsys) -> None:
    status, _ = run("replay", "no-such-trace")
    assert status == 2 and "mooncake-conversation" in capsys.readouterr().err


def test_a_cache_too_small_for_one_request_is_an_error(capsys) -> None:
    status, text = run("replay", "--blocks", "10")
    assert status == 2 and text == "" and "largest request" in capsys.readouterr().err


# ---------------------------------------------------------------- sweep


def test_sweep_writes_a_curve_that_rises_with_capacity(tmp_path: Path) -> None:
    status, text = run("sweep", "mooncake-synthetic", "--capacities", "5%,1000,25%,100%")
    assert status == 0
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [r["capacity_blocks"] for r in rows][1] == "1000"
    assert float(rows[-1]["share_of_working_set"]) == pytest.approx(1.0, abs=1e-3)
    by_capacity = sorted(rows, key=lambda r: int(r["capacity_blocks"]))
    rates = [float(r["token_hit_rate"]) for r in by_capacity]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    assert int(by_capacity[-1]["evicted_blocks"]) == 0 < int(by_capacity[0]["evicted_blocks"])
    target = tmp_path / "curve.csv"
    assert run("sweep", "mooncake-synthetic", "--capacities", "5%,100%", "--csv", str(target))[0] == 0
    assert target.read_text().splitlines()[0].startswith("capacity_blocks,")


def test_sweep_plot_needs_matplotlib_or_draws_a_png(tmp_path: Path, capsys) -> None:
    target = tmp_path / "curve.png"
    status, _ = run("sweep", "mooncake-synthetic", "--capacities", "10%,50%", "--plot", str(target))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert status == 2 and "kvblocks[plot]" in capsys.readouterr().err and not target.exists()
    else:
        assert status == 0 and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("capacities", ["", "ten", "5%%", "-3"])
def test_bad_capacities_are_usage_errors(capacities: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "mooncake-synthetic", "--capacities", capacities])
    assert exit_info.value.code == 2


# ---------------------------------------------------------------- plan


def test_plan_for_a_preset_and_a_custom_shape() -> None:
    status, text = run("plan", "--model", "llama-3-8b", "--memory", "40GiB", "--json")
    plan = json.loads(text)
    per_block = 32 * 2 * 8 * 128 * 2 * 16  # layers x (K, V) x heads x head_dim x bf16 bytes x tokens
    assert status == 0 and plan["bytes_per_block"] == per_block
    assert plan["blocks"] == 40 * 2**30 // per_block and plan["tokens"] == plan["blocks"] * 16
    status, text = run("plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--memory", "40GiB", "--json")
    assert json.loads(text)["bytes_per_block"] == per_block
    status, text = run("plan", "--model", "deepseek-v3", "--memory", "1GB", "--json")
    assert json.loads(text)["bytes_per_block"] == 61 * (512 + 64) * 2 * 16  # one MLA latent, no V
    assert set(MODEL_PRESETS) >= {"llama-3-8b", "llama-3-70b", "qwen2.5-7b", "deepseek-v3"}


def test_plan_errors(capsys) -> None:
    status, _ = run("plan", "--layers", "32", "--memory", "1GiB")
    assert status == 2 and "--kv-heads" in capsys.readouterr().err
    status, _ = run("plan", "--model", "llama-3-8b", "--memory", "1GiB", "--block-size", "12")
    assert status == 2 and "power of two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-3-8b", "--memory", "lots"])


# ---------------------------------------------------------------- entry points


def test_the_console_script_and_python_dash_m() -> None:
    module = subprocess.run(
        [sys.executable, "-m", "kvblocks", "plan", "--model", "llama-3-8b", "--memory", "1GiB"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert module.returncode == 0 and "bytes per block  2,097,152" in module.stdout
    script = shutil.which("kvblocks")
    if script is None:
        pytest.skip("the kvblocks console script is not on PATH (package not installed)")
    done = subprocess.run([script, "replay", "--json"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and json.loads(done.stdout)["requests"] == 701
    assert done.stderr == ""  # no progress bar when stderr is not a terminal


# ---------------------------------------------------------------- tiers in the replay


def test_a_host_tier_as_big_as_the_working_set_recovers_every_hit_of_an_unlimited_cache() -> None:
    from kvblocks.replay import replay

    trace = synthetic_chat()
    unlimited = replay(trace)
    small = replay(trace, blocks=1500, concurrency=4)
    with_host = replay(trace, blocks=1500, concurrency=4, host_blocks=20_000)
    assert small.hit_tokens < unlimited.hit_tokens and small.evicted_blocks > 0
    assert with_host.hit_tokens == unlimited.hit_tokens  # every evicted block came back from host
    assert with_host.hit_tokens_device == small.hit_tokens_device and with_host.hit_tokens_host > 0
    assert with_host.hit_tokens == with_host.hit_tokens_device + with_host.hit_tokens_host


def test_replay_reports_storage_hits_and_prints_the_breakdown() -> None:
    status, text = run("replay", "--blocks", "1500", "--concurrency", "4", "--storage-blocks", "20000", "--json")
    result = json.loads(text)
    _, plain = run("replay", "--json")
    unlimited = json.loads(plain)["hit_tokens"]
    assert status == 0 and result["hit_tokens_storage"] > 0 and result["hit_tokens_host"] == 0
    assert 0.99 * unlimited <= result["hit_tokens"] <= unlimited  # writes are asynchronous: a few reads miss
    status, text = run("replay", "--blocks", "1500", "--host-blocks", "800", "--storage-blocks", "20000")
    assert status == 0 and "by tier        device" in text and "host" in text and "storage" in text
