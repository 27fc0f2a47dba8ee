"""llguidance's grammar check in helper processes, where a native crash costs one request only.

llguidance compiles on the native stack; a grammar that overflows it (shared/schema_limits.py
bounds the shapes known to, this catches the rest) kills the process it runs in with SIGSEGV.
In a router process that would end every stream it relays, so each router process keeps a few
helper processes (HELPERS, started on first use, reused by every request) and runs the check in
one of them: a helper that dies answers its one request with `HelperCrashed` and is replaced,
and the router process and its other requests go on.

A helper is `python -m router.admission.grammar_sandbox <in fd> <out fd>`: a plain process (no
multiprocessing start method re-importing the router's __main__) that imports llguidance only
and answers, one at a time, the calls written to its pipe: `(function, args)` pickled by
reference, answered with `("ok", value)` or `("error", message)`. Each tokenizer's llguidance
view is sent to a helper once and kept there by its key. Calls block their thread (admission
runs in the threadpool, never on the event loop).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)

# Helper processes per router process: each runs one check at a time.
HELPERS = 2
# A check still running after this long is stopped (its helper killed and replaced).
CHECK_TIMEOUT_S = 30.0


class SandboxError(RuntimeError):
    """A call the helper did not answer: it crashed or ran past the timeout."""


class HelperCrashed(SandboxError):
    pass


class HelperTimeout(SandboxError):
    pass


class CallFailed(Exception):
    """The called function raised in the helper; the message is its exception's."""


class SetupFailed(CallFailed):
    """The setup call raised in the helper (what the function needs could not be loaded)."""


class _Helper:
    """One helper process and its two pipes; used by one thread at a time."""

    def __init__(self) -> None:
        down_r, down_w = os.pipe()  # router -> helper
        up_r, up_w = os.pipe()  # helper -> router
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "router.admission.grammar_sandbox", str(down_r), str(up_w)],
                pass_fds=(down_r, up_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (down_r, down_w, up_r, up_w):
                os.close(fd)
            raise
        os.close(down_r)
        os.close(up_w)
        self.pid = os.getpid()  # the process that started it (a fork's copy is not its owner)
        self.send_conn = Connection(down_w, readable=False)
        self.recv_conn = Connection(up_r, writable=False)
        self.keys: set[str] = set()  # tokenizers this helper holds

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        try:
            self.send_conn.send((fn, args))
            ready = self.recv_conn.poll(timeout_s)
            if not ready:
                self.kill()
                raise HelperTimeout(f"the grammar check ran past {timeout_s:g} s")
            status, value = self.recv_conn.recv()
        except (EOFError, OSError) as exc:
            raise HelperCrashed(self._death()) from exc
        if status == "error":
            raise CallFailed(value)
        return value

    def _death(self) -> str:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "the helper stopped answering"
        if code < 0:
            try:
                return f"the helper was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"the helper was killed by signal {-code}"
        return f"the helper exited with code {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.close()

    def close(self) -> None:
        for conn in (self.send_conn, self.recv_conn):
            with contextlib.suppress(OSError):
                conn.close()


class GrammarSandbox:
    """Up to `helpers` helper processes, each lent to one call at a time (a call waits for a
    free one); a helper that crashes or times out is dropped and a new one started for the next
    call."""

    def __init__(self, helpers: int = HELPERS, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.helpers = helpers
        self.timeout_s = timeout_s
        self._free: queue.SimpleQueue[_Helper] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0  # helpers alive or being started, at most `helpers`
        self._pid = os.getpid()

    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        key: str | None = None,
        setup: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]] | None = None,
    ) -> Any:
        """`fn(*args)` in a helper. `setup` (with `key`): the call that loads what `fn` needs,
        made first on a helper that has not made it yet. Raises SandboxError when the helper
        crashes or times out, CallFailed when the function raised."""
        helper = self._take()
        healthy = True  # false once the helper itself failed: it is dropped, not lent again
        try:
            if key is not None and setup is not None and key not in helper.keys:
                setup_fn, setup_args = setup()
                try:
                    helper.call(setup_fn, setup_args, self.timeout_s)
                except CallFailed as exc:
                    raise SetupFailed(str(exc)) from exc
                helper.keys.add(key)
            return helper.call(fn, args, self.timeout_s)
        except SandboxError:
            healthy = False
            raise
        finally:
            self._give_back(helper, healthy)

    def _take(self) -> _Helper:
        self._forget_if_forked()
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            start = self._started < self.helpers
            if start:
                self._started += 1
        if not start:
            return self._free.get()
        try:
            return _Helper()
        except BaseException:
            with self._lock:
                self._started -= 1
            raise

    def _give_back(self, helper: _Helper, healthy: bool) -> None:
        if healthy:
            self._free.put(helper)
            return
        log.warning("grammar helper %d lost; a new one starts on the next check", helper.proc.pid)
        helper.kill()
        with self._lock:
            self._started -= 1

    def _forget_if_forked(self) -> None:
        """A forked child inherits the parent's helpers' pipes, not the helpers: it starts its
        own."""
        if self._pid != os.getpid():
            self._free = queue.SimpleQueue()
            self._started = 0
            self._pid = os.getpid()

    def close(self) -> None:
        """Stops the idle helpers (each also exits when its pipe closes with this process)."""
        if self._pid != os.getpid():
            return
        while True:
            try:
                helper = self._free.get_nowait()
            except queue.Empty:
                return
            helper.close()
            try:
                helper.proc.wait(5)
            except subprocess.TimeoutExpired:
                helper.kill()
            with self._lock:
                self._started -= 1


_sandbox: GrammarSandbox | None = None
_sandbox_lock = threading.Lock()


def sandbox() -> GrammarSandbox:
    """This process's sandbox (its helpers start on the first call)."""
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = GrammarSandbox()
            atexit.register(_sandbox.close)
        return _sandbox


# -- inside a helper ------------------------------------------------------------------------------

# The llguidance tokenizers this helper holds, by key (set by `load_tokenizer`).
_tokenizers: dict[str, Any] = {}


def load_tokenizer(key: str, tokenizer_json: str, n_vocab: int, eos_token: Any) -> None:
    """Builds llguidance's tokenizer as llguidance.hf.from_tokenizer does, from its parts."""
    from llguidance import LLTokenizer

    _tokenizers[key] = LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos_token)


def validate_grammar(key: str, grammar: str, limits: dict[str, Any]) -> tuple[bool, list[str]]:
    """llguidance's validate_grammar_with_warnings against the tokenizer `key`."""
    from llguidance import LLMatcher, LLParserLimits

    return LLMatcher.validate_grammar_with_warnings(
        grammar, _tokenizers[key], limits=LLParserLimits(**limits)
    )


def _serve(in_fd: int, out_fd: int) -> None:
    """Answer calls until the router closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is for the router
    inbox = Connection(in_fd, writable=False)
    outbox = Connection(out_fd, readable=False)
    while True:
        try:
            fn, args = inbox.recv()
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", fn(*args))
        except Exception as exc:  # the caller's to judge: sent back as its message
            reply = ("error", str(exc) or type(exc).__name__)
        outbox.send(reply)


if __name__ == "__main__":
    # The importable module's own _serve: the calls' functions resolve to that module's globals.
    from router.admission.grammar_sandbox import _serve as serve

    serve(int(sys.argv[1]), int(sys.argv[2]))
