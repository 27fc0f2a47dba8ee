"""Simulated hosts on one machine: Linux network namespaces joined by veth pairs to a bridge.

`NetnsLab(["redis", "router", "w1", "client"])` makes one namespace per host (`<tag>-<host>`, with
its own loopback and one interface at 10.<net>.0.<n>/24) and a switch namespace holding the
bridge, so nothing is added to the machine's own namespace and no address outside the lab's
subnet is used. Leaving the `with` block (an exception or a signal included) kills every process
the lab started and deletes its namespaces, which removes their interfaces with them.

Needs root (`ip netns`). `link_down(host)` / `link_up(host)` pull and plug a host's cable (its
bridge port goes down: packets vanish, sockets stay open), as a network loss does.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any


class LabError(RuntimeError):
    pass


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {res.stderr.strip()}")


def lab_available() -> str | None:
    """Why a lab cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return f"`ip netns` is unavailable: {res.stderr.strip()}"
    return None


@dataclass
class NetnsLab:
    hosts: Sequence[str]
    net: int = 77  # the lab's subnet: 10.<net>.0.0/24
    tag: str = field(default_factory=lambda: f"mxl{os.getpid() % 100000}")
    hostnames: bool = False  # each host's processes see its name as their hostname
    # Directories each host has a copy of its own (a bind mount of `<root>/<host>/<path>` in a
    # mount namespace per process), as separate machines have their own /etc.
    private_dirs: Sequence[str] = ()
    root: Path | None = None  # where the hosts' own copies live (needed with private_dirs)
    _mountpoints: list[Path] = field(default_factory=list)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)
    _previous_handlers: dict[int, Any] = field(default_factory=dict)

    # --- names -------------------------------------------------------------------------------

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def addr(self, host: str) -> str:
        return f"10.{self.net}.0.{list(self.hosts).index(host) + 1}"

    def _port(self, host: str) -> str:
        # Interface names are at most 15 characters: the tag and the host's index.
        return f"{self.tag}p{list(self.hosts).index(host)}"

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> NetnsLab:
        why = lab_available()
        if why:
            raise LabError(why)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            for path in self.private_dirs:
                mountpoint = Path(path)
                if not mountpoint.exists():  # made for the lab, removed with it
                    mountpoint.mkdir(parents=True)
                    self._mountpoints.append(mountpoint)
                for host in self.hosts:
                    self.host_dir(host, path).mkdir(parents=True, exist_ok=True)
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)  # unwinds through __exit__

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")
        for host in self.hosts:
            ns, port = self.ns(host), self._port(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port)
            _ip("-n", ns, "link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        # The bridge forwards once its ports are up: wait until one host reaches another.
        first, last = self.hosts[0], self.hosts[-1]
        probe = (
            "import socket, sys, time\n"
            "deadline = time.monotonic() + 10\n"
            "while True:\n"
            "    try:\n"
            f"        socket.create_connection(({self.addr(last)!r}, 9), timeout=0.5)\n"
            "    except ConnectionRefusedError:\n"
            "        sys.exit(0)  # a RST from the far host: the path works\n"
            "    except OSError:\n"
            "        if time.monotonic() > deadline:\n"
            "            sys.exit(1)\n"
            "        time.sleep(0.1)\n"
        )
        if self.run(first, [sys.executable, "-c", probe], timeout=15).returncode != 0:
            raise LabError(f"{first} cannot reach {last} through the lab's bridge")

    def close(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._procs.clear()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._made.clear()
        for mountpoint in self._mountpoints:
            with contextlib.suppress(OSError):
                mountpoint.rmdir()  # only if still empty: the hosts wrote into their own copies
        self._mountpoints.clear()
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    # --- processes and links -----------------------------------------------------------------

    def _argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` inside `host`'s network namespace and, with `hostnames`, in a UTS namespace of
        its own named `host` (so each simulated host has its own `hostname`)."""
        inner = list(argv)
        if self.hostnames or self.private_dirs:
            script = ['hostname "$0"'] if self.hostnames else []
            for path in self.private_dirs:
                script.append(f"mount --bind {shlex.quote(str(self.host_dir(host, path)))} {path}")
            script.append('exec "$@"')
            flags = ["--uts"] if self.hostnames else []
            flags += ["--mount"] if self.private_dirs else []
            inner = ["unshare", *flags, "sh", "-c", " && ".join(script), host, *inner]
        return ["ip", "netns", "exec", self.ns(host), *inner]

    def host_dir(self, host: str, path: str) -> Path:
        """`host`'s own copy of the private directory `path`, as seen from outside the lab."""
        if self.root is None:
            raise LabError("private_dirs need a root")
        return self.root / host / path.lstrip("/")

    def popen(
        self,
        host: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on `host` (its own process group); output to `log` (default: dropped)."""
        out: IO[bytes] | int = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                self._argv(host, argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()
        self._procs.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._argv(host, argv),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def stop(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            return proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    def link_down(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port(host), "down")

    def link_up(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port(host), "up")


PROXY_SOURCE = Path(__file__).with_name("delay_proxy.c")


def build_delay_proxy(out_dir: Path) -> Path:
    """Compile tests/drivers/delay_proxy.c into `out_dir` (again only when the source changed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    binary = out_dir / "delay_proxy"
    if not binary.exists() or binary.stat().st_mtime < PROXY_SOURCE.stat().st_mtime:
        cmd = ["gcc", "-O2", "-pthread", "-o", str(binary), str(PROXY_SOURCE)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise LabError(f"building the delay proxy failed: {res.stderr.strip()}")
    return binary


@dataclass
class DelayProxy:
    """A delay proxy on `host` from `listen` to `target`; `set_rtt_ms` changes its round trip
    (half of it each way) for every connection, open ones included, within 0.2 s."""

    lab: NetnsLab
    host: str
    listen: tuple[str, int]
    target: tuple[str, int]
    work_dir: Path

    def __post_init__(self) -> None:
        binary = build_delay_proxy(self.work_dir)
        self.delay_file = self.work_dir / f"delay-{self.host}-{self.listen[1]}"
        self.delay_file.write_text("0")
        argv = [str(binary), *map(str, (*self.listen, *self.target)), str(self.delay_file)]
        self.proc = self.lab.popen(self.host, argv, log=self.delay_file.with_suffix(".log"))

    def set_rtt_ms(self, rtt_ms: float) -> None:
        self.delay_file.write_text(f"{rtt_ms / 2:g}")
        time.sleep(0.5)  # the proxy re-reads the file every 0.2 s
