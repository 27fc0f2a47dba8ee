"""What isolates one cached entry from another: the namespace, plus the session key."""

from __future__ import annotations

from dataclasses import dataclass

ANONYMOUS_SESSION = ""


@dataclass(frozen=True)
class CacheNamespace:
    """KV is only reusable under the same weights, adapter and chat template."""

    model_id: str
    adapter_id: str = ""
    template_signature: str = ""

    def seed(self) -> bytes:
        """Bytes that start every hash chain, so equal tokens in two namespaces never collide."""
        return f"{self.model_id}\x00{self.adapter_id}\x00{self.template_signature}".encode()


def session_key(prompt_cache_key: str | None = None, user: str | None = None) -> str:
    """The spec's rule: `prompt_cache_key`, else `user`, else anonymous."""
    return prompt_cache_key or user or ANONYMOUS_SESSION
