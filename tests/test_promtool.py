"""`promtool check metrics` on real /metrics scrapes: by default its only complaints are the
spec's two names with abbreviated units (mlxcel_request_ttft_ms, mlxcel_request_decode_tok_s);
with MLXCEL_METRICS_LEGACY_UNITS=false the scrape is clean. promtool runs where it is installed;
everywhere the same rules run in Python (`lint`, promtool 2.42's promlint rules over
prometheus_client's parse), checked against promtool itself where both exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue

from router.metrics import LEGACY_UNIT_NAMES
from shared import keys
from tests.pool_fixture import running_pool
from tests.streams import TINY_MODEL
from worker.broker.presence import WorkerPresence

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

PROMTOOL = shutil.which("promtool")
ABBREVIATED = "metric names should not contain abbreviated units"

# promlint's tables (client_golang prometheus/testutil/promlint, as promtool 2.42 ships it).
_UNITS = {
    **{u: u for u in ("amperes", "bytes", "celsius", "grams", "joules", "kelvin", "meters")},
    **{u: u for u in ("metres", "seconds", "volts")},
    **dict.fromkeys(("minutes", "hours", "days", "weeks"), "seconds"),
    "kelvins": "kelvin",
    "fahrenheit": "celsius",
    "rankine": "celsius",
    **dict.fromkeys(("inches", "yards", "miles"), "meters"),
    "bits": "bytes",
    "calories": "joules",
    "pounds": "grams",
    "ounces": "grams",
}
_UNIT_PREFIXES = (
    "pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo", "kibi", "mega",
    "mibi", "giga", "gibi", "tera", "tebi", "peta", "pebi",
)  # fmt: skip
_ABBREVIATIONS = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")
_CAMEL = re.compile(r"[a-z][A-Z]")
# A sample's name and labels, as the exposition writes them (labels in braces, then the value).
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')
_PARTS = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


@dataclass(frozen=True, order=True)
class Problem:
    metric: str
    text: str

    def __str__(self) -> str:
        return f"{self.metric} {self.text}"


@dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    labels: frozenset[str] = frozenset()


def families_of(text: str) -> list[Family]:
    """The families as promtool's parser sees them: a HELP or TYPE line opens one; a sample
    belongs to the open family when it is its name (or a histogram's or summary's part), else it
    is an untyped family of its own. A histogram's `le` and a summary's `quantile` are its
    buckets, not labels. A second HELP or TYPE for one name is a parse error, as in promtool."""
    list(text_string_to_metric_families(text))  # raises on what prometheus_client cannot parse
    out: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            _, kind, name, *rest = line.split(" ", 3)
            fam = out.setdefault(name, Family(name))
            field = "help" if kind == "HELP" else "type"
            if (
                field == "type"
                and fam.type != "untyped"
                or field == "help"
                and fam.help is not None
            ):
                raise ValueError(f"second {kind} line for metric name {name!r}")
            setattr(fam, field, rest[0] if rest else "")
            current = fam
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue  # a comment or a blank line
        name, labels = m.group(1), set(_LABEL.findall(m.group(2) or ""))
        parts = _PARTS.get(current.type, ()) if current else ()
        if current is None or name not in (current.name, *(current.name + p for p in parts)):
            current = out.setdefault(name, Family(name))
        if current.type == "histogram" and name == current.name + "_bucket":
            labels.discard("le")
        if current.type == "summary" and name == current.name:
            labels.discard("quantile")
        current.labels |= labels
    return list(out.values())


def _unit(name: str) -> tuple[str, str] | None:
    for part in name.split("_"):
        if part in _UNITS:
            return part, _UNITS[part]
        for prefix in _UNIT_PREFIXES:
            if part.startswith(prefix) and part[len(prefix) :] in _UNITS:
                return part, _UNITS[part[len(prefix) :]]
    return None


def _family_problems(f: Family) -> list[str]:
    """promlint's linters, in its order: help, units, counter suffix, reserved suffixes, type in
    the name, reserved characters, camelCase, abbreviated units."""
    n, low, typed = f.name, f.name.lower(), f.type != "untyped"
    out = []
    if f.help is None:
        out.append("no help text")
    unit = _unit(n)
    if unit and unit[0] != unit[1]:
        out.append(f'use base unit "{unit[1]}" instead of "{unit[0]}"')
    total = n.endswith("_total")
    if f.type == "counter" and not total:
        out.append('counter metrics should have "_total" suffix')
    elif typed and f.type != "counter" and total:
        out.append('non-counter metrics should not have "_total" suffix')
    if typed:
        if f.type != "histogram" and n.endswith("_bucket"):
            out.append('non-histogram metrics should not have "_bucket" suffix')
        for suffix in ("_count", "_sum"):
            if f.type not in _PARTS and n.endswith(suffix):
                out.append(
                    f'non-histogram and non-summary metrics should not have "{suffix}" suffix'
                )
        if f.type == "histogram" and "le" in f.labels:
            out.append('metric with a histogram type should not have an "le" label')
        if f.type == "summary" and "quantile" in f.labels:
            out.append('metric with a summary type should not have a "quantile" label')
        if f"_{f.type}_" in low or low.endswith(f"_{f.type}"):
            out.append(f"metric name should not include type '{f.type}'")
    if ":" in n:
        out.append("metric names should not contain ':'")
    if _CAMEL.search(n):
        out.append("metric names should be written in 'snake_case' not 'camelCase'")
    if any(_CAMEL.search(label) for label in f.labels):
        out.append("label names should be written in 'snake_case' not 'camelCase'")
    out.extend(ABBREVIATED for a in _ABBREVIATIONS if f"_{a}_" in low or low.endswith(f"_{a}"))
    return out


def lint(text: str) -> list[str]:
    """What `promtool check metrics` prints for `text`, one `name problem` line each, sorted."""
    problems = {Problem(f.name, p) for f in families_of(text) for p in _family_problems(f)}
    return [str(p) for p in sorted(problems)]


def promtool(text: str) -> tuple[int, list[str]]:
    """promtool's exit code and its problem lines (it prints them on stderr)."""
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    return done.returncode, [line for line in done.stderr.splitlines() if line.strip()]


