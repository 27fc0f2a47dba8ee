"""rq-dashboard for the pool (`mlxcel-pool dashboard`): loopback only, and it never unpickles.

rq-dashboard 0.9.0 as its own CLI starts it binds 0.0.0.0 and reads job data with pickle, so it
shows 500 on the pool's msgpack jobs and any process that can write to Redis can make it run
code. Its CLI offers no serializer but JSON, and several of its views fetch jobs without the
serializer it is configured with (the job page, a worker's current job, requeue), so they get
rq's default. `use_msgpack` therefore sets both the dashboard's serializer and the default rq
falls back to (`rq.serializers.PickleSerializer`, which `resolve_serializer` reads at each call)
to `shared.wire.MsgpackSerializer`: in this process no rq object can unpickle anything. That
default is process-wide, which is why the dashboard runs in a process of its own.

rq-dashboard is a dev dependency (`pip install -e '.[dev]'`); only this module imports it.
"""

from __future__ import annotations

import logging
import sys

import rq.serializers
from flask import Flask
from rq_dashboard import web
from rq_dashboard.cli import make_flask_app

from shared.config import RedisConfig
from shared.redis_auth import masked_url
from shared.redis_clients import sync_client
from shared.wire import MsgpackSerializer

HOST = "127.0.0.1"  # it has no login and can delete and requeue jobs: never reachable from outside
DEFAULT_PORT = 9181


def use_msgpack() -> None:
    """Make msgpack the only serializer rq and rq-dashboard use in this process."""
    rq.serializers.PickleSerializer = MsgpackSerializer  # type: ignore[misc]
    rq.serializers.SERIALIZER_ALIASES["pickle"] = MsgpackSerializer
    web.config.serializer = MsgpackSerializer  # type: ignore[assignment]


def use_pool_client(redis_url: str) -> None:
    """Make the pool's own client (shared.redis_clients) the one connection rq-dashboard uses:
    it opens one per request from its URL with a parser of its own (`redis-sentinel-url`), which
    knows no sentinel password and no stall bound. Process-wide, like `use_msgpack`."""
    client = sync_client(RedisConfig(url=redis_url))
    web.from_url = lambda *_args, **_kwargs: (None, client)


def make_app(redis_url: str) -> Flask:
    """rq-dashboard's Flask app against `redis_url` (its pages show it with the password
    masked)."""
    use_msgpack()
    use_pool_client(redis_url)
    app = make_flask_app(config=None, username=None, password=None, url_prefix="")
    app.config["RQ_DASHBOARD_REDIS_URL"] = masked_url(redis_url)  # shown, never connected to
    app.config["DEPRECATED_OPTIONS"] = []
    web.setup_rq_connection(app)
    return app


def serve(redis_url: str, port: int = DEFAULT_PORT) -> int:
    app = make_app(redis_url)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # as rq-dashboard: no line per request
    shown = f"http://{HOST}:{port} for {masked_url(redis_url)}"
    print(f"mlxcel-pool dashboard: {shown}", file=sys.stderr, flush=True)
    app.run(host=HOST, port=port)
    return 0
