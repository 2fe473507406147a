"""kvblocks logs as a library should (issue 30, item 11): a NullHandler on the ``kvblocks`` logger, so an
application that configured no logging gets no bare lines on stderr (Python's last-resort handler printed
them without a logger name), and one that did gets them, named. Each case runs in a fresh interpreter:
logging's configuration is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A failed save for real: a file where the entry's shard directory should be, so the write cannot be made.
FAILED_WRITE = """
import sys
from kvblocks.tiers import FileStorage
storage = FileStorage(sys.argv[1])
key = "xxh3-128.0000000000000000.b0a"
open(storage._file(key).rsplit("/", 1)[0], "wb").close()
assert storage.put([(key, b"value")]) == 0 and storage.stats.put_errors == 1
"""


def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_the_package_logger_has_a_null_handler_only() -> None:
    result = run("import logging, kvblocks; print(logging.getLogger('kvblocks').handlers)")
    assert result.returncode == 0 and result.stdout.strip() == "[<NullHandler (NOTSET)>]"


@pytest.mark.parametrize("name", ["kvblocks", "kvblocks.tiers", "kvblocks.integrations.vllm"])
def test_a_warning_prints_nothing_when_the_application_configured_no_logging(name: str) -> None:
    result = run(f"import logging, kvblocks; logging.getLogger({name!r}).warning('a kvblocks warning')")
    assert result.returncode == 0 and result.stderr == ""


def test_a_failed_write_is_quiet_without_logging_and_named_with_it(tmp_path: Path) -> None:
    quiet = run(FAILED_WRITE, str(tmp_path / "quiet"))
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    configured = run("import logging; logging.basicConfig()\n" + FAILED_WRITE, str(tmp_path / "loud"))
    assert configured.returncode == 0, configured.stderr
    (line,) = configured.stderr.splitlines()
    assert line.startswith("WARNING:kvblocks.tiers:storage entry xxh3-128.0000000000000000.b0a not written to ")
