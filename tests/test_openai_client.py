"""The official `openai` client against a real pool (router processes, a worker, Redis): every
API feature of docs/api.md driven the way an application drives it, each asserting what the
tiny random-weight model really does, parsed into the client's typed objects.

The pool runs with an API key (the client sends it as its `api_key`), a small admission bound
(so a request of many choices is a 429) and request chat templates trusted (a test renders tools
with a template of its own). Prompts are ones this model never ends with EOS, and every
request bounds its tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionTokenLogprob
from transformers import AutoTokenizer

from tests.pool_fixture import running_pool
from tests.test_tool_calls import SDK_TURNS, TOOLS_TEMPLATE, WEATHER, as_template_sees

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

KEY = "sk-openai-client-3f9c2d"
BOUND = 12  # requests (choices) in flight: a request of n=16 is refused whole
FOX = "The quick brown fox"
COUNT = "1, 2, 3, 4, 5,"
N = 8  # tokens per request


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    env = {
        "MLXCEL_API_KEYS": KEY,
        "MLXCEL_MAX_INFLIGHT": str(BOUND),
        "MLXCEL_RETRY_AFTER_S": "1",
        "MLXCEL_TRUST_REQUEST_CHAT_TEMPLATE": "true",
    }
    with running_pool(tiny_model_dir, tmp_path_factory.mktemp("openai"), env=env) as p:
        yield p


def _client(pool: Any, key: str = KEY, strict: bool = False) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{pool.url}/v1",
        api_key=key,
        max_retries=0,
        timeout=60,
        _strict_response_validation=strict,
    )


@pytest.fixture(scope="module")
def client(pool: Any) -> Iterator[openai.OpenAI]:
    with _client(pool) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


def chat_of(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def greedy(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = N) -> str:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text


# --- models ---------------------------------------------------------------------------------------


def test_models_list_and_retrieve(client: openai.OpenAI, tiny_model_dir: Path) -> None:
    listed = client.models.list()
    ids = [m.id for m in listed.data]
    assert ids == [tiny_model_dir.resolve().name]
    one = client.models.retrieve(ids[0])
    assert (one.id, one.object, one.owned_by) == (ids[0], "model", "mlxcel")
    assert one.created == listed.data[0].created > 0
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.param == "model" and err.value.code == "model_not_found"


def test_responses_match_the_clients_own_types(pool: Any, model: str) -> None:
    """A client validating every field against its OpenAI schema parses the non-streamed
    bodies: nothing missing, nothing of the wrong type."""
    with _client(pool, strict=True) as strict:
        strict.models.list()
        done = strict.completions.create(model=model, prompt=FOX, max_tokens=3, logprobs=2)
        assert isinstance(done, Completion) and done.choices[0].logprobs is not None
        chat = strict.chat.completions.create(
            model=model, messages=chat_of(FOX), max_tokens=3, logprobs=True, top_logprobs=2, n=2
        )
        assert isinstance(chat, ChatCompletion) and [c.index for c in chat.choices] == [0, 1]


# --- completions and chat, streamed and not -------------------------------------------------------


def test_completions_plain_and_streamed(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt=FOX, max_tokens=N, temperature=0)
    assert out.object == "text_completion" and out.model == model
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text and choice.logprobs is None
    assert out.usage is not None and out.usage.completion_tokens == N
    assert out.usage.total_tokens == out.usage.prompt_tokens + N
    chunks = list(
        client.completions.create(
            model=model,
            prompt=FOX,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == choice.text
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage == out.usage
    # Without include_usage: no usage chunk.
    plain = list(
        client.completions.create(model=model, prompt=FOX, max_tokens=N, temperature=0, stream=True)
    )
    assert all(c.choices and c.usage is None for c in plain)
    assert "".join(c.choices[0].text for c in plain) == choice.text


def test_chat_plain_and_streamed(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=chat_of(FOX), max_tokens=N, temperature=0
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == N
    stream = client.chat.completions.create(
        model=model,
        messages=chat_of(FOX),
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    *body, last = list(stream)
    assert body[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == body[0].id for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage == out.usage


# --- sampling controls ----------------------------------------------------------------------------


def test_a_seed_reproduces_its_sample(client: openai.OpenAI, model: str) -> None:
    def sample(seed: int) -> str:
        out = client.chat.completions.create(
            model=model, messages=chat_of(FOX), max_tokens=N, temperature=1.0, seed=seed
        )
        return out.choices[0].message.content or ""

    first, again, other = sample(11), sample(11), sample(12)
    assert first == again
    assert other != first
    done = [
        client.completions.create(model=model, prompt=COUNT, max_tokens=N, temperature=1.0, seed=s)
        .choices[0]
        .text
        for s in (5, 5, 6)
    ]
    assert done[0] == done[1] != done[2]


def test_truncation_controls_keep_only_the_top_token(client: openai.OpenAI, model: str) -> None:
    """top_k=1, min_p=1 and a tiny top_p keep only the most likely token: any seed at any
    temperature decodes the greedy text. top_k and min_p are not the client's parameters."""
    want = greedy(client, model, FOX)
    hot: dict[str, Any] = {"model": model, "prompt": FOX, "max_tokens": N, "temperature": 1.8}
    for seed in (1, 2):
        top_k = client.completions.create(**hot, seed=seed, extra_body={"top_k": 1})
        min_p = client.completions.create(**hot, seed=seed, extra_body={"min_p": 1.0})
        top_p = client.completions.create(**hot, seed=seed, top_p=1e-6)
        assert [top_k.choices[0].text, min_p.choices[0].text, top_p.choices[0].text] == [want] * 3
    # Off (top_k 0 or -1, min_p 0): sampling again, as the seed says.
    loose = client.completions.create(**hot, seed=1, extra_body={"top_k": -1, "min_p": 0})
    assert loose.choices[0].text == client.completions.create(**hot, seed=1).choices[0].text
    assert loose.choices[0].text != want


