"""The ``kvblocks`` command: replay, sweep, plan; the published Mooncake figures; clear input errors."""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvblocks import block_hashes
from kvblocks.cli import MODEL_PRESETS, main
from kvblocks.cli.arguments import _parser
from kvblocks.traces import TraceFormatError, load_trace, synthetic_chat


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(list(argv), out=out)  # type: ignore[arg-type]
    return status, out.getvalue()


def assert_one_error_line(capsys, *fragments: str) -> str:
    """The error contract: nothing on stdout, exactly one line on stderr, naming the command."""
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith("\n") and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("kvblocks"), captured.err
    for fragment in fragments:
        assert fragment in captured.err
    return captured.err


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
        (
            '{"hash_ids": [1, -2], "input_length": 600}\n',
            "line 1: 'hash_ids' must be a list of ints in [0, 2**64); position 1 is -2",
        ),
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
    assert float(rows[-1]["share_of_unlimited"]) == 1.0
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


@pytest.mark.parametrize("capacities", ["", "ten", "5%%", "-3", "0%", "20000%", "99999999999999999999", "1e400%"])
def test_bad_capacities_are_usage_errors(capacities: str, capsys) -> None:
    assert main(["sweep", "mooncake-synthetic", "--capacities", capacities]) == 2
    assert_one_error_line(capsys, "kvblocks sweep: error: argument --capacities")


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
    assert main(["plan", "--model", "llama-3-8b", "--memory", "lots"]) == 2
    assert_one_error_line(capsys, "--memory: 'lots' is not a memory size")


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
    # writes are asynchronous: a few reads miss -- 0.06% on an idle machine, 4.2% once in a loaded CI run
    assert 0.9 * unlimited <= result["hit_tokens"] <= unlimited
    status, text = run("replay", "--blocks", "1500", "--host-blocks", "800", "--storage-blocks", "20000")
    assert status == 0 and "by tier        device" in text and "host" in text and "storage" in text


# ---------------------------------------------------------------- every bad input: exit 2, one line, no work


