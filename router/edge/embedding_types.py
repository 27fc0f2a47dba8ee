"""The `/v1/embeddings` request body, typed as router.edge.openai_types types its bodies: strict
types, unknown fields ignored. Counts, lengths and `dimensions` are admission's
(router/admission/embedding_admit.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from router.edge.openai_types import Text


class EmbeddingBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text
    # A string, token ids, or a list of either (OpenAI's four shapes).
    input: Text | list[int] | list[Text] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None  # accepted and ignored
