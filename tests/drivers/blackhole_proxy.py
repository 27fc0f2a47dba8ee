"""A TCP proxy whose link can be pulled like a cable: `cut()` stops forwarding both ways while
every socket stays open (no FIN, no RST: the peers' calls just wait, as over a dead network),
`restore()` forwards again, and what was held on either side is delivered late, as TCP's
retransmissions would deliver it once the link is back.

A connection opened during a cut is accepted and held: its first bytes wait like any other.

`drop_reply(marker)` loses one reply: the next command whose bytes hold `marker` reaches the
server, and its reply is dropped with the connection (closed both ways): a command the server
applied whose client never heard so, as when a link fails between the two.

usage (in a test): `with BlackholeProxy("127.0.0.1", 6379) as proxy: ... proxy.cut() ...`
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

CHUNK = 65536


class BlackholeProxy:
    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server((host, 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._open = threading.Event()  # set: the link forwards
        self._open.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._drop_marker: bytes | None = None  # the command whose reply drop_reply loses
        self.replies_dropped = 0  # how many replies drop_reply has lost so far

    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    def start(self) -> BlackholeProxy:
        self._spawn(self._accept_loop, "proxy-accept")
        return self

    def cut(self) -> None:
        """Stop forwarding in both directions; sockets stay open."""
        self._open.clear()

    def restore(self) -> None:
        """Forward again, starting with what was held."""
        self._open.set()

    def drop_reply(self, marker: bytes) -> None:
        """Lose the reply to the next command holding `marker` (see the module's doc)."""
        self._drop_marker = marker

    def stop(self) -> None:
        self._closed.set()
        self._open.set()  # wake every pump so it sees the close
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            thread.join(timeout=2)

    def __enter__(self) -> BlackholeProxy:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _spawn(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._spawn(self._connect, "proxy-connect", client)

    def _connect(self, client: socket.socket) -> None:
        self._track(client)
        self._open.wait()  # a connection opened during a cut reaches nothing until restored
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        self._track(server)
        # Set (by the pump up, before it forwards the marked command): the pump down drops the
        # next reply and the connection.
        dropping = threading.Event()
        self._spawn(self._pump, "proxy-up", client, server, dropping, True)
        self._spawn(self._pump, "proxy-down", server, client, dropping, False)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _pump(
        self, src: socket.socket, dst: socket.socket, dropping: threading.Event, up: bool
    ) -> None:
        """Copy src to dst. Cut: read nothing more, and hold what was read, until restored."""
        try:
            while True:
                self._open.wait()
                data = src.recv(CHUNK)
                if not data or self._closed.is_set():
                    break
                self._open.wait()
                if self._closed.is_set():
                    break
                marker = self._drop_marker
                if up and marker is not None and marker in data:
                    self._drop_marker = None
                    dropping.set()
                if not up and dropping.is_set():
                    self.replies_dropped += 1
                    break  # the reply is lost with the connection (closed below)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # One side closed (never during a cut: a cut closes nothing): close the other.
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
