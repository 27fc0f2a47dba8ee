"""Which bodies are admitted on the event loop (router/admission/inline.py): short plain ones;
anything with a grammar, logprobs, a template of its own or a long prompt goes to a thread."""

from __future__ import annotations

from typing import Any

import pytest

from router.admission.inline import INLINE_PROMPT_SIZE, admits_inline
from router.admission.tokenization import TokenizerPool
from router.edge.openai_types import ChatCompletionRequest, CompletionRequest

SHORT = "Say hello."
LONG = "x" * (INLINE_PROMPT_SIZE + 1)


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": SHORT}], **fields})


def test_short_plain_requests_are_admitted_in_line() -> None:
    assert admits_inline(CompletionRequest(prompt=SHORT))
    assert admits_inline(CompletionRequest(prompt=list(range(INLINE_PROMPT_SIZE))))
    assert admits_inline(CompletionRequest(prompt=[SHORT], n=3))
    assert admits_inline(chat(max_tokens=8, temperature=0.5))
    parts = [{"type": "text", "text": SHORT}, {"type": "text", "text": SHORT}]
    assert admits_inline(ChatCompletionRequest(messages=[{"role": "user", "content": parts}]))


@pytest.mark.parametrize(
    "body",
    [
        CompletionRequest(prompt=LONG),
        CompletionRequest(prompt=list(range(INLINE_PROMPT_SIZE + 1))),
        CompletionRequest(prompt=[list(range(INLINE_PROMPT_SIZE + 1))]),
        CompletionRequest(prompt=SHORT, logprobs=2),
        CompletionRequest(prompt=SHORT, response_format={"type": "json_object"}),
        ChatCompletionRequest(messages=[{"role": "user", "content": LONG}]),
        ChatCompletionRequest(
            messages=[
                {"role": "system", "content": LONG[:1500]},
                {"role": "user", "content": LONG[:600]},
            ]
        ),
        chat(logprobs=True),
        chat(response_format={"type": "json_object"}),
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        chat(chat_template="{{ messages }}"),
        chat(chat_template_kwargs={"enable_thinking": False}),
    ],
    ids=lambda b: type(b).__name__,
)
def test_long_or_costly_requests_go_to_a_thread(body: Any) -> None:
    assert not admits_inline(body)


def test_another_apis_body_is_not_admitted_in_line() -> None:
    assert not admits_inline({"prompt": SHORT})


def test_a_tokenizer_pool_with_every_copy_out_is_not_idle() -> None:
    """What ModelCatalog.ready asks before admitting on the event loop: a free copy, else the
    request goes to a thread instead of waiting on the loop."""
    pool = TokenizerPool(["copy-1", "copy-2"])
    assert pool.idle()
    with pool.borrow(), pool.borrow():
        assert not pool.idle()
    assert pool.idle()
