"""What a loopback TCP send costs its sender on this machine, and how much more when it wakes the
process that reads it: the floor under every relayed write (the router's to its client, each
command batch's to Redis, the worker's step to Redis), whatever Python does around it.

A reader process blocks in recv; this process sends it 1,000-byte messages, back to back (the
reader stays awake), then with the sender spinning between sends so the reader sleeps and each
send wakes it (the sender never sleeps itself, so its own wake-up is not counted). The sender's
CPU a send is the median of `time.thread_time()` around each `send`: on a VM whose cross-core
wake-up is an exit to the hypervisor, the waking send costs several times the back-to-back one.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time

MESSAGE = b"x" * 1000
# The reader: connect, read until the sender closes.
READER = """
import socket, sys
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
while c.recv(65536):
    pass
"""


def _sends(conn: socket.socket, count: int, gap_s: float) -> float:
    """The median sender CPU of `count` sends, in us, each after spinning `gap_s`."""
    costs = []
    for _ in range(count):
        if gap_s:
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:
                pass
        before = time.thread_time()
        conn.sendall(MESSAGE)
        costs.append(time.thread_time() - before)
    return statistics.median(costs) * 1e6


def send_costs_us() -> tuple[float, float, float]:
    """(back to back, waking a reader asleep 0.3 ms, waking one asleep 2 ms): the sender's CPU
    a loopback send, in us (about a second in all)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        reader = subprocess.Popen([sys.executable, "-c", READER, str(port)])
        try:
            server.settimeout(30)  # a reader that never connects fails the probe, not hangs it
            conn, _ = server.accept()
            conn.settimeout(None)
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _sends(conn, 200, 0.0)  # warm
                costs = (
                    _sends(conn, 1000, 0.0),
                    _sends(conn, 1000, 0.0003),
                    _sends(conn, 250, 0.002),
                )
        finally:
            try:
                reader.wait(timeout=10)
            except subprocess.TimeoutExpired:
                reader.kill()
                reader.wait()
    return costs


def wake_cost_line() -> str:
    """The machine's loopback send costs as one header line."""
    back, woken, asleep = send_costs_us()
    return (
        f"loopback send: {back:.1f} us of the sender's CPU back to back, {woken:.1f} us waking "
        f"a reader asleep 0.3 ms, {asleep:.1f} us one asleep 2 ms"
    )


if __name__ == "__main__":
    print(wake_cost_line())