def test_penalties_change_the_greedy_continuation(client: openai.OpenAI, model: str) -> None:
    """Greedy, this model repeats itself after COUNT: each penalty turns it elsewhere."""
    base: dict[str, Any] = {
        "model": model,
        "messages": chat_of(COUNT),
        "max_tokens": N,
        "temperature": 0,
    }

    def text(**extra: Any) -> str:
        return client.chat.completions.create(**base, **extra).choices[0].message.content or ""

    plain = text()
    assert text(presence_penalty=2.0) != plain
    assert text(frequency_penalty=2.0) != plain
    assert text(extra_body={"repetition_penalty": 2.0}) != plain
    assert text(extra_body={"repetition_penalty": 1.0}, presence_penalty=0) == plain


def test_logit_bias_forces_a_token(client: openai.OpenAI, model: str, hf: Any) -> None:
    forced = client.completions.create(
        model=model, prompt=FOX, max_tokens=6, logprobs=0, logit_bias={"100": 100}
    )
    lp = forced.choices[0].logprobs
    assert lp is not None and lp.tokens == [hf.decode([100])] * 6
    chat = client.chat.completions.create(
        model=model, messages=chat_of(COUNT), max_tokens=4, logit_bias={"100": 100}, logprobs=True
    )
    assert chat.choices[0].logprobs is not None
    content = chat.choices[0].logprobs.content
    assert content is not None and [t.token for t in content] == [hf.decode([100])] * 4


# --- logprobs -------------------------------------------------------------------------------------


def test_completion_logprobs_typed_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = {
        "model": model,
        "prompt": COUNT,
        "max_tokens": N,
        "logprobs": 3,
        "temperature": 0,
    }
    choice = client.completions.create(**args).choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == N
    assert "".join(lp.tokens).endswith(choice.text)
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and top[token] == token_lp == max(top.values())  # greedy: the top
        assert all(v <= 0 for v in top.values())
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:], strict=True):
        assert choice.text[offset:].startswith(token)
    tokens, offsets, values = [], [], []
    for chunk in client.completions.create(**args, stream=True):
        piece = chunk.choices[0].logprobs
        if piece is not None:
            tokens += piece.tokens or []
            offsets += piece.text_offset or []
            values += piece.token_logprobs or []
    assert (tokens, offsets) == (lp.tokens, lp.text_offset)
    assert values == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_echo_returns_the_prompt_and_its_tokens_logprobs(client: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = {
        "model": model,
        "prompt": COUNT,
        "max_tokens": N,
        "logprobs": 1,
        "temperature": 0,
    }
    plain = client.completions.create(**args).choices[0]
    out = client.completions.create(**args, echo=True).choices[0]
    assert out.text.startswith(COUNT) and out.text.endswith(plain.text)
    lp, plain_lp = out.logprobs, plain.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert plain_lp is not None and plain_lp.token_logprobs is not None
    k = len(lp.tokens) - N  # the prompt's tokens come first, the first without a logprob
    assert "".join(lp.tokens[:k]) == COUNT and lp.tokens[k:] == plain_lp.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[k:] == pytest.approx(plain_lp.token_logprobs, abs=1e-4)
    # max_tokens 0 scores the prompt alone.
    scored = client.completions.create(
        model=model, prompt=COUNT, max_tokens=0, echo=True, logprobs=0
    ).choices[0]
    assert scored.text == COUNT and scored.finish_reason == "length"
    assert scored.logprobs is not None and scored.logprobs.token_logprobs is not None
    assert scored.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:k], abs=1e-4)
    # Streamed: the prompt's text comes first, in one chunk.
    chunks = [c.choices[0].text for c in client.completions.create(**args, echo=True, stream=True)]
    assert chunks[0] == COUNT and "".join(chunks) == out.text


