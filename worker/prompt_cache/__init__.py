"""The worker's prompt (prefix) cache. The scheduler uses `PromptCache` (policy.py) only."""

from worker.prompt_cache.cacheability import Cacheability, check_model, resolve_storage_mode
from worker.prompt_cache.counters import CacheCounters
from worker.prompt_cache.keys import CacheNamespace
from worker.prompt_cache.modes import AdoptResult
from worker.prompt_cache.policy import PromptCache, ResetResult

__all__ = [
    "AdoptResult",
    "CacheCounters",
    "CacheNamespace",
    "Cacheability",
    "PromptCache",
    "ResetResult",
    "check_model",
    "resolve_storage_mode",
]
