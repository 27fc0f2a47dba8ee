"""Every Redis key the pool writes, built in one place (docs/redis-keys.md is checked against it).

rq owns its own keys (`rq:queue:<name>`, `rq:job:<id>`, registries, `rq:worker:<name>`); we only
choose the queue and worker names. Everything else lives under one prefix, `mlxcel:`.

| key | type | owner | TTL |
|---|---|---|---|
| `mlxcel:req:<req_id>:stream` | stream | worker writes, router reads | REQUEST_TTL_S |
| `mlxcel:req:<req_id>:cancel` | string | router writes, worker reads | REQUEST_TTL_S |
| `mlxcel:workers` | set | worker adds itself | none (the pool's roster: totals outlive workers) |
| `mlxcel:worker:<wid>:info` | hash | worker: identity, settings, gauges | LIVENESS_TTL_S |
| `mlxcel:worker:<wid>:alive` | string | worker: its epoch while it counts as alive | DEAD_AFTER_S |
| `mlxcel:worker:<wid>:cache:counters` | hash | worker: counters, last reject | none |

The info hash's TTL is the worker's liveness; the counters never expire, so counts never go
backwards and a dead worker still counts.

Two hashes per worker on purpose: the pool-wide stats read touches each worker twice, in one Lua
script (Redis time there grows with the number of calls).
| `mlxcel:worker:<wid>:control` | list | router pushes, worker pops | CONTROL_TTL_S |
| `mlxcel:worker:<wid>:reaped` | string | the worker that failed a dead one's jobs | REAPED_TTL_S |
| `mlxcel:control:<reply_id>:reply` | list | worker pushes, router pops | CONTROL_TTL_S |
| `mlxcel:router:<hub_id>:wake` | stream | one router process (its stream hub) | REQUEST_TTL_S |
| `mlxcel:router:<hub_id>:push` | channel | workers publish, one router reads | not a key |
| `mlxcel:admission:inflight` | zset | routers: admission ledger | none: members lapse by score |
| `mlxcel:admission:queued` | hash | routers: unstarted prompt tokens | none: goes with members |
| `mlxcel:worker:<wid>:blocks:<epoch>` | set | worker: its cache's block hashes | LIVENESS_TTL_S |
| `mlxcel:worker:<wid>:routed` | zset | routers: blocks routed there, prefilling | ROUTED_TTL_S |
| `mlxcel:worker:<wid>:load` | zset | routers: requests placed there | ROUTED_TTL_S |
| `mlxcel:worker:<wid>:prefill` | hash | routers: unstarted requests' tokens | ROUTED_TTL_S |
| `mlxcel:routing:stats` | hash | routers: decisions, predicted vs reused tokens | none |
| `mlxcel:routing:placed` | hash | routers: the worker each request counts on | none |
| `mlxcel:routing:load` | hash | routers: each worker's requests and queued tokens | none |
| `mlxcel:routing:first:<block>` | zset | routers: workers a first block went to | ROUTED_TTL_S |
| `mlxcel:routing:holders:<block>` | set | workers: those holding a first block | HOLDERS_TTL_S |
| `mlxcel:routing:facts` | hash | routers: each worker's model and cache settings | none |
| `mlxcel:routing:live:<model>` | string | routers: live workers, as last read | LIVE_CACHE_MS |
| `mlxcel:supervisor:restarts` | hash | supervisors: worker id -> restarts | none: counters |
| `mlxcel:routing:canary` | hash | routers and workers: model id -> canary hash | none |
| `mlxcel:routing:rr` | string | routers: the round-robin cursor | none |
| `mlxcel:response:<response_id>:state` | string | routers: a stored response | responses_ttl_s |

The block index is fenced by the worker's epoch (new at every process start, in its info hash):
a restarted or zombie process writes under an epoch nobody reads, and its keys lapse.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "mlxcel"

# Per-request keys expire even when a client or a worker vanishes mid-request.
REQUEST_TTL_S = 600
# A worker's info hash lives this long past its last heartbeat; the TTL left is the heartbeat's
# age, which shared.liveness judges (dead long before the hash expires).
LIVENESS_TTL_S = 15
HEARTBEAT_INTERVAL_S = 1.0
CONTROL_TTL_S = 60
# A worker's last take is kept this long: past any sending again of it (the Redis client tries a
# dropped connection's command a few times within a second or two).
TAKE_TTL_S = 60
# A dead worker's reaped claim outlives any restart delay; the worker clears it when it starts.
REAPED_TTL_S = 3600
# A job no router would have written (rq cannot load it, or its payload does not decode) is kept
# this long once failed (its hash, result and failed-registry entry), not rq's year.
MALFORMED_JOB_TTL_S = 600

# rq's records of a job: a finished one's result, a failed one's (when its job names no
# failure_ttl; rq's own default is a year), and how long a job may wait queued.
JOB_RESULT_TTL_S = 600
JOB_FAILURE_TTL_S = 3600
JOB_QUEUED_TTL_S = 600

# A placed request's routed blocks and load entry lapse this long after their router last
# refreshed them (a crashed router's placements free themselves).
ROUTED_TTL_S = 30
# A first block's holders set lives this long past the last worker that listed itself there or
# the last placement that found a holder in it: the entries of a worker's earlier life lapse.
HOLDERS_TTL_S = 86_400
# A model's live workers, as a decision last read them, serve the decisions this soon after: a
# decision then reads the roster's size, every worker's load, and the liveness of only the
# workers whose epoch it uses or that it chooses (all again when one fails), instead of every
# worker's alive key and facts.
LIVE_CACHE_MS = 250

# rq queue names (rq builds `rq:queue:<name>` itself).
QUEUE_PREFIX = "mlxcel"


def worker_queue_name(worker_id: str) -> str:
    """Per-worker rq queue (routing places work here; the worker listens on it first)."""
    return f"{QUEUE_PREFIX}.worker.{worker_id}"


def model_queue_name(model_id: str) -> str:
    """A model's shared rq queue, read by every worker of the model after its own: requests
    wait here while no worker of the model is live, and a request whose worker died runs again
    from here."""
    return f"{QUEUE_PREFIX}.model.{model_id}"


_RQ_WORKER_PREFIX = "mlxcel-"


# rq's own prefix of a queue's key (rq.Queue.redis_queue_namespace_prefix; a test pins it).
RQ_QUEUE_PREFIX = "rq:queue:"


def rq_queue_key(queue_name: str) -> str:
    """rq's list of the job ids waiting in a queue (what `rq.Queue(name).key` is)."""
    return RQ_QUEUE_PREFIX + queue_name


