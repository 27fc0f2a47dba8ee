"""What isolates one cached entry from another: the namespace, plus the session key."""

from __future__ import annotations

from shared.block_hash import CacheNamespace

__all__ = ["ANONYMOUS_SESSION", "CacheNamespace", "session_key"]

ANONYMOUS_SESSION = ""


def session_key(prompt_cache_key: str | None = None, user: str | None = None) -> str:
    """The spec's rule: `prompt_cache_key`, else `user`, else anonymous."""
    return prompt_cache_key or user or ANONYMOUS_SESSION
