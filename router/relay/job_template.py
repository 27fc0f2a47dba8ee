"""rq's enqueue of a job on one queue, made by rq once and then filled in for each job.

rq's own enqueue builds a Job, checks its serializer against a typing Protocol (slow in Python
3.11), parses its timeouts and writes its hash field by field: per request, tens of
microseconds of the router's CPU beside the msgpack and zlib of the job's data. Every job the
router sends to one queue has the same commands but for its id (in keys and values), its data,
its description and its clock. A template is the command list rq makes for a sentinel job, with
those places marked; a job's commands are the template with its own values put there.

A job's data is deflated at zlib's fastest level, not rq's default: a prompt of thousands of
tokens costs a fifth to a half as much to pack, rq's `zlib.decompress` reads it the same, and
it comes out larger, the more so the longer the prompt (bench/README.md, bench_job_data.py).
The worker writes it back as it read it at the job's end (worker.broker.intake.PoolJob).

A template checks itself when made: filled in for a second sentinel job (another id, data and
description), it must give rq's commands for that job word for word, the clock fields' values
aside and its data compared inflated. Where it does not (an rq that writes a job's values
somewhere the template does not know), the queue's jobs go through rq's own enqueue, as before.
What the check cannot see is rq's behaviour for values unlike the sentinels': the template is
for what the router enqueues, an id of rq's allowed characters (checked) and a description that
is not empty (rq writes the call itself for an empty one).
"""

from __future__ import annotations

import logging
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import redis
from rq import Queue
from rq.job import validate_job_id
from rq.utils import now, utcformat

log = logging.getLogger(__name__)

# The job hash fields whose values are the enqueue's clock. rq reads the clock for each, a few
# microseconds apart; a job from a template gets one time for both (nothing reads them together).
CLOCK_FIELDS = frozenset({"created_at", "enqueued_at"})

# rq's commands for (queue, job id, kwargs, description), enqueued as the dispatcher enqueues.
RqCommands = Callable[[Queue, str, dict[str, object], str], list[tuple[Any, ...]]]

# The job data's deflate level: the fastest (rq's own enqueue uses zlib's default, 6).
DATA_LEVEL = 1

# Stands for the job id in a key or value of the template: no constant argument holds it, and
# one str.replace pass puts the id in its place.
_ID_MARK = "\x00job\x00"


@dataclass(frozen=True, slots=True)
class _Job:
    """The values that differ from job to job, as rq writes them."""

    job_id: str
    data: bytes  # deflated
    description: str
    clock: str


# Where a job's value goes in a command: (the argument's place, what goes there: "id" (the
# argument's text with _ID_MARK for the id), "data", "description" or "clock", the text).
_Slot = tuple[int, str, str]