def rq_intermediate_key(queue_name: str) -> str:
    """rq's list of a queue's jobs taken but not yet started (rq's dequeue of one queue moves a
    job there: what `rq.Queue(name).intermediate_queue_key` is)."""
    return f"{RQ_QUEUE_PREFIX}{queue_name}:intermediate"


def rq_worker_name(worker_id: str) -> str:
    """The name the worker registers under in rq (`rq info`, rq-dashboard)."""
    return f"{_RQ_WORKER_PREFIX}{worker_id}"


def parse_rq_worker_name(name: str) -> str | None:
    """The worker id back from its rq name (a job's `worker_name`); None for another worker."""
    return name[len(_RQ_WORKER_PREFIX) :] if name.startswith(_RQ_WORKER_PREFIX) else None


def request_stream(req_id: str) -> str:
    return f"{PREFIX}:req:{req_id}:stream"


def request_cancel(req_id: str) -> str:
    return f"{PREFIX}:req:{req_id}:cancel"


def workers_roster() -> str:
    return f"{PREFIX}:workers"


def worker_info(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:info"


def worker_alive(worker_id: str) -> str:
    """The worker's epoch, written with every refresh of its info hash's TTL and living as long
    as the worker counts as alive (shared.liveness.alive_ttl_ms): placement reads every
    worker's liveness and epoch in one MGET instead of two calls a worker."""
    return f"{PREFIX}:worker:{worker_id}:alive"


def worker_cache_counters(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:cache:counters"


def worker_reaped(worker_id: str) -> str:
    """Set by the one live worker that failed a dead worker's running jobs (its claim); the
    worker deletes it when it starts again."""
    return f"{PREFIX}:worker:{worker_id}:reaped"


def worker_control(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}:control"


def control_reply(reply_id: str) -> str:
    return f"{PREFIX}:control:{reply_id}:reply"


def admission_inflight() -> str:
    """The pool's admission ledger: every admitted request not yet ended, scored by when its
    reservation lapses (its router refreshes it); a member past its score is a crashed router's."""
    return f"{PREFIX}:admission:inflight"


def admission_queued_tokens() -> str:
    """Prompt tokens per admitted request that no worker has started yet."""
    return f"{PREFIX}:admission:queued"


def worker_blocks(worker_id: str, epoch: str) -> str:
    """The block hashes (shared.block_hash.index_members) the worker's prompt cache holds, plus
    INDEX_MARKER, so a lost index (Redis restart, flush) is told from an empty one."""
    return f"{PREFIX}:worker:{worker_id}:blocks:{epoch}"


# Always a member of a live worker's block set: the set exists while the worker's index does.
INDEX_MARKER = b"-"

# A member of every worker_routed set, scored +inf, longer than Redis's zset-max-listpack-value
# (64 by default): it keeps the set a skiplist, where a prompt's marks are read and written by
# lookup instead of by scanning a listpack once per block.
ROUTED_PIN = "(mlxcel: keeps this set a skiplist; never a block)".ljust(256, ".")


def worker_routed(worker_id: str) -> str:
    """Blocks of requests routed to the worker and not yet in its cache, scored by lapse (ms)."""
    return f"{PREFIX}:worker:{worker_id}:routed"


def worker_load(worker_id: str) -> str:
    """Requests placed on the worker and not yet ended, scored by when the placement lapses."""
    return f"{PREFIX}:worker:{worker_id}:load"


def worker_take(worker_id: str) -> str:
    """The worker's last take that popped jobs off its queues (worker/broker/intake.py): the
    take's id and what it popped, so the same take sent again (its reply lost with a
    connection) answers with those jobs instead of popping others."""
    return f"{PREFIX}:worker:{worker_id}:take"


def worker_prefill(worker_id: str) -> str:
    """Placed requests the worker has not started: request id -> prompt tokens it must compute."""
    return f"{PREFIX}:worker:{worker_id}:prefill"


def routing_stats() -> str:
    return f"{PREFIX}:routing:stats"


def routing_canary() -> str:
    return f"{PREFIX}:routing:canary"


def routing_placed() -> str:
    """The pool's placement table: each admitted request on a worker (placed there, or started
    there) -> that worker's id and the prompt tokens the request still computes there; an entry
    goes with the request's member of admission_inflight."""
    return f"{PREFIX}:routing:placed"


def routing_load() -> str:
    """Each worker's totals over routing_placed: requests counted there and their prompt tokens
    not yet started, kept in step by the script that moves a request (one read per decision)."""
    return f"{PREFIX}:routing:load"


def routing_facts() -> str:
    """Per worker id, what placement needs of a worker that stays the same for its whole life,
    under the epoch it was read for: `<epoch>|<mode>|<paged_block_size>|<checkpoint_tokens>|
    <model>` (the mode and its setting only for a paged or snapshot cache), read from its info
    hash again when the epoch changes."""
    return f"{PREFIX}:routing:facts"


def routing_live(model: str) -> str:
    """The model's live workers as the placement script last found them (cmsgpack: the roster's
    size then, and each worker's id, epoch and cache settings), for LIVE_CACHE_MS."""
    return f"{PREFIX}:routing:live:{model}"


def routing_first(block_hex: str) -> str:
    """The workers sent a prompt starting with this block (the hex of its index member), each
    scored like its mark in worker_routed: one read finds them all."""
    return f"{PREFIX}:routing:first:{block_hex}"


def routing_holders(block_hex: str) -> str:
    """The workers whose block index holds this block (the hex of its index member) as a
    prompt's first block: a worker adds itself as it starts holding it and removes itself as it
    stops, so a placement decision finds a prompt's holders here instead of in every worker's
    block set (and checks a holder's own set, which an entry of its earlier life fails)."""
    return f"{PREFIX}:routing:holders:{block_hex}"


def routing_cursor() -> str:
    return f"{PREFIX}:routing:rr"


def response_state(response_id: str) -> str:
    """A stored Responses API response (router.dialects.response_store): the response object
    and the conversation a continuation (`previous_response_id`) resumes, in any router."""
    return f"{PREFIX}:response:{response_id}:state"


def supervisor_restarts() -> str:
    """Per worker id, how many times a supervisor (`mlxcel-pool up`, on any host) started that
    worker again after it exited (HINCRBY: a counter that never goes back)."""
    return f"{PREFIX}:supervisor:restarts"


def router_wake(hub_id: str) -> str:
    """A router process's own stream: a write here wakes its blocked multi-stream XREAD."""
    return f"{PREFIX}:router:{hub_id}:wake"


def router_push(hub_id: str) -> str:
    """A router process's pub/sub channel (not a key): workers publish there the events they
    append to the streams it relays (GenerationRequest.relay_channel)."""
    return f"{PREFIX}:router:{hub_id}:push"


# Templates handed to Lua scripts as ARGV (the script substitutes the worker id for `{wid}`),
# so that no key is formatted outside this module.
WORKER_KEY_TEMPLATES: dict[str, str] = {
    "info": worker_info("{wid}"),
    "alive": worker_alive("{wid}"),
    "counters": worker_cache_counters("{wid}"),
    "blocks": worker_blocks("{wid}", "{epoch}"),
    "routed": worker_routed("{wid}"),
    "load": worker_load("{wid}"),
    "prefill": worker_prefill("{wid}"),
}


# Templates of routing_first and routing_holders for Lua (the script substitutes the block's
# hex for `{block}`).
ROUTING_FIRST_TEMPLATE = routing_first("{block}")
ROUTING_HOLDERS_TEMPLATE = routing_holders("{block}")

ROUTING_PARTS = ("stats", "canary", "rr", "placed", "load", "facts")


@dataclass(frozen=True)
class ParsedKey:
    kind: str  # "req", "worker", "control", "workers", "response", "routing", "supervisor"...
    ident: str  # request id, worker id or reply id ("" for the roster)
    part: str  # "stream", "cancel", "info", "cache:counters", ...


def parse_key(key: str) -> ParsedKey:
    """Parse a key written by this module back; raises ValueError on anything else."""
    parts = key.split(":")
    if not parts or parts[0] != PREFIX:
        raise ValueError(f"not an mlxcel key: {key!r}")
    if parts[1:] == ["workers"]:
        return ParsedKey("workers", "", "")
    if len(parts) == 3 and parts[1] == "admission" and parts[2] in ("inflight", "queued"):
        return ParsedKey("admission", "", parts[2])
    if len(parts) == 3 and parts[1] == "routing" and parts[2] in ROUTING_PARTS:
        return ParsedKey("routing", "", parts[2])
    if len(parts) == 4 and parts[1] == "routing" and parts[2] in ("first", "holders") and parts[3]:
        return ParsedKey("routing", parts[3], parts[2])
    if len(parts) >= 4 and parts[1] == "routing" and parts[2] == "live" and parts[3]:
        return ParsedKey("routing", ":".join(parts[3:]), "live")  # a model id may hold ':'
    if parts[1:] == ["supervisor", "restarts"]:
        return ParsedKey("supervisor", "", "restarts")
    if len(parts) == 5 and parts[1] == "worker" and parts[2] and parts[3] == "blocks" and parts[4]:
        return ParsedKey("worker", parts[2], "blocks")
    if (
        len(parts) >= 4
        and parts[1] in ("req", "worker", "control", "router", "response")
        and parts[2]
    ):
        part = ":".join(parts[3:])
        allowed = {
            "req": {"stream", "cancel"},
            "worker": {
                "info",
                "alive",
                "cache:counters",
                "control",
                "reaped",
                "routed",
                "load",
                "prefill",
                "take",
            },
            "control": {"reply"},
            "router": {"wake", "push"},
            "response": {"state"},
        }[parts[1]]
        if part in allowed:
            return ParsedKey(parts[1], parts[2], part)
    raise ValueError(f"not an mlxcel key: {key!r}")
