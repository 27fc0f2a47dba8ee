"""Load-time check: can this model's cache be reused, and in which storage modes?"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mlx_lm.models.cache import KVCache, make_prompt_cache

Kind = Literal["trimmable", "snapshot", "none"]


@dataclass(frozen=True)
class Cacheability:
    kind: Kind
    storage_modes: list[str] = field(default_factory=list)
    reason: str = ""


def classify_caches(layer_caches: list[Any]) -> Cacheability:
    """All plain KVCache -> trimmable (dense + paged); anything else exposing `state` ->
    snapshot only; otherwise none."""
    if not layer_caches:
        return Cacheability("none", [], "the model makes no cache")
    names = sorted({type(c).__name__ for c in layer_caches})
    if all(type(c) is KVCache for c in layer_caches):
        return Cacheability("trimmable", ["dense", "paged"], "every layer is a KVCache")
    if all(_has_state(c) for c in layer_caches):
        return Cacheability(
            "snapshot", ["snapshot"], f"layers {', '.join(names)} cannot all be cut back"
        )
    return Cacheability("none", [], f"layers {', '.join(names)} expose no restorable state")


def _has_state(cache: Any) -> bool:
    try:
        cache.state  # noqa: B018 - probing the property is the check
    except Exception:
        return False
    return hasattr(type(cache), "from_state")


def check_model(model: Any, max_kv_size: int | None = None) -> Cacheability:
    return classify_caches(make_prompt_cache(model, max_kv_size=max_kv_size))


def resolve_storage_mode(storage: str, batch_size: int, cacheability: Cacheability) -> str:
    """`auto` picks paged when batching and the model supports it; an unsupported explicit mode
    falls back to what the model allows."""
    modes = cacheability.storage_modes
    if cacheability.kind == "none":
        return "none"
    if cacheability.kind == "snapshot":
        return "snapshot"
    if storage == "auto":
        return "paged" if batch_size > 1 and "paged" in modes else "dense"
    return storage if storage in modes else "dense"
