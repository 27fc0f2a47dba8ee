"""`mlxcel-pool stats`: the pool's merged `GET /v1/cache/stats` as terminal tables (rich).

`render(stats, now)` turns the JSON into renderables and nothing else (no I/O), so a test can
render a real pool's answer to text and read it back; the command fetches and prints, once or
every `--watch` seconds, or passes the JSON through with `--json`.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from shared.reject import REJECT_REASONS


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _bytes(n: int | None) -> str:
    n = int(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _age(then_s: float | None, now: float) -> str:
    if then_s is None:
        return "-"
    age = max(0.0, now - then_s)
    return f"{age:.1f}s ago" if age < 120 else f"{age / 60:.0f}m ago"


def _pool_table(stats: dict[str, Any]) -> Table:
    t = Table(title="prompt cache (pool)", show_header=True, header_style="bold")
    for col in (
        "workers alive",
        "hit rate",
        "hits / lookups",
        "tokens reused",
        "entries",
        "bytes / capacity",
        "inserts",
        "evictions lru / ttl",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        str(stats.get("workers_alive", 0)),
        _rate(stats.get("hit_rate")),
        f"{stats.get('hits', 0)} / {stats.get('lookups', 0)}",
        str(stats.get("prefix_tokens_reused", 0)),
        str(stats.get("entries", 0)),
        f"{_bytes(stats.get('bytes'))} / {_bytes(stats.get('capacity_bytes'))}",
        str(stats.get("inserts", 0)),
        f"{stats.get('evictions_lru', 0)} / {stats.get('evictions_ttl', 0)}",
    )
    return t


def _rejects_table(stats: dict[str, Any], now: float) -> Table:
    t = Table(title="rejects by reason", show_header=True, header_style="bold")
    for reason in REJECT_REASONS:
        t.add_column(reason.value, justify="right")
    t.add_row(*(str(stats.get(f"reject_{r.value}", 0)) for r in REJECT_REASONS))
    reason = stats.get("last_reject_reason")
    if reason:
        at = stats.get("last_reject_at_unix_ms")
        seq, context = stats.get("last_reject_seq_id"), stats.get("last_reject_context_len")
        t.caption = (
            f"last reject: {reason} on {stats.get('last_reject_worker_id') or '?'} "
            f"(seq {seq}, context {context} tokens, {_age(at / 1000 if at else None, now)})"
        )
    else:
        t.caption = "last reject: none"
    return t


def _workers_table(stats: dict[str, Any], now: float) -> Table:
    routing = (stats.get("routing") or {}).get("workers", {})
    t = Table(title="workers", show_header=True, header_style="bold")
    for col, justify in (
        ("worker", "left"),
        ("alive", "left"),
        ("heartbeat", "right"),
        ("model", "left"),
        ("host:pid", "left"),
        ("running", "right"),
        ("hit rate", "right"),
        ("entries", "right"),
        ("bytes", "right"),
        ("rejects", "right"),
        ("routed", "right"),
        ("predicted / reused tok", "right"),
        ("taken over", "right"),
    ):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for wid, w in (stats.get("workers") or {}).items():
        r = routing.get(wid, {})
        rejects = sum(int(w.get(f"reject_{x.value}", 0)) for x in REJECT_REASONS)
        alive = Text("yes", style="green") if w.get("alive") else Text("dead", style="red")
        t.add_row(
            wid,
            alive,
            _age(w.get("last_seen"), now),
            str(w.get("model") or "-"),
            f"{w.get('host') or '?'}:{w.get('pid') or '?'}",
            str(w.get("batch_current_size", 0)),
            _rate(w.get("hit_rate")),
            str(w.get("entries", 0)),
            _bytes(w.get("bytes")),
            str(rejects),
            str(r.get("routed", 0)),
            f"{r.get('predicted_tokens', 0)} / {r.get('reused_tokens', 0)}",
            str(r.get("taken_over", 0)),
        )
    return t


def _routing_table(stats: dict[str, Any]) -> Table:
    routing = stats.get("routing") or {}
    decisions = routing.get("decisions") or {}
    t = Table(
        title=f"routing (policy {routing.get('policy', '?')})",
        show_header=True,
        header_style="bold",
    )
    for outcome in decisions:
        t.add_column(outcome, justify="right")
    t.add_column("predicted / reused tokens", justify="right")
    t.add_row(
        *(str(n) for n in decisions.values()),
        f"{routing.get('predicted_tokens', 0)} / {routing.get('reused_tokens', 0)}",
    )
    return t


def render(stats: dict[str, Any], now: float) -> Group:
    return Group(
        _pool_table(stats),
        _rejects_table(stats, now),
        _workers_table(stats, now),
        _routing_table(stats),
    )
