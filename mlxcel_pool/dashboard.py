"""rq-dashboard for the pool (`mlxcel-pool dashboard`): loopback only, and it never unpickles.

rq-dashboard 0.9.0 as its own CLI starts it binds 0.0.0.0 and reads job data with pickle, so it
shows 500 on the pool's msgpack jobs and any process that can write to Redis can make it run
code. Its CLI offers no serializer but JSON, and several of its views fetch jobs without the
serializer it is configured with (the job page, a worker's current job, requeue), so they get
rq's default. `use_msgpack` therefore sets both the dashboard's serializer and the default rq
falls back to (`rq.serializers.PickleSerializer`, which `resolve_serializer` reads at each call)
to `shared.wire.MsgpackSerializer`: in this process no rq object can unpickle anything. That
default is process-wide, which is why the dashboard runs in a process of its own.

A job rq cannot load (a hand-written hash: no data, a bad date or status) made its registry
pages a 500 for every job listed with it; `tolerate_malformed_jobs` lists it as a malformed job
instead (its id, the reason, the failure the worker recorded), and its job pages say the same.

Its workers page shows a worker by its rq name alone (`mlxcel-w1`); `label_pool_workers` makes
that a pool worker's `w1 · host:pid · model`, and leaves every other rq worker as it is.

rq-dashboard is a dev dependency (`pip install -e '.[dev]'`); only this module imports it.
"""

from __future__ import annotations

import functools
import html
import logging
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
import rq.serializers
from flask import Flask, Response, current_app, jsonify, make_response
from rq import Queue, Worker
from rq.job import Job
from rq.results import Result
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
JOB_VIEWS = ("rq_dashboard.job_info", "rq_dashboard.job_view")  # a job's JSON and its page


@dataclass
class _Failure:
    exc_string: str


@dataclass
class MalformedJob:
    """What the dashboard shows for a job rq cannot load: the fields its lists read."""

    id: str
    reason: str
    failure: str | None = None  # the failure the worker recorded for it, if any
    created_at: datetime | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None

    @property
    def description(self) -> str:
        return f"malformed job: {self.reason}"

    def latest_result(self) -> _Failure:
        return _Failure(self.failure or self.description)

    @classmethod
    def read(cls, connection: redis.Redis, job_id: str, exc: BaseException) -> MalformedJob:
        """The job as far as Redis shows it, without loading it as rq would."""
        stub = Job(id=job_id, connection=connection, serializer=MsgpackSerializer)
        try:
            latest = Result.fetch_latest(stub, serializer=MsgpackSerializer)
        except redis.RedisError:
            raise
        except Exception:  # a result stream written by hand too: the reason is enough
            latest = None
        failure = latest.exc_string if latest is not None else None
        return cls(job_id, f"{type(exc).__name__}: {exc}", failure)


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


def tolerate_malformed_jobs(app: Flask) -> None:
    """A job rq cannot load is listed as a `MalformedJob` (rq-dashboard's lists fetch each job
    through `Queue.fetch_job`; process-wide, like `use_msgpack`), and its own views answer with
    the same description instead of a 500."""
    fetch = Queue.fetch_job
    if getattr(fetch, "tolerates_malformed", False):
        return

    @functools.wraps(fetch)
    def fetch_job(self: Queue, job_id: str) -> Any:
        try:
            return fetch(self, job_id)
        except redis.RedisError:
            raise
        except Exception as exc:  # rq cannot load it: a hand-written or damaged hash
            return MalformedJob.read(self.connection, job_id, exc)

    fetch_job.tolerates_malformed = True  # type: ignore[attr-defined]
    Queue.fetch_job = fetch_job  # type: ignore[method-assign]
    for name in JOB_VIEWS:
        view = app.view_functions[name]

        @functools.wraps(view)
        def shown(*args: Any, _view: Any = view, **kwargs: Any) -> Any:
            try:
                return _view(*args, **kwargs)
            except redis.RedisError:
                raise
            except Exception as exc:
                job_id = str(kwargs.get("job_id", ""))
                job = MalformedJob.read(current_app.redis_conn, job_id, exc)  # type: ignore[attr-defined]
                body = {
                    "id": job.id,
                    "status": "malformed",
                    "description": job.description,
                    "exc_info": job.latest_result().exc_string,
                }
                return jsonify(body), 200, {"Cache-Control": "no-store"}

        app.view_functions[name] = shown


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
    tolerate_malformed_jobs(app)
    return app


def serve(redis_url: str, port: int = DEFAULT_PORT) -> int:
    app = make_app(redis_url)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # as rq-dashboard: no line per request
    shown = f"http://{HOST}:{port} for {masked_url(redis_url)}"
    print(f"mlxcel-pool dashboard: {shown}", file=sys.stderr, flush=True)
    app.run(host=HOST, port=port)
    return 0
