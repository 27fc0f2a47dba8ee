"""rq-dashboard for the pool (`mlxcel-pool dashboard`): loopback only, and it never unpickles.

rq-dashboard 0.9.0 as its own CLI starts it binds 0.0.0.0 and reads job data with pickle, so it
shows 500 on the pool's msgpack jobs and any process that can write to Redis can make it run
code. Its CLI offers no serializer but JSON, and several of its views fetch jobs without the
serializer it is configured with (the job page, a worker's current job, requeue), so they get
rq's default. `use_msgpack` therefore sets both the dashboard's serializer and the default rq
falls back to (`rq.serializers.PickleSerializer`, which `resolve_serializer` reads at each call)
to `shared.wire.MsgpackSerializer`: in this process no rq object can unpickle anything. That
default is process-wide, which is why the dashboard runs in a process of its own.

Its workers page shows a worker by its rq name alone (`mlxcel-w1`); `label_pool_workers` makes
that a pool worker's `w1 · host:pid · model`, and leaves every other rq worker as it is.

rq-dashboard is a dev dependency (`pip install -e '.[dev]'`); only this module imports it.
"""

from __future__ import annotations

import functools
import html
import logging
import sys
from typing import Any

import redis
import rq.serializers
from flask import Flask, Response, current_app, make_response
from rq import Worker
from rq_dashboard import web
from rq_dashboard.cli import make_flask_app

from shared import keys
from shared.config import RedisConfig
from shared.redis_auth import masked_url
from shared.redis_clients import sync_client
from shared.wire import MsgpackSerializer

HOST = "127.0.0.1"  # it has no login and can delete and requeue jobs: never reachable from outside
DEFAULT_PORT = 9181
WORKERS_VIEW = "rq_dashboard.list_workers"  # `/<instance>/data/workers.json`, what the page lists


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


def worker_label(worker_id: str, hostname: str | None, pid: int | None, model: str | None) -> str:
    """What the workers page shows for a pool worker: `w1 · host:pid · model` ("?" for a part
    Redis no longer has; the model goes with the info hash, when the worker stops or dies).
    HTML-escaped: the page's template inserts the name as HTML."""
    shown = f"{worker_id} · {hostname or '?'}:{pid or '?'} · {model or '?'}"
    return html.escape(shown)


def label_workers(r: redis.Redis, workers: list[dict[str, Any]]) -> None:
    """Rename the pool's workers in rq-dashboard's workers list, in place: host from rq's worker
    record (rq's `Worker.hostname`; the list has its pid already), model from the worker's info
    hash, both read in one pipeline. The rq name moves to `rq_name`; other workers are left."""
    pool = [(w, wid) for w in workers if (wid := keys.parse_rq_worker_name(w["name"])) is not None]
    if not pool:
        return
    with r.pipeline(transaction=False) as pipe:
        for w, wid in pool:
            pipe.hget(Worker.redis_worker_namespace_prefix + w["name"], "hostname")  # Worker.key
            pipe.hget(keys.worker_info(wid), "model")
        replies = [v.decode() if isinstance(v, bytes) else v for v in pipe.execute()]
    for (w, wid), hostname, model in zip(pool, replies[::2], replies[1::2], strict=True):
        w["rq_name"] = w["name"]
        w["name"] = worker_label(wid, hostname, w.get("pid"), model)


def label_pool_workers(app: Flask) -> None:
    """Wrap rq-dashboard's workers list (its only view that names workers on the page) with
    `label_workers`; the view itself, its order and its other fields stay rq-dashboard's."""
    listed = app.view_functions[WORKERS_VIEW]

    @functools.wraps(listed)
    def list_workers(instance_number: int) -> Response:
        response = make_response(listed(instance_number))
        body = response.get_json(silent=True)
        if isinstance(body, dict) and isinstance(body.get("workers"), list):
            label_workers(current_app.redis_conn, body["workers"])  # type: ignore[attr-defined]
            response.set_data(current_app.json.dumps(body))
        return response

    app.view_functions[WORKERS_VIEW] = list_workers


def make_app(redis_url: str) -> Flask:
    """rq-dashboard's Flask app against `redis_url` (its pages show it with the password
    masked)."""
    use_msgpack()
    use_pool_client(redis_url)
    app = make_flask_app(config=None, username=None, password=None, url_prefix="")
    app.config["RQ_DASHBOARD_REDIS_URL"] = masked_url(redis_url)  # shown, never connected to
    app.config["DEPRECATED_OPTIONS"] = []
    web.setup_rq_connection(app)
    label_pool_workers(app)
    return app


def serve(redis_url: str, port: int = DEFAULT_PORT) -> int:
    app = make_app(redis_url)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # as rq-dashboard: no line per request
    shown = f"http://{HOST}:{port} for {masked_url(redis_url)}"
    print(f"mlxcel-pool dashboard: {shown}", file=sys.stderr, flush=True)
    app.run(host=HOST, port=port)
    return 0