class JobTemplate:
    """The commands of one queue's enqueue, with the places of a job's values."""

    def __init__(self, queue: Queue, func: str, commands: list[tuple[Any, ...]], sentinel: _Job):
        self._serializer = queue.serializer
        self._func = func
        self._commands = commands
        self._slots = [_slots(command, sentinel) for command in commands]

    @classmethod
    def made_by(cls, rq_commands: RqCommands, queue: Queue, func: str) -> JobTemplate | None:
        """The queue's template, or None where it does not give rq's commands (see above); a
        Redis error (rq reads the server's version once) is raised, no verdict."""
        try:
            first, second = _sentinel(queue, func), _sentinel(queue, func)
            made = rq_commands(queue, first.job_id, _kwargs(first.job_id), first.description)
            template = cls(queue, func, made, first)
            theirs = rq_commands(queue, second.job_id, _kwargs(second.job_id), second.description)
            ours = template.commands(second.job_id, _kwargs(second.job_id), second.description)
            expected = template._comparable(theirs)
            same = expected is not None and template._comparable(ours) == expected
        except redis.RedisError:  # rq read the server's version: no verdict, the next job tries
            raise
        except Exception:  # commands of a shape the template cannot read: rq's own path
            log.warning(
                "rq's enqueue on %s could not be made a template", queue.name, exc_info=True
            )
            same = False
        if not same:
            log.warning(
                "rq %s enqueues on %s otherwise than its template: its jobs go through rq's "
                "own enqueue",
                version("rq"),
                queue.name,
            )
            return None
        return template

    def _comparable(self, commands: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]] | None:
        """The commands with every clock value as one placeholder (two enqueues never share it)
        and the data inflated (two levels of deflate differ in bytes, not in what they hold);
        None where the template's data place holds no deflated data."""
        if len(commands) != len(self._slots):
            return None
        out = []
        for command, slots in zip(commands, self._slots, strict=True):
            args = ["<clock>" if _is_clock(command, i) else a for i, a in enumerate(command)]
            for i, kind, _ in slots or ():
                if kind == "data":
                    arg = command[i] if i < len(command) else None
                    inflated = _inflated(arg) if isinstance(arg, bytes) else None
                    if inflated is None:
                        return None
                    args[i] = inflated
            out.append(tuple(args))
        return out

    def commands(
        self, job_id: str, kwargs: dict[str, object], description: str
    ) -> list[tuple[Any, ...]]:
        """rq's enqueue of this job, as its commands (ValueError: an id rq refuses, or an empty
        description, for which rq writes something else)."""
        validate_job_id(job_id)
        if not description:
            raise ValueError("a job from a template needs a description")
        data = _data(self._serializer, self._func, kwargs)
        job = _Job(job_id, data, description, utcformat(now()))
        return [
            command if slots is None else _filled(command, slots, job)
            for command, slots in zip(self._commands, self._slots, strict=True)
        ]


def _data(serializer: Any, func: str, kwargs: dict[str, object], level: int = DATA_LEVEL) -> bytes:
    """A job's data: (function, instance, args, kwargs) serialized, then deflated as rq's
    Job.to_dict does, at `level` (rq's own: zlib's default)."""
    return zlib.compress(serializer.dumps((func, None, (), kwargs)), level)


def _filled(command: tuple[Any, ...], slots: list[_Slot], job: _Job) -> tuple[Any, ...]:
    args = list(command)
    for i, kind, text in slots:
        args[i] = text.replace(_ID_MARK, job.job_id) if kind == "id" else getattr(job, kind)
    return tuple(args)


def _slots(command: tuple[Any, ...], sentinel: _Job) -> list[_Slot] | None:
    """The command's slots; None for a command that holds no job value. The data's place is
    the argument that inflates to what the sentinel's data does, whatever level rq deflated
    it at."""
    packed = zlib.decompress(sentinel.data)
    slots: list[_Slot] = []
    for i, arg in enumerate(command):
        if isinstance(arg, str) and sentinel.job_id in arg:
            slots.append((i, "id", arg.replace(sentinel.job_id, _ID_MARK)))
        elif isinstance(arg, bytes) and _inflated(arg) == packed:
            slots.append((i, "data", ""))
        elif arg == sentinel.description:
            slots.append((i, "description", ""))
        elif _is_clock(command, i):
            slots.append((i, "clock", ""))
    return slots or None


def _is_clock(command: Sequence[Any], i: int) -> bool:
    """Whether argument i is a clock field's value: HSET key f1 v1 f2 v2 ... holds a field's
    value at an odd place past the key, after its field."""
    return command[0] == "HSET" and i > 2 and i % 2 == 1 and command[i - 1] in CLOCK_FIELDS


def _inflated(arg: bytes) -> bytes | None:
    try:
        return zlib.decompress(arg)
    except zlib.error:
        return None


def _sentinel(queue: Queue, func: str) -> _Job:
    """A job made up to find where a job's values go in rq's commands (its data deflated at
    rq's level, its clock rq's)."""
    tag = uuid.uuid4().hex
    job_id = f"template-{tag}"
    data = _data(queue.serializer, func, _kwargs(job_id), zlib.Z_DEFAULT_COMPRESSION)
    return _Job(job_id, data, f"the template's sentinel job {tag}", "")


def _kwargs(job_id: str) -> dict[str, object]:
    return {"request": job_id}