def subcommands() -> list[str]:
    """The subcommands as the parser knows them (not a hard-coded list)."""
    parser = _parser()
    (group,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(group.choices)


def test_the_subcommands_are_discovered() -> None:
    assert {"replay", "sweep", "plan"} <= set(subcommands())


@pytest.mark.parametrize("command", [[], *[[c] for c in subcommands()]])
def test_help_of_every_command_prints_usage_and_exits_0(command: list[str], capsys) -> None:
    assert main([*command, "--help"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"usage: kvblocks {' '.join(command)}".rstrip()) and captured.err == ""


def options_of_every_parser() -> list[tuple[str, argparse.Action]]:
    parser = _parser()
    (group,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    parsers = [("kvblocks", parser), *group.choices.items()]
    return [(name, a) for name, p in parsers for a in p._actions if a.option_strings and a.dest != "help"]


def test_every_option_of_every_command_has_help() -> None:
    options = options_of_every_parser()
    assert len(options) >= 20
    missing = [f"{name} {action.option_strings[0]}" for name, action in options if not (action.help or "").strip()]
    assert missing == []


def test_version_comes_from_the_installed_metadata_and_says_how_the_hot_modules_run(capsys, monkeypatch) -> None:
    from importlib.metadata import version

    from kvblocks import native

    monkeypatch.setattr(native, "status", lambda: native.NativeStatus((), {"kvblocks.core.pool": "not built"}))
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvblocks {version('kvblocks')} (pure Python: not built)\n"


def spy_on_work(monkeypatch) -> list[str]:
    """Record every trace load and replay, so a test can assert the checks came before any work."""
    import kvblocks.replay
    import kvblocks.traces

    work: list[str] = []
    real_load, real_replay = kvblocks.traces.load_trace, kvblocks.replay.replay

    def load(*args, **kwargs):
        work.append("load")
        return real_load(*args, **kwargs)

    def replay(*args, **kwargs):
        work.append("replay")
        return real_replay(*args, **kwargs)

    monkeypatch.setattr(kvblocks.traces, "load_trace", load)
    monkeypatch.setattr(kvblocks.replay, "replay", replay)
    return work


@pytest.mark.parametrize(
    "argv, message",
    [
        (["replay", "--blocks", "100000000000"], "argument --blocks: must be <= 16,777,216"),
        (["replay", "--blocks", "99999999999999999999"], "argument --blocks: must be <= 16,777,216"),
        (["replay", "--blocks", "-5"], "argument --blocks: must be >= 1, got -5"),
        (["replay", "--blocks", "0"], "argument --blocks: must be >= 1, got 0"),
        (["replay", "--workers", "0"], "argument --workers: must be >= 1"),
        (["replay", "--workers", "100000"], "argument --workers: must be <= 1,024"),
        (["replay", "--concurrency", "-1"], "argument --concurrency: must be >= 1"),
        (["replay", "--host-blocks", "99999999999"], "argument --host-blocks: must be <= 16,777,216"),
        (["replay", "--block-size", "0"], "argument --block-size: must be >= 1"),
        (["replay", "--blocks", "ten"], "argument --blocks: 'ten' is not an integer"),
        (["sweep", "mooncake-synthetic", "--capacities", "1%", "--block-size", "9999999"], "must be <= 65,536"),
        (["plan", "--layers", "99999999999", "--kv-heads", "8", "--head-dim", "128", "--memory", "1G"], "<= 1,024"),
        (["plan", "--model", "llama-3-8b", "--memory", "1G", "--block-size", "-16"], "must be >= 1"),
        (["plan", "--model", "llama-3-8b", "--memory", "9" * 5000 + "G"], "too large"),
        (["plan", "--model", "llama-3-8b", "--memory", "2EiB"], "argument --memory: must be <= 1EiB, got '2EiB'"),
        (["plan", "--model", "llama-3-8b", "--memory", "-1G"], "argument --memory: must be > 0 bytes, got '-1G'"),
        (["plan", "--model", "llama-3-8b", "--memory", "-1.5TiB"], "argument --memory: must be > 0 bytes"),
        (["sweep", "mooncake-synthetic", "--capacities", "5%", "--csv", ""], "--csv '': give a file name"),
        (["sweep", "mooncake-synthetic", "--capacities", "5%", "--plot", " "], "--plot ' ': give a file name"),
        (["plan", "--model", "llama-3-8b", "--memory", "2048PiB"], "must be <= 1EiB"),
        (["nonsense"], "invalid choice"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_values_are_one_line_errors_before_any_work(argv: list[str], message: str, capsys, monkeypatch) -> None:
    work = spy_on_work(monkeypatch)
    started = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - started < 2  # refused, not attempted
    assert_one_error_line(capsys, message)
    assert work == []


def write_trace(path: Path, lines: list[str]) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


GOOD_LINE = json.dumps({"token_ids": list(range(40)), "timestamp": 1})


@pytest.mark.parametrize(
    "line, reason",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"token_ids": ' + "[" * 50_000 + "]" * 50_000 + "}", "nested too deeply"),
        (
            '{"token_ids": [1, 4294967296]}',
            "'token_ids' must be a list of ints in [0, 2**32); position 1 is 4294967296",
        ),
        ('{"token_ids": [1, 2.5]}', "position 1 is 2.5"),
        ('{"token_ids": [1], "timestamp": 1' + "0" * 400 + "}", "'timestamp' must be a finite number"),
        ('{"token_ids": [1], "timestamp": NaN}', "not JSON (NaN is not a JSON number)"),
        ('{"token_ids": [1], "output_length": "' + "x" * 10_000 + '"}', "'output_length' must be an int >= 0"),
        ('{"token_ids": [' + "9" * 5000 + "]}", "not JSON"),
    ],
    ids=["deep", "deep-ids", "token-2**32", "token-float", "huge-stamp", "nan-stamp", "long-value", "5000-digits"],
)
def test_a_bad_line_names_file_line_and_reason_and_nothing_runs(
    tmp_path: Path, capsys, monkeypatch, line: str, reason: str
) -> None:
    for name in ("t.jsonl", "t.jsonl.gz"):
        path = write_trace(tmp_path / name, [GOOD_LINE, line])
        work = spy_on_work(monkeypatch)
        assert main(["replay", str(path)]) == 2
        error = assert_one_error_line(capsys, f"{path}, line 2: ", reason)
        assert len(error) < 400 and work == ["load"]
        with pytest.raises(TraceFormatError, match="line 2"):
            load_trace(path)


def test_repeated_hash_ids_in_one_request_name_their_line(tmp_path: Path, capsys) -> None:
    path = write_trace(
        tmp_path / "m.jsonl",
        [json.dumps({"hash_ids": [7, 8], "input_length": 1024})] * 2
        + [json.dumps({"hash_ids": [1, 2, 1], "input_length": 1500})],
    )
    assert main(["replay", str(path)]) == 2
    assert_one_error_line(capsys, f"{path}, line 3: 'hash_ids' position 2 repeats an earlier id (1)")


def test_every_single_byte_flip_and_truncation_of_a_gzipped_trace_is_a_trace_error_or_a_trace(
    tmp_path: Path, capsys
) -> None:
    lines = [json.dumps({"token_ids": list(range(i, i + 40)), "timestamp": i}) for i in range(6)]
    good = write_trace(tmp_path / "good.jsonl.gz", lines).read_bytes()
    damaged = tmp_path / "damaged.jsonl.gz"
    outcomes = {"error": 0, "loaded": 0}
    variants = [good[:i] + bytes([good[i] ^ 0x55]) + good[i + 1 :] for i in range(len(good))]
    variants += [good[:i] for i in range(0, len(good), 7)]
    for data in variants:
        damaged.write_bytes(data)
        try:
            load_trace(damaged)
        except TraceFormatError as error:
            assert str(damaged) in str(error)
            outcomes["error"] += 1
            assert run("replay", str(damaged)) == (2, "")
            assert_one_error_line(capsys, str(damaged))
        else:
            outcomes["loaded"] += 1
    assert outcomes["error"] > len(good) // 2  # most flips damage the stream or its CRC


def test_an_unreadable_path_is_a_trace_error(tmp_path: Path, capsys) -> None:
    assert main(["replay", str(tmp_path)]) == 2  # a directory
    assert_one_error_line(capsys, f"{tmp_path}: cannot read it")


@pytest.mark.parametrize("flag, name", [("--csv", "curve.csv"), ("--plot", "curve.png")])
def test_an_output_into_a_missing_directory_fails_before_the_sweep(
    tmp_path: Path, capsys, monkeypatch, flag: str, name: str
) -> None:
    work = spy_on_work(monkeypatch)
    target = tmp_path / "no" / "such" / name
    assert main(["sweep", "mooncake-synthetic", "--capacities", "5%,100%", flag, str(target)]) == 2
    assert_one_error_line(capsys, f"{flag} {target}: directory", "does not exist")
    assert work == []
    assert main(["sweep", "mooncake-synthetic", "--capacities", "5%", flag, str(tmp_path)]) == 2
    assert_one_error_line(capsys, "is a directory")
    assert work == []


def test_a_read_only_output_directory_fails_before_the_sweep(tmp_path: Path, capsys, monkeypatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: ask the question as a normal user would get it
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    work = spy_on_work(monkeypatch)
    assert main(["sweep", "mooncake-synthetic", "--capacities", "5%", "--csv", str(locked / "c.csv")]) == 2
    assert_one_error_line(capsys, "not writable")
    assert work == []


def test_a_capacity_too_small_for_the_largest_request_fails_before_the_sweep(capsys, monkeypatch) -> None:
    work = spy_on_work(monkeypatch)
    assert main(["sweep", "mooncake-synthetic", "--capacities", "100%,10"]) == 2
    assert_one_error_line(capsys, "--capacities 10 is 10 blocks", "at least 374")  # 374 ids in its longest request
    assert work == ["load"]


def test_a_plot_with_an_unknown_format_fails_before_the_sweep(tmp_path: Path, capsys, monkeypatch) -> None:
    work = spy_on_work(monkeypatch)
    assert main(["sweep", "mooncake-synthetic", "--capacities", "5%", "--plot", str(tmp_path / "c.txt")]) == 2
    assert_one_error_line(capsys, ".png")
    assert work == []


# ---------------------------------------------------------------- papercuts


@pytest.mark.parametrize(
    "memory, size",
    [
        ("40G", 40 * 2**30),
        ("40Gi", 40 * 2**30),
        ("40GiB", 40 * 2**30),
        ("40gib", 40 * 2**30),
        ("40GB", 40 * 10**9),
        ("512M", 512 * 2**20),
        ("512MB", 512 * 10**6),
        ("1.5T", 3 * 2**39),
        ("2TB", 2 * 10**12),
        ("64K", 64 * 1024),
        ("4096", 4096),
        (" 8 GiB ", 8 * 2**30),
        ("1EiB", 2**60),
        ("1E", 2**60),
        ("0.5EiB", 2**59),
        ("1EB", 10**18),
    ],
)
def test_memory_units_binary_and_decimal(memory: str, size: int) -> None:
    shape = ["--layers", "1", "--kv-heads", "1", "--head-dim", "4", "--block-size", "1", "--dtype", "fp8"]
    status, text = run("plan", *shape, "--memory", memory, "--json")  # a block of 8 bytes: K and V, 4 x 1 byte
    plan = json.loads(text)
    assert status == 0 and plan["memory_bytes"] == size and plan["blocks"] == size // 8


@pytest.mark.parametrize("memory", ["0", "0G", "0.0GiB", "0.5B"])
def test_zero_memory_is_an_error(memory: str, capsys) -> None:
    assert main(["plan", "--model", "llama-3-8b", "--memory", memory]) == 2
    assert_one_error_line(capsys, "argument --memory: must be > 0 bytes")


@pytest.mark.parametrize(
    "alias, canonical, element_bytes",
    [("bf16", "bfloat16", 2), ("fp16", "float16", 2), ("fp8", "float8_e4m3fn", 1), ("FP8_E5M2", "float8_e5m2", 1)],
)
def test_dtype_aliases_mean_the_spec_s_names(alias: str, canonical: str, element_bytes: int) -> None:
    status, text = run("plan", "--model", "llama-3-8b", "--memory", "1G", "--dtype", alias, "--json")
    plan = json.loads(text)
    assert status == 0 and plan["dtype"] == canonical
    assert plan["bytes_per_block"] == 32 * 2 * 8 * 128 * element_bytes * 16
    assert json.loads(run("plan", "--model", "llama-3-8b", "--memory", "1G", "--dtype", canonical, "--json")[1]) == plan


def test_an_unknown_dtype_is_a_usage_error(capsys) -> None:
    assert main(["plan", "--model", "llama-3-8b", "--memory", "1G", "--dtype", "fp4"]) == 2
    assert_one_error_line(capsys, "argument --dtype: 'fp4' is not a KV cache dtype", "bf16")


@pytest.mark.parametrize("flags", [["--layers", "40"], ["--kv-heads", "2", "--head-dim", "64"]])
def test_model_with_shape_flags_is_an_error(flags: list[str], capsys) -> None:
    assert main(["plan", "--model", "llama-3-8b", *flags, "--memory", "1G"]) == 2
    assert_one_error_line(capsys, "--model llama-3-8b sets the shape: drop " + flags[0])


def test_block_size_with_a_mooncake_trace_must_be_its_own(capsys) -> None:
    for command in (["replay", "mooncake-synthetic"], ["sweep", "mooncake-synthetic", "--capacities", "100%"]):
        assert main([*command, "--block-size", "16"]) == 2
        assert_one_error_line(capsys, "--block-size 16: the trace's hash ids are 512-token blocks")
    status, text = run("replay", "mooncake-synthetic", "--block-size", "512", "--json")
    assert status == 0 and json.loads(text)["block_size"] == 512


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_sweep_prints_each_row_when_it_finishes_and_progress_only_on_stderr(monkeypatch) -> None:
    import kvblocks.replay

    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm is an optional extra: the plain line stands in
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    out = io.StringIO()
    rows_before_each_replay: list[int] = []
    real = kvblocks.replay.replay

    def replay(*args, **kwargs):
        rows_before_each_replay.append(out.getvalue().count("\n"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kvblocks.replay, "replay", replay)
    assert main(["sweep", "mooncake-synthetic", "--capacities", "5%,1000,25%,100%"], out=out) == 0
    assert rows_before_each_replay == [1, 2, 3, 4]  # the header, then one row per finished capacity
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert len(rows) == 5 and [r[0] for r in rows[1:]][1] == "1000"
    assert all(float(cell) >= 0 for r in rows[1:] for cell in r)  # nothing but numbers below the header
    assert "kvblocks sweep: " in terminal.getvalue() and f"/{4 * 3993:,} requests" in terminal.getvalue()


def test_sweep_progress_uses_tqdm_when_installed(monkeypatch) -> None:
    import types

    bars: list[dict[str, Any]] = []

    class Bar:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs, self.done = kwargs, 0
            bars.append(self.__dict__)

        def update(self, n: int) -> None:
            self.done += n

        def clear(self) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    status, _ = run("sweep", "mooncake-synthetic", "--capacities", "5%,100%")
    assert status == 0 and len(bars) == 1
    assert bars[0]["kwargs"]["file"] is terminal and bars[0]["done"] == bars[0]["kwargs"]["total"] == 2 * 3993
    assert bars[0]["closed"]


def test_sweep_csv_has_a_hit_rate_per_tier_when_tiers_are_given() -> None:
    argv = ["sweep", "mooncake-synthetic", "--capacities", "5%,25%", "--host-blocks", "800"]
    status, text = run(*argv, "--storage-blocks", "20000")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert status == 0 and len(rows) == 2
    for row in rows:
        tiers = [float(row[f"{t}_token_hit_rate"]) for t in ("device", "host", "storage")]
        assert sum(tiers) == pytest.approx(float(row["token_hit_rate"]), abs=3e-6)
    assert float(rows[0]["storage_token_hit_rate"]) > 0
    _, host_only = run(*argv)
    assert next(csv.reader(io.StringIO(host_only)))[-2:] == ["device_token_hit_rate", "host_token_hit_rate"]
    _, plain = run("sweep", "mooncake-synthetic", "--capacities", "5%")
    assert "tier" not in plain.splitlines()[0]


def test_plot_without_matplotlib_names_the_extra_before_any_work(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    work = spy_on_work(monkeypatch)
    table, picture = tmp_path / "c.csv", tmp_path / "c.png"
    argv = ["sweep", "mooncake-synthetic", "--capacities", "5%", "--csv", str(table), "--plot", str(picture)]
    assert main(argv) == 2
    assert_one_error_line(capsys, 'pip install "kvblocks[plot]"')
    assert work == [] and not table.exists() and not picture.exists()


def drawn_figure(monkeypatch, argv: list[str]) -> Any:
    """Run a sweep with --plot and keep the figure it drew (``pyplot.close`` is where the command lets go of it)."""
    pyplot = pytest.importorskip("matplotlib.pyplot")
    kept: list[Any] = []
    monkeypatch.setattr(pyplot, "close", kept.append)
    assert run(*argv)[0] == 0
    (figure,) = kept
    return figure


def overlapping(labels: list[Any]) -> list[tuple[str, str]]:
    """Pairs of drawn tick labels whose boxes overlap on the canvas."""
    boxes = [(label.get_text(), label.get_window_extent()) for label in labels if label.get_text()]
    return [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1 :] if box.overlaps(other)]


def test_the_sweep_plot_is_in_capacity_order_from_zero_with_legible_ticks_and_says_what_ran(
    tmp_path: Path, monkeypatch
) -> None:
    target = tmp_path / "curve.png"
    chat = [json.dumps({"token_ids": list(r.token_ids)}) for r in synthetic_chat().requests]
    trace = str(write_trace(tmp_path / "chat.jsonl", chat))
    capacities = "10%,1000,50%,100%"  # out of order, and 1,000 blocks lie close to 10%: the old ticks overprinted
    argv = ["sweep", trace, "--capacities", capacities, "--workers", "2", "--concurrency", "3"]
    figure = drawn_figure(monkeypatch, [*argv, "--plot", str(target)])
    axes = figure.axes[0]
    (line,) = axes.get_lines()
    xs = list(line.get_xdata())
    assert len(xs) == 4 and 1000 in xs and xs == sorted(xs)  # joined in capacity order: no doubling back
    assert axes.get_ylim()[0] == 0 and axes.get_xlim()[0] == 0  # hit rate (and capacity) start at 0
    figure.canvas.draw()
    for drawn in (axes, *axes.child_axes):  # the top axis gives the share of the unlimited capacity
        for axis in (drawn.xaxis, drawn.yaxis):
            labels = [label for label in axis.get_ticklabels() if label.get_visible()]
            assert overlapping(labels) == [], [label.get_text() for label in labels]
    said = " ".join([axes.get_title(), *(text.get_text() for text in figure.texts)])
    assert "chat.jsonl" in said and "2 workers" in said and "concurrency 3" in said
    assert "blocks of 16 tokens" in axes.get_xlabel()
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_shows_a_plain_progress_line_on_a_terminal_without_tqdm(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` now raises ImportError
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    status, text = run("replay", "--json")
    assert status == 0 and json.loads(text)["requests"] == 701  # stdout holds the result only
    shown = terminal.getvalue()
    assert "\rkvblocks replay: 701/701 requests" in shown and shown.endswith("\r\x1b[K")  # cleared at the end


def test_docs_cli_md_documents_every_flag_and_command() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    for _, action in options_of_every_parser():
        assert f"`{action.option_strings[-1]}" in page, action.option_strings
    for command in subcommands():
        assert f"kvblocks {command}" in page


class _FailingOutput(io.StringIO):
    """Stdout that accepts ``ok`` writes, then fails the way a closed pipe or a full disk does."""

    def __init__(self, error: OSError, ok: int) -> None:
        super().__init__()
        self.error, self.ok = error, ok

    def write(self, text: str) -> int:
        if self.ok <= 0:
            raise self.error
        self.ok -= 1
        return super().write(text)


def test_a_reader_that_leaves_early_ends_the_sweep_quietly(capsys) -> None:
    out = _FailingOutput(BrokenPipeError(32, "Broken pipe"), ok=2)
    assert main(["sweep", "mooncake-synthetic", "--capacities", "5%,25%,100%"], out=out) == 141
    assert capsys.readouterr().err == ""  # no traceback, no message: `| head` is not an error
    assert out.getvalue().count("\n") >= 1  # what was written before the reader left stays written


def test_a_disk_that_fills_midway_is_one_error_line(capsys) -> None:
    out = _FailingOutput(OSError(28, "No space left on device"), ok=2)
    assert main(["sweep", "mooncake-synthetic", "--capacities", "5%,25%,100%"], out=out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvblocks sweep: error: ") and "No space left" in err


def test_sweep_into_a_closed_pipe_prints_no_traceback() -> None:
    code = "import sys\nfrom kvblocks.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    argv = [sys.executable, "-c", code, "sweep", "mooncake-synthetic", "--capacities", "5%,10%,25%,50%,100%"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()  # the header, then the reader goes away, as `| head -1` does
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


# ---------------------------------------------------------------- sizes and papercuts (issue 30)


def test_a_sweep_s_100_percent_is_replay_s_unlimited_cache_and_evicts_nothing(tmp_path: Path) -> None:
    """Running requests hold blocks beside the working set: 100% of the working set still evicted."""
    trace = synthetic_chat()
    path = write_trace(tmp_path / "chat.jsonl", [json.dumps({"token_ids": list(r.token_ids)}) for r in trace.requests])
    for flags in (["--concurrency", "16"], ["--workers", "2"]):
        status, text = run("sweep", str(path), "--capacities", "100%", *flags)
        (row,) = list(csv.DictReader(io.StringIO(text)))
        _, unlimited = run("replay", str(path), "--json", *flags)
        assert status == 0 and row["evicted_blocks"] == "0" and float(row["share_of_unlimited"]) == 1.0
        assert int(row["capacity_blocks"]) == json.loads(unlimited)["capacity_blocks"]
        assert float(row["token_hit_rate"]) == pytest.approx(json.loads(unlimited)["token_hit_rate"], abs=1e-6)


def test_replay_reports_its_setup_and_runs_the_integrity_check_only_when_asked(monkeypatch) -> None:
    from kvblocks.manager import KVCacheManager

    checks: list[int] = []
    real = KVCacheManager.check_integrity
    monkeypatch.setattr(KVCacheManager, "check_integrity", lambda self: checks.append(1) or real(self))
    status, text = run("replay")
    assert status == 0 and checks == [] and "check          not run (--check" in text
    assert re.search(r"^setup          \d+\.\d\d s creating [\d,]+ blocks before the first request$", text, re.M)
    status, text = run("replay", "--check")
    assert status == 0 and checks == [1]
    assert re.search(r"^check          check_integrity passed on every manager \(\d+\.\d\d s\)$", text, re.M)
    status, text = run("replay", "--check", "--json")
    assert json.loads(text)["check_seconds"] >= 0 and checks == [1, 1]


def test_the_progress_line_says_when_the_integrity_check_runs(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert run("replay", "--check")[0] == 0
    assert "\rkvblocks replay: 701/701 requests; checking integrity" in terminal.getvalue()


@pytest.mark.parametrize("block_size", [1, 3, 16, 24, 528])
def test_plan_takes_the_block_sizes_the_manager_takes(block_size: int) -> None:
    from kvblocks import KVCacheManager

    assert KVCacheManager(num_blocks=4, block_size=block_size).block_size == block_size
    status, text = run("plan", "--model", "llama-3-8b", "--memory", "1GiB", "--block-size", str(block_size), "--json")
    plan = json.loads(text)
    assert status == 0 and plan["bytes_per_block"] == 32 * 2 * 8 * 128 * 2 * block_size
    status, _ = run("plan", "--model", "gemma-3-27b", "--memory", "1GiB", "--block-size", str(block_size))
    assert status == 0


@pytest.mark.parametrize(
    "model, message",
    [
        ("llama-3-8b", "--memory 1 byte is smaller than one block (2,097,152 bytes)"),
        ("gemma-3-27b", "--memory 1 byte is smaller than one block of any group"),
    ],
)
def test_a_memory_smaller_than_one_block_is_an_error(model: str, message: str, capsys) -> None:
    assert main(["plan", "--model", model, "--memory", "1"]) == 2
    assert_one_error_line(capsys, message)


def test_the_help_s_largest_memory_is_accepted() -> None:
    help_text = " ".join(action.help or "" for _, action in options_of_every_parser() if action.dest == "memory")
    assert "at most 1EiB" in help_text
    status, text = run("plan", "--model", "llama-3-8b", "--memory", "1EiB", "--json")
    assert status == 0 and json.loads(text)["memory_bytes"] == 2**60


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys) -> None:
    import kvblocks.replay

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(kvblocks.replay, "replay", interrupted)
    assert main(["replay"]) == 130
    assert capsys.readouterr().err == "kvblocks replay: interrupted\n"


def test_ctrl_c_in_a_running_sweep_prints_no_traceback() -> None:
    import signal

    # Ctrl-C as a terminal delivers it. A job started in the background (a CI run under `nohup ... &`) inherits
    # SIGINT ignored and Python then leaves it ignored: the child takes Python's own handler back first.
    code = (
        "import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from kvblocks.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    argv = [sys.executable, "-c", code, "sweep", "mooncake-conversation", "--capacities", "5%,10%,25%,50%,100%"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()  # the header and the first row: the sweep is under way
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 130 and err == "kvblocks sweep: interrupted\n", err
