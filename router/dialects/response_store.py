"""Stored Responses API responses, in Redis: any router process on any host answers
`GET /v1/responses/<id>` and continues a conversation from `previous_response_id`.

One JSON string per response (`shared.keys.response_state`), written with one SET ... EX: the
response object as GET returns it and the whole conversation so far as chat messages (earlier
turns, this input, this output; instructions are per request, as OpenAI's are), so a
continuation needs one read whatever the conversation's length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from shared import keys

# The ids this router makes (router.dialects.responses_output.new_id): anything else is no
# stored response, answered without a Redis read.
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


@dataclass
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, aredis: aioredis.Redis, ttl_s: int) -> None:
        self.aredis = aredis
        self.ttl_s = ttl_s

    async def save(self, stored: StoredResponse) -> None:
        data = orjson.dumps({"response": stored.response, "messages": stored.messages})
        await self.aredis.set(keys.response_state(stored.response["id"]), data, ex=self.ttl_s)

    async def load(self, response_id: str) -> StoredResponse | None:
        """None: never stored, `store: false`, deleted or expired."""
        if not RESPONSE_ID.fullmatch(response_id):
            return None
        raw = await self.aredis.get(keys.response_state(response_id))
        if raw is None:
            return None
        data = orjson.loads(raw)
        return StoredResponse(data["response"], data["messages"])

    async def delete(self, response_id: str) -> bool:
        if not RESPONSE_ID.fullmatch(response_id):
            return False
        return bool(await self.aredis.delete(keys.response_state(response_id)))
