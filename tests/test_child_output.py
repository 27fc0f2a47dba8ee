"""A child's output as `mlxcel-pool up` shows and keeps it: prefixed with the child's name on the
terminal (coloured only on a tty), every line in its log file, the file rotated."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel_pool.child_output import LOG_BACKUPS, ChildOutput

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_reach_the_terminal_prefixed_and_the_log_file(tmp_path: Path) -> None:
    term = io.StringIO()
    out = ChildOutput("w1", tmp_path / "w1.log", term, width=6, colour=0)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('one'); print('two', file=sys.stderr)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert child.stdout is not None
    out.follow(child.stdout).join(10)
    assert child.wait(10) == 0
    assert sorted(term.getvalue().splitlines()) == ["w1     | one", "w1     | two"]
    assert sorted((tmp_path / "w1.log").read_text().splitlines()) == ["one", "two"]

    coloured = _Tty()
    ChildOutput("router", tmp_path / "r.log", coloured, width=6, colour=1).line("up")
    assert coloured.getvalue() == "\x1b[33mrouter |\x1b[0m up\n"


def test_the_log_file_is_rotated_and_old_ones_are_dropped(tmp_path: Path) -> None:
    out = ChildOutput("w1", tmp_path / "w1.log", None, width=6, colour=0)
    out.handler.maxBytes = 2000  # the real bound is LOG_MAX_BYTES; the rule is the same
    for i in range(1000):
        out.line(f"line {i:04d} " + "x" * 40)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["w1.log", *(f"w1.log.{i}" for i in range(1, LOG_BACKUPS + 1))]
    assert all(p.stat().st_size <= 2100 for p in tmp_path.iterdir())
    assert "line 0999" in (tmp_path / "w1.log").read_text()  # the newest lines are kept
