"""Which requests are admitted on the event loop itself.

Admission is CPU work (a chat template, tokenization, the prompt's block hashes) and runs in a
worker thread, where a long prompt cannot stall every stream the process relays. For a short
plain one the trip costs more than the work: two context switches and the GIL handed over
both ways, against a few hundred microseconds of Python. Such a request is admitted in line.
"""

from __future__ import annotations

from router.edge.openai_types import ChatCompletionRequest, CompletionRequest

# The most prompt characters (or token ids) a request admitted in line has: its tokenization
# and hashing stay well under a millisecond.
INLINE_PROMPT_SIZE = 2048


def admits_inline(body: object) -> bool:
    """Whether `body` is short and plain: no grammar to compile (response_format, tools), no
    token table to build (logprobs), no template of its own to compile, its prompt at most
    INLINE_PROMPT_SIZE characters or token ids. Any other body (another API's) is not."""
    if isinstance(body, CompletionRequest):
        if body.response_format is not None or body.logprobs is not None:
            return False
        return _prompt_size(body.prompt) <= INLINE_PROMPT_SIZE
    if isinstance(body, ChatCompletionRequest):
        if body.response_format is not None or body.tools or body.logprobs:
            return False
        if body.chat_template is not None or body.chat_template_kwargs:
            return False
        size = 0
        for message in body.messages:
            if message.tool_calls:
                return False
            size += len(message.text())
        return size <= INLINE_PROMPT_SIZE
    return False


def _prompt_size(prompt: object) -> int:
    """Characters or token ids: a string, a list of ids, or a list of either (pydantic made
    every list one kind, so its first element says which)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        if not prompt or isinstance(prompt[0], int):
            return len(prompt)
        return sum(len(p) for p in prompt)
    return INLINE_PROMPT_SIZE + 1
