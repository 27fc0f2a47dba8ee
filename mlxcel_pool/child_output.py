"""A child process's output: into its rotated log file, and (for `mlxcel-pool up`) onto the
terminal with its name in front, as `docker compose up` and honcho show theirs:

    router | INFO router serving model 'mlxcel-tiny-s0' ...
    w1     | INFO mlxcel.worker: worker w1 ready: ...

One thread per child reads its stdout and stderr (one pipe) line by line; the log file is the
stdlib's RotatingFileHandler (it rolls over at LOG_MAX_BYTES, keeping LOG_BACKUPS), so a
long-running pool never fills the disk. The name is coloured only when the terminal is a tty.
"""

from __future__ import annotations

import logging
import threading
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import IO

LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_BACKUPS = 3
# ANSI colours cycled over the children, as docker compose does.
_COLOURS = ("36", "33", "32", "35", "34", "91", "92", "93", "94", "95", "96")


class ChildOutput:
    def __init__(self, name: str, log_path: Path, echo: IO[str] | None, width: int, colour: int):
        self.name = name
        self.handler = RotatingFileHandler(
            log_path, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS, encoding="utf-8"
        )
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.echo = echo
        label = f"{name:<{width}} |"
        tty = bool(echo is not None and getattr(echo, "isatty", lambda: False)())
        code = _COLOURS[colour % len(_COLOURS)]
        self.prefix = f"\x1b[{code}m{label}\x1b[0m " if tty else f"{label} "
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        """One line (no newline) to the log file and, when echoing, to the terminal."""
        with self._lock:
            self.handler.emit(logging.makeLogRecord({"msg": text, "args": None}))
            if self.echo is not None:
                try:
                    self.echo.write(f"{self.prefix}{text}\n")
                    self.echo.flush()
                except (OSError, ValueError):  # the terminal went away: the file still has it
                    self.echo = None

    def follow(self, stream: IO[bytes]) -> threading.Thread:
        """Copy `stream` line by line until the child and whatever inherited its pipe close it."""

        def pump() -> None:
            with stream:
                for raw in iter(stream.readline, b""):
                    self.line(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
            self.handler.close()

        thread = threading.Thread(target=pump, name=f"output-{self.name}", daemon=True)
        thread.start()
        return thread
