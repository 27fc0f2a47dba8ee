"""Where a benchmark run's results go: `bench/results/<bench>-<UTC time>-<commit>.txt` (what it
printed), `.json` (its numbers) and `.png` (its plot), in a folder git ignores. The README and
bench/README.md quote the latest figures with date, commit and machine; these files are the run
they came from.

`Results(name)` starts copying stdout; `finish(data, plot)` writes the three files and says
where on stderr. Plots use matplotlib's Agg backend (no display); without matplotlib the PNG is
skipped and the rest still written.
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=RESULTS_DIR.parent
        ).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "nogit"
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


class _Tee(io.TextIOBase):
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.copy = io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


class Results:
    def __init__(self, name: str) -> None:
        self.name = name
        self.stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self._tee = _Tee(sys.stdout)
        sys.stdout = self._tee  # type: ignore[assignment]

    def finish(self, data: Any, plot: Callable[[Any], None] | None = None) -> list[Path]:
        """Write the run's files; `plot(axes)` draws on one matplotlib Axes."""
        sys.stdout = self._tee.out  # type: ignore[assignment]
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        base = RESULTS_DIR / f"{self.name}-{self.stamp}-{_commit()}"
        written = [base.with_suffix(".txt"), base.with_suffix(".json")]
        written[0].write_text(self._tee.copy.getvalue())
        written[1].write_text(json.dumps(data, indent=2, default=_jsonable))
        if plot is not None:
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt
            except ImportError:
                print("results: matplotlib not installed: no plot", file=sys.stderr)
            else:
                fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
                plot(ax)
                fig.tight_layout()
                fig.savefig(base.with_suffix(".png"))
                plt.close(fig)
                written.append(base.with_suffix(".png"))
        print("results: " + ", ".join(str(p) for p in written), file=sys.stderr)
        return written