def test_text_offset_of_tokens_sent_together(client: openai.OpenAI, model: str) -> None:
    """Greedy after FOX, this model writes a lone byte (U+FFFD in the text) and then "ind": the
    worker sends both in one delta, and "ind" starts at 1 in "\ufffdind study..."."""
    choice = client.completions.create(
        model=model, prompt=FOX, max_tokens=6, logprobs=0, temperature=0
    ).choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert lp.tokens[:2] == ["\ufffd", "ind"]
    assert lp.text_offset[:2] == [0, 1]
    for i, (token, offset) in enumerate(zip(lp.tokens, lp.text_offset, strict=True)):
        if i and "\ufffd" not in token:
            assert choice.text[offset:].startswith(token), (i, token, offset, choice.text)


def test_chat_logprobs_typed_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = {
        "model": model,
        "messages": chat_of(COUNT),
        "max_tokens": N,
        "logprobs": True,
        "top_logprobs": 2,
        "temperature": 0,
    }
    out = client.chat.completions.create(**args)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    assert len(content) == N and all(isinstance(t, ChatCompletionTokenLogprob) for t in content)
    for item in content:
        assert item.bytes is not None and bytes(item.bytes).decode("utf-8", "replace") == item.token
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True
        )
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == item.logprob <= 0
    text = b"".join(bytes(t.bytes or []) for t in content).decode("utf-8")
    assert text.endswith(out.choices[0].message.content or "")
    streamed: list[ChatCompletionTokenLogprob] = []
    for chunk in client.chat.completions.create(**args, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                streamed += ch.logprobs.content or []
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    # logprobs without top_logprobs: each token's own, no alternatives; none asked: None.
    own = client.chat.completions.create(**{**args, "top_logprobs": None})
    assert own.choices[0].logprobs is not None and own.choices[0].logprobs.content
    assert all(t.top_logprobs == [] for t in own.choices[0].logprobs.content)
    none = client.chat.completions.create(model=model, messages=chat_of(COUNT), max_tokens=2)
    assert none.choices[0].logprobs is None


# --- several choices, several prompts -------------------------------------------------------------


def test_n_choices_have_their_own_index_and_seed(client: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = {"model": model, "prompt": FOX, "max_tokens": N, "temperature": 1.0}
    out = client.completions.create(**args, n=3, seed=40)
    assert [c.index for c in out.choices] == [0, 1, 2]
    # Choice i samples with seed + i: the same text as a one-choice request with that seed.
    alone = [client.completions.create(**args, seed=40 + i).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == alone and len(set(alone)) > 1
    assert out.usage is not None and out.usage.completion_tokens == 3 * N
    single = client.completions.create(**args, seed=40)
    assert single.usage is not None and out.usage.prompt_tokens == single.usage.prompt_tokens
    # Chat, streamed: the choices' chunks interleave under their index, one usage chunk.
    chat: dict[str, Any] = {
        "model": model,
        "messages": chat_of(FOX),
        "max_tokens": N,
        "temperature": 1.0,
        "seed": 7,
        "n": 2,
    }
    whole = client.chat.completions.create(**chat)
    texts: dict[int, str] = defaultdict(str)
    usage = []
    streamed = client.chat.completions.create(
        **chat, stream=True, stream_options={"include_usage": True}
    )
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
        if chunk.usage is not None:
            usage.append(chunk.usage)
    assert dict(texts) == {c.index: c.message.content for c in whole.choices}
    assert whole.usage is not None and whole.usage.completion_tokens == 2 * N
    assert usage == [whole.usage]


def test_a_list_of_prompts(client: openai.OpenAI, model: str, hf: Any) -> None:
    want = [greedy(client, model, FOX), greedy(client, model, COUNT)]
    out = client.completions.create(model=model, prompt=[FOX, COUNT], max_tokens=N, temperature=0)
    assert [(c.index, c.text) for c in out.choices] == list(enumerate(want))
    ids = [hf.encode(p, add_special_tokens=False) for p in (FOX, COUNT)]
    as_ids = client.completions.create(model=model, prompt=ids, max_tokens=N, temperature=0)
    assert [c.text for c in as_ids.choices] == want
    assert as_ids.usage is not None and as_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    # With n: choice index = prompt x n + i.
    both = client.completions.create(
        model=model, prompt=[FOX, COUNT], max_tokens=4, n=2, temperature=0
    )
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [
        greedy(client, model, p, 4) for p in (FOX, FOX, COUNT, COUNT)
    ]


# --- stop and token budget ------------------------------------------------------------------------


def test_stop_sequences_end_the_text_before_them(client: openai.OpenAI, model: str) -> None:
    full = greedy(client, model, FOX, 12)
    stop = full[len(full) // 2 :][:3]
    cut = full[: full.find(stop)]
    out = client.completions.create(
        model=model, prompt=FOX, max_tokens=12, temperature=0, stop=[stop, "never-seen-here"]
    )
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(
        model=model, prompt=FOX, max_tokens=12, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model=model, messages=chat_of(FOX), max_tokens=12, temperature=0
    )
    said = chat.choices[0].message.content or ""
    stop = said[len(said) // 2 :][:3]
    stopped = client.chat.completions.create(
        model=model, messages=chat_of(FOX), max_tokens=12, temperature=0, stop=stop
    )
    assert stopped.choices[0].message.content == said[: said.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_max_completion_tokens(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=chat_of(FOX), max_completion_tokens=3
    )
    assert out.usage is not None and out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"
    # The newer name wins over max_tokens.
    both = client.chat.completions.create(
        model=model, messages=chat_of(FOX), max_tokens=9, max_completion_tokens=2
    )
    assert both.usage is not None and both.usage.completion_tokens == 2


# --- roles and tools ------------------------------------------------------------------------------

TURNS: list[Any] = [{"role": "system", "content": "You are terse."}, *SDK_TURNS]


def test_a_tool_conversation(client: openai.OpenAI, model: str, hf: Any) -> None:
    """Every role the SDK sends back in a tool loop, with `tools`: on the model's own template
    and on a request's template, both rendering the tools and declaring a call format; the
    prompt is what the template makes of the messages, token for token."""
    own = client.chat.completions.create(
        model=model, messages=TURNS, tools=[WEATHER], max_tokens=4, temperature=0
    )
    text = hf.apply_chat_template(
        as_template_sees(TURNS), tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert own.usage is not None
    assert own.usage.prompt_tokens == len(hf.encode(text, add_special_tokens=False))
    extra = {"chat_template": TOOLS_TEMPLATE, "chat_template_kwargs": {"greeting": "Hi"}}
    templated = client.chat.completions.create(
        model=model,
        messages=TURNS,
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=4,
        temperature=0,
        extra_body=extra,
    )
    text = hf.apply_chat_template(
        as_template_sees(TURNS),
        tools=[WEATHER],
        chat_template=TOOLS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        greeting="Hi",
    )
    assert templated.usage is not None
    assert templated.usage.prompt_tokens == len(hf.encode(text, add_special_tokens=False))
    # Random weights write no tool call: the text comes back as content.
    for out in (own, templated):
        message = out.choices[0].message
        assert isinstance(message.content, str) and message.tool_calls is None
        assert out.choices[0].finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(
        model=model,
        messages=TURNS,
        tools=[WEATHER],
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    chunks = list(streamed)
    assert all(c.choices[0].delta.tool_calls is None for c in chunks)
    said = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert said == templated.choices[0].message.content


# --- errors ---------------------------------------------------------------------------------------

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "tail"}, "suffix"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"n": 17}, "n"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"extra_body": {"top_k": -2}}, "top_k"),
    ("chat", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("chat", {"logit_bias": {"1024": 5}}, "logit_bias"),
]


@pytest.mark.parametrize(("kind", "extra", "param"), REFUSED)
def test_refusals_are_bad_request_errors_naming_the_param(
    client: openai.OpenAI, model: str, kind: str, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "chat":
            client.chat.completions.create(
                model=model, messages=chat_of(FOX), max_tokens=2, **extra
            )
        else:
            client.completions.create(model=model, prompt=FOX, max_tokens=2, **extra)
    assert err.value.status_code == 400
    assert (err.value.type, err.value.param) == ("invalid_request_error", param)
    assert err.value.message


def test_past_the_admission_bound_is_a_rate_limit_error(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=model, prompt=FOX, max_tokens=2, n=16)
    assert err.value.status_code == 429 and err.value.code == "rate_limit_exceeded"
    assert err.value.response.headers["retry-after"] == "1"
    ok = client.completions.create(model=model, prompt=FOX, max_tokens=2, n=BOUND)
    assert len(ok.choices) == BOUND


def test_a_wrong_key_is_an_authentication_error(pool: Any, model: str) -> None:
    with _client(pool, key="sk-not-a-key") as wrong:
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.models.list()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=model, messages=chat_of(FOX), max_tokens=2)