def check(text: str, want: list[str]) -> None:
    """The Python rules find exactly `want`; so does promtool, where it is installed (exit 0 when
    clean, 3 for lint problems)."""
    assert lint(text) == want
    if PROMTOOL is not None:
        assert promtool(text) == (3 if want else 0, want)


BAD = """\
# HELP x_ms a gauge in ms
# TYPE x_ms gauge
x_ms 1
# TYPE foo_count gauge
foo_count 1
# HELP done_total a gauge named like a counter
# TYPE done_total gauge
done_total 1
# HELP my_counter a counter without _total
# TYPE my_counter counter
my_counter 1
# HELP wait_milliseconds not the base unit
# TYPE wait_milliseconds gauge
wait_milliseconds 2
# HELP c:d a recording rule's name
# TYPE c:d gauge
c:d 1
# HELP queueDepth camelCase
# TYPE queueDepth gauge
queueDepth{workerId="w1"} 3
# HELP lat_seconds a histogram
# TYPE lat_seconds histogram
lat_seconds_bucket{le="1.0"} 1
lat_seconds_bucket{le="+Inf"} 1
lat_seconds_sum 0.5
lat_seconds_count 1
# HELP ok_bytes fine
# TYPE ok_bytes gauge
ok_bytes 1
untyped_thing 4
"""


def test_the_python_rules_flag_each_bad_name_as_promtool_does() -> None:
    check(
        BAD,
        [
            "c:d metric names should not contain ':'",
            'done_total non-counter metrics should not have "_total" suffix',
            "foo_count no help text",
            'foo_count non-histogram and non-summary metrics should not have "_count" suffix',
            'my_counter counter metrics should have "_total" suffix',
            "my_counter metric name should not include type 'counter'",
            "queueDepth label names should be written in 'snake_case' not 'camelCase'",
            "queueDepth metric names should be written in 'snake_case' not 'camelCase'",
            "untyped_thing no help text",
            'wait_milliseconds use base unit "seconds" instead of "milliseconds"',
            f"x_ms {ABBREVIATED}",
        ],
    )
    # A clean text is clean (the rules are not always-false either).
    assert lint("# HELP ok_bytes fine\n# TYPE ok_bytes gauge\nok_bytes 1\n") == []
    with pytest.raises(ValueError, match="second TYPE"):
        families_of("# TYPE a gauge\na 1\n# TYPE a gauge\na 2\n")


def _complete(url: str) -> None:
    body = {"model": TINY_MODEL, "prompt": "Once upon a time", "max_tokens": 3, "n": 2}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text


def test_by_default_only_the_specs_two_legacy_names_are_flagged(shared_pool: Any) -> None:
    for _ in range(2):
        _complete(shared_pool.url)
    text = httpx.get(f"{shared_pool.url}/metrics", timeout=10).text
    assert "mlxcel_worker_up{" in text and "mlxcel_kv_cache_usage_perc " in text
    check(text, [f"{name} {ABBREVIATED}" for name in sorted(LEGACY_UNIT_NAMES)])


def test_without_legacy_units_the_scrape_is_clean(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A router-only pool (its own Redis, real router processes) with the flag off, and a worker
    registered in its Redis so the per-worker series are in the scrape too."""
    env = {"MLXCEL_METRICS_LEGACY_UNITS": "false"}
    with running_pool(tiny_model_dir, tmp_path, workers=0, env=env) as pool:
        r = redis.Redis.from_url(pool.redis_url)
        queue = Queue(keys.worker_queue_name("w9"), connection=r)
        WorkerPresence(r, "w9", [queue], {"worker_id": "w9"}).arrive({"kv_budget_bytes": 1000})
        r.hincrby(keys.supervisor_restarts(), "w9", 1)
        text = httpx.get(f"{pool.url}/metrics", timeout=10).text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert not families & LEGACY_UNIT_NAMES
    assert {"mlxcel_time_to_first_token_seconds", "mlxcel_request_inter_token_latency_seconds"} <= (
        families
    )
    assert 'mlxcel_worker_restarts_total{worker="w9"} 1.0' in text
    check(text, [])
