"""docs/deployment.md's "Several hosts, step by step", run as written on five simulated hosts.

Each host is a network namespace with its own hostname and its own /etc/mlxcel and cache dir
(tests/drivers/netns.py); the section's shell blocks run literally on the host their step names,
with only `<redis-ip>` and `<router-ip>` filled in, the guide's `scp` done as a copy, and the
second worker host's `--worker-prefix` as the guide says. So a step the guide leaves out, a flag
it spells wrong or a file it forgets to copy fails here. Then what a multi-host pool must survive:
requests from the client host served by both worker hosts alike, a worker SIGKILLed (its host's
`up --join` starts it again and Redis counts the restart), and a worker host's cable pulled for
longer than the pool waits (its request ends, the host comes back, `rq info` lists it again).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.drivers.netns import NetnsLab, lab_available

pytestmark = pytest.mark.pool

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "deployment.md"
SECTION = "## Several hosts, step by step"
HOSTS = ("redis", "router", "worker1", "worker2", "client")
# Which host a step's blocks run on, by the words its bold heading starts with.
STEP_HOSTS = {
    "**1. The Redis host": "redis",
    "**2. The router host": "router",
    "**3. Each worker host": "worker",
    "**4. The client": "client",
    "**The dashboard.": "router",
}
SERVING = ("mlxcel-pool redis ", "mlxcel-pool router ", "mlxcel-pool up ", "mlxcel-pool dashboard ")
MODEL = "mlxcel-tiny-s0"


@dataclass
class Block:
    host: str
    script: str

    @property
    def serves(self) -> bool:
        return self.script.strip().splitlines()[-1].startswith(SERVING)


def guide_blocks() -> list[Block]:
    """The section's ```sh blocks, each with the host its step names."""
    text = GUIDE.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    host, blocks, lines = "", [], text[start:end].splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        for marker, name in STEP_HOSTS.items():
            if line.startswith(marker):
                host = name
        if line.startswith("### "):
            break  # the subsections after the steps hold no step
        if line.strip() == "```sh":
            body = []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            assert host, f"a shell block before any step: {body}"
            blocks.append(Block(host, "\n".join(body)))
        i += 1
    return blocks


