"""What isolates one cached entry from another: the namespace, plus the session key (set by the
router's admission: `prompt_cache_key`, else `user`, else anonymous)."""

from __future__ import annotations

from shared.block_hash import CacheNamespace

__all__ = ["CacheNamespace"]
