"""Per-event cost of recording a prompt-cache reject (goal: under 2 us), in-process.

Measures CacheCounters.record_reject alone, then PromptCache.record_reject (counter + last reject
+ trace hook) with trace off, and with trace on while the log handler sits at WARNING (the INFO
line is built lazily and filtered).

    .venv/bin/python bench/bench_reject_cost.py [events]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/x.py` puts bench/ first, not the repo root
    sys.path.insert(0, str(REPO))

from shared.config import PromptCacheConfig  # noqa: E402
from shared.reject import REJECT_REASONS  # noqa: E402
from worker.prompt_cache.counters import CacheCounters  # noqa: E402
from worker.prompt_cache.policy import PromptCache  # noqa: E402
from worker.prompt_cache.trace import LOGGER_NAME  # noqa: E402

GOAL_NS = 2000


def per_event_ns(record: Callable[[int], None], events: int) -> float:
    for i in range(1000):  # warm up
        record(i)
    start = time.perf_counter_ns()
    for i in range(events):
        record(i)
    return (time.perf_counter_ns() - start) / events


def main(events: int = 200_000) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger(LOGGER_NAME).setLevel(logging.WARNING)
    reasons = list(REJECT_REASONS)
    counters = CacheCounters()
    off = PromptCache(
        PromptCacheConfig(trace=False), model_id="m", storage_mode="dense", worker_id="w1"
    )
    on = PromptCache(
        PromptCacheConfig(trace=True), model_id="m", storage_mode="dense", worker_id="w1"
    )
    cases: dict[str, Callable[[int], None]] = {
        "counters.record_reject": lambda i: counters.record_reject(reasons[i % 7], None, i, 0),
        "PromptCache.record_reject, trace off": lambda i: off.record_reject(
            reasons[i % 7], "seq", i
        ),
        "PromptCache.record_reject, trace on, handler at WARNING": lambda i: on.record_reject(
            reasons[i % 7], "seq", i
        ),
    }
    # The lambda and the loop are part of each number; measure them alone to show the overhead.
    loop = per_event_ns(lambda i: None, events)
    print(f"events per case: {events}; empty loop + call: {loop:.0f} ns/event")
    for name, fn in cases.items():
        ns = per_event_ns(fn, events)
        verdict = "under" if ns < GOAL_NS else "OVER"
        print(f"{name:58s} {ns:7.0f} ns/event  ({verdict} the {GOAL_NS} ns goal)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Per-event cost of recording a prompt-cache reject")
    ap.add_argument("events", nargs="?", type=int, default=200_000)
    ap.add_argument("--quick", action="store_true", help="20,000 events")
    args = ap.parse_args()
    main(20_000 if args.quick else args.events)