class Deployment:
    def __init__(self, lab: NetnsLab, root: Path) -> None:
        self.lab = lab
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.serving: dict[str, subprocess.Popen[bytes]] = {}

    def env(self, host: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLXCEL_", "REDIS_URL"))}
        env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"
        env["MLXCEL_CACHE_DIR"] = str(self.root / host / "cache")  # a fresh host's own disk
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def fill(self, script: str) -> str:
        return script.replace("<redis-ip>", self.lab.addr("redis")).replace(
            "<router-ip>", self.lab.addr("router")
        )

    def run_block(self, host: str, script: str, name: str) -> None:
        argv = ["bash", "-euo", "pipefail", "-c", self.fill(script)]
        if Block(host, script).serves:
            self.serving[name] = self.lab.popen(
                host, argv, env=self.env(host), log=self.logs / f"{name}.log"
            )
            return
        res = self.lab.run(host, argv, env=self.env(host), timeout=120)
        assert res.returncode == 0, f"{name} on {host} failed:\n{script}\n{res.stderr[-3000:]}"

    def sh(self, host: str, script: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.lab.run(host, ["bash", "-c", script], env=self.env(host), timeout=timeout)

    def py(self, host: str, code: str, timeout: float = 120) -> Any:
        """Run `code` on `host` with the pool's REDIS_URL loaded; its last stdout line as JSON."""
        script = f"set -a; . /etc/mlxcel/pool.env; set +a; exec python -c {shlex.quote(code)}"
        res = self.sh(host, script, timeout)
        assert res.returncode == 0, f"on {host}:\n{code}\n{res.stderr[-3000:]}"
        return json.loads(res.stdout.strip().splitlines()[-1])

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, what: str, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            for name, proc in self.serving.items():
                assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{self.log(name)}"
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}\n{self.log(n)[-2500:]}" for n in self.serving)
                raise AssertionError(f"timed out waiting for {what}\n{tails}")
            time.sleep(0.5)


def _health(dep: Deployment) -> dict[str, Any]:
    res = dep.sh("client", f"curl -s http://{dep.lab.addr('router')}:8000/health")
    try:
        return dict(json.loads(res.stdout))
    except ValueError:
        return {}


# The client's requests, from its own host: (worker header, text or error) per request.
CLIENT_CODE = """
import concurrent.futures, json, sys, httpx
url, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
def one(prompt):
    body = {"model": "MODEL_ID", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    out = r.json()
    if r.status_code != 200:
        return [r.headers.get("x-mlxcel-worker", ""), None, out["error"]["code"]]
    return [r.headers.get("x-mlxcel-worker", ""), out["choices"][0]["text"], None]
with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
    print(json.dumps(list(ex.map(one, prompts))))
""".replace("MODEL_ID", MODEL)


def client_requests(dep: Deployment, prompts: list[str], max_tokens: int = 12) -> list[Any]:
    url = f"http://{dep.lab.addr('router')}:8000"
    argv = [sys.executable, "-c", CLIENT_CODE, url, json.dumps(prompts), str(max_tokens)]
    res = dep.lab.run("client", argv, env=dep.env("client"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return list(json.loads(res.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    why = lab_available()
    assert why is None, f"this test simulates hosts with network namespaces: {why}"
    root = tmp_path_factory.mktemp("hosts")
    with NetnsLab(HOSTS, net=78, hostnames=True, private_dirs=["/etc/mlxcel"], root=root) as lab:
        dep = Deployment(lab, root)
        blocks = guide_blocks()
        hosts_in_order = [b.host for b in blocks]
        assert hosts_in_order[:2] == ["redis", "redis"], hosts_in_order
        assert {"router", "worker", "client"} <= set(hosts_in_order), hosts_in_order
        for n, block in enumerate(blocks):
            if block.host == "client":
                continue  # run by the test below, once the pool is up
            if block.host == "worker":
                dep.run_block("worker1", block.script, f"worker1-{n}")
                second = block.script.replace(
                    "--worker-prefix worker1-w", "--worker-prefix worker2-w"
                )
                assert second != block.script, "the guide names the second host's prefix"
                dep.run_block("worker2", second, f"worker2-{n}")
                continue
            dep.run_block(block.host, block.script, f"{block.host}-{n}")
            if block.host == "redis" and not block.serves:
                # The guide's scp: the URL file and the CA to the same paths on the other hosts.
                etc = dep.lab.host_dir("redis", "/etc/mlxcel")
                for host in ("router", "worker1", "worker2"):
                    for name in ("pool.env", "redis-ca.crt"):
                        dest = dep.lab.host_dir(host, "/etc/mlxcel") / name
                        dest.write_bytes((etc / name).read_bytes())
                        dest.chmod((etc / name).stat().st_mode)
            if block.host == "redis" and block.serves:
                dep.wait(
                    "the Redis host's password file",
                    lambda: (root / "redis" / "cache" / "redis.password").exists(),
                    30,
                )
        dep.wait("both workers registered", lambda: _health(dep).get("workers_alive") == 2, 240)
        yield dep


def test_the_guides_client_step_works(deployment: Deployment) -> None:
    dep = deployment
    client = [b for b in guide_blocks() if b.host == "client"]
    assert len(client) == 1
    outputs = []
    for line in client[0].script.splitlines():
        res = dep.sh("client", dep.fill(line))
        assert res.returncode == 0, res.stderr
        outputs.append(json.loads(res.stdout))
    health, completion = outputs
    assert health["status"] == "ok" and health["workers_alive"] == 2
    assert completion["choices"][0]["text"]
    assert completion["usage"]["completion_tokens"] == 16
    # Both worker hosts are named in /health by their own hostnames.
    assert {w["host"] for w in health["workers"]} == {"worker1", "worker2"}, health


def test_every_host_serves_alike_and_the_password_and_tls_are_real(deployment: Deployment) -> None:
    dep = deployment
    prompts = [f"Request number {i} asks about the sea and" for i in range(8)]
    answers = client_requests(dep, prompts + prompts)
    workers = {w for w, _, _ in answers}
    assert workers == {"worker1-w1", "worker2-w1"}, answers  # both hosts took requests
    assert all(err is None for _, _, err in answers), answers
    # Greedy on the same seeded model: each prompt's text is the same whichever host ran it.
    for i in range(len(prompts)):
        assert answers[i][1] == answers[i + len(prompts)][1], (answers[i], answers[i + 8])
    # The URL the guide wrote is TLS with the pool's password; without them Redis says no.
    url = dep.py("router", "import os, json; print(json.dumps(os.environ['REDIS_URL']))")
    assert url.startswith("rediss://mlxcel:") and "ssl_ca_certs=/etc/mlxcel/redis-ca.crt" in url
    plain = re.sub(r"^rediss://mlxcel:[^@]*@", "redis://", url).split("?")[0]
    refused = dep.sh(
        "router", f"python -c \"import redis; redis.Redis.from_url('{plain}').ping()\""
    )
    assert refused.returncode != 0


def test_a_killed_worker_comes_back_and_its_restart_is_counted(deployment: Deployment) -> None:
    dep = deployment
    info = dep.py(
        "router",
        "import json, os, redis\n"
        "r = redis.Redis.from_url(os.environ['REDIS_URL'], decode_responses=True)\n"
        "print(json.dumps(r.hgetall('mlxcel:worker:worker1-w1:info')))",
    )
    assert info["host"] == "worker1"
    os.kill(int(info["pid"]), signal.SIGKILL)
    answers = client_requests(dep, [f"While one worker restarts, request {i}" for i in range(4)])
    assert all(text for _, text, _ in answers), answers  # served by the other host meanwhile

    def restarted() -> bool:
        now = dep.py(
            "router",
            "import json, os, redis\n"
            "r = redis.Redis.from_url(os.environ['REDIS_URL'], decode_responses=True)\n"
            "print(json.dumps([r.hget('mlxcel:worker:worker1-w1:info', 'pid'),"
            " r.hget('mlxcel:supervisor:restarts', 'worker1-w1')]))",
        )
        return now[0] not in (None, info["pid"]) and now[1] == "1"

    dep.wait("worker1-w1 started again by its host's up --join", restarted, 120)
    metrics = dep.sh("client", f"curl -s http://{dep.lab.addr('router')}:8000/metrics").stdout
    assert 'mlxcel_worker_restarts_total{worker="worker1-w1"} 1.0' in metrics
    dep.wait("both workers alive", lambda: _health(dep).get("workers_alive") == 2, 60)


# Long streamed requests from the client's host, side by side: per request its status, the
# worker that ran it, content chunks, the error code of an error chunk and the finish reason.
LONG_CODE = """
import concurrent.futures, json, sys, httpx
url, n = sys.argv[1], int(sys.argv[2])
def one(i):
    body = {"model": "MODEL_ID", "prompt": f"Story {i}: a voyage across the sea", "stream": True,
            "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    chunks, err, fin = 0, None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as r:
        worker = r.headers.get("x-mlxcel-worker", "")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                err = event["error"].get("code")
            for c in event.get("choices") or []:
                chunks += bool(c.get("text"))
                fin = c.get("finish_reason") or fin
        if r.status_code != 200:
            r.read()
            err = r.text[:300]
    return [r.status_code, worker, chunks, err, fin]
with concurrent.futures.ThreadPoolExecutor(n) as ex:
    print(json.dumps(list(ex.map(one, range(n)))))
""".replace("MODEL_ID", MODEL)


def test_a_worker_host_off_the_network_comes_back(deployment: Deployment) -> None:
    dep = deployment
    url = f"http://{dep.lab.addr('router')}:8000"
    # Long requests on both worker hosts, then worker2's cable pulled past the pool's patience.
    proc = dep.lab.popen(
        "client", [sys.executable, "-c", LONG_CODE, url, "4"], env=dep.env("client"),
        log=dep.logs / "long-requests.log",
    )  # fmt: skip
    time.sleep(3)
    dep.lab.link_down("worker2")
    time.sleep(12)
    during = client_requests(dep, [f"With worker2 away, request {i}" for i in range(3)])
    assert all(w == "worker1-w1" and text for w, text, _ in during), during
    dep.lab.link_up("worker2")
    assert proc.wait(180) == 0, dep.log("long-requests")
    runs = json.loads(dep.log("long-requests").strip().splitlines()[-1])
    assert {w for _, w, _, _, _ in runs} == {"worker1-w1", "worker2-w1"}, runs
    for status, worker, chunks, err, fin in runs:
        assert status == 200 and chunks > 0, runs
        if worker == "worker1-w1":
            assert (err, fin) == (None, "length"), runs
        else:  # its tokens had reached the client: the stream ends with the pool's verdict
            assert (err, fin) == ("worker_lost", None), runs
    dep.wait("worker2 back", lambda: _health(dep).get("workers_alive") == 2, 90)
    listed = dep.sh(
        "router",
        'set -a; . /etc/mlxcel/pool.env; set +a; rq info --url "$REDIS_URL" --raw',
    )
    assert "worker2-w1" in listed.stdout and "worker1-w1" in listed.stdout, listed.stdout
    after = client_requests(dep, [f"After the link came back, request {i}" for i in range(8)])
    assert {w for w, _, _ in after} == {"worker1-w1", "worker2-w1"}, after
    # What the worker said of its absence: the truth, not a Redis restart.
    logs = "".join(dep.log(n) for n in dep.serving if n.startswith("worker2"))
    assert "cut off from Redis" in logs and "Redis restart or flush" not in logs, logs[-3000:]
