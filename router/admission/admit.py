"""Admission: a parsed OpenAI request becomes a shared.wire.GenerationRequest, or a refusal.

The answer is a value: `Admission(outcome, request | error)`. Each Outcome maps to exactly one
HTTP status and one OpenAI error body (OUTCOME_ERRORS), so handlers never pick a status code.
Runs in the threadpool (tokenization is CPU work).
"""

from __future__ import annotations

import enum
import json
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from router.admission.structured_output import FormatError, forced_call_grammar, grammar_for
from router.admission.tokenization import (
    MAX_CHARS_PER_TOKEN,
    RESERVED_TEMPLATE_KWARGS,
    ChatTemplateError,
    PromptTokenizer,
    PromptTooLong,
)
from router.admission.tool_calls import ToolCallStream
from router.edge.errors import APIError
from router.edge.openai_types import ChatCompletionRequest, ChatMessage, CompletionRequest
from shared.errors import ErrorKind
from shared.wire import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_SEED,
    MAX_STOP_TOKEN_IDS,
    GenerationRequest,
)

# OpenAI allows 4; the bound keeps the worker's per-step stop matching small.
MAX_STOP_SEQUENCES = 16

__all__ = [
    "MAX_CHARS_PER_TOKEN"
]  # the general characters-per-token bound, defined with the tokenizer

MAX_MESSAGES = 2048
# The most characters of a client's string (a model name) quoted back in an error message.
MAX_QUOTED_CHARS = 200
# Choices one request may ask for: n per prompt, times the prompts of a completions list. Each
# choice is its own sequence in a worker's batch (and its own reservation at admission); the
# choices of one prompt are placed together and share its prefill.
MAX_CHOICES = 16
MAX_PROMPTS = 16
MAX_TOTAL_CHOICES = 64


class Outcome(enum.StrEnum):
    ADMIT = "admit"
    INVALID = "invalid"
    UNKNOWN_MODEL = "unknown_model"
    CONTEXT_EXCEEDED = "context_exceeded"
    POOL_BUSY = "pool_busy"
    NO_WORKER = "no_worker"


# Outcome -> the pool's error kind (its status, type and code: shared.errors.SHAPES).
OUTCOME_ERRORS: dict[Outcome, ErrorKind] = {
    Outcome.INVALID: ErrorKind.INVALID_REQUEST,
    Outcome.UNKNOWN_MODEL: ErrorKind.UNKNOWN_MODEL,
    Outcome.CONTEXT_EXCEEDED: ErrorKind.CONTEXT_EXCEEDED,
    Outcome.POOL_BUSY: ErrorKind.POOL_BUSY,
    Outcome.NO_WORKER: ErrorKind.NO_LIVE_WORKER,
}


@dataclass
class Admission:
    outcome: Outcome
    request: GenerationRequest | None = None  # the first choice's
    # Every choice, in OpenAI's index order (prompt by prompt, n each); [request] when one.
    requests: list[GenerationRequest] = field(default_factory=list)
    # Completions `echo`: each choice's prompt text, which its text starts with; None: no echo.
    echo: list[str] | None = None
    message: str = ""
    param: str | None = None
    retry_after_s: int | None = None
    # Each prompt's block index members, one list a run of choices sharing it (the router's
    # placement: router.relay.submit), hashed with the admission, off the event loop.
    members: list[list[bytes]] = field(default_factory=list)
    # What the relay needs of the model, made before the enqueue (router.relay.submit): nothing
    # between a request's enqueue and its relay may wait on a thread or fail. The model's
    # context, and a chat request's tool-call splitter (None: its output is all content).
    context: AdmissionContext | None = None
    tool_streams: Callable[[], ToolCallStream] | None = None

    def error(self) -> APIError:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return APIError.of(OUTCOME_ERRORS[self.outcome], self.message, self.param, headers)


@dataclass(frozen=True)
class AdmissionContext:
    """What admission needs, built once in lifespan."""

    model_id: str
    tokenizer: PromptTokenizer
    default_max_tokens: int
    trust_request_chat_template: bool = False


class _Refused(Exception):
    def __init__(self, outcome: Outcome, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.admission = Admission(outcome, message=message, param=param)


def _invalid(message: str, param: str | None = None) -> _Refused:
    return _Refused(Outcome.INVALID, message, param)


def quoted(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """A client's string for an error message: whole when short, else its first `limit`
    characters, an ellipsis and its length (an error never echoes megabytes)."""
    if len(text) <= limit:
        return f"'{text}'"
    return f"'{text[:limit]}...' ({len(text)} characters)"


def _check_common(body: CompletionRequest | ChatCompletionRequest, ctx: AdmissionContext) -> None:
    if body.model is not None and body.model != ctx.model_id:
        raise _Refused(
            Outcome.UNKNOWN_MODEL,
            f"The model {quoted(body.model)} does not exist; this pool serves '{ctx.model_id}'.",
            "model",
        )
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise _invalid(f"'n' must be in [1, {MAX_CHOICES}], got {body.n}.", "n")
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED:
        raise _invalid(f"'seed' must be an integer in [0, 2**63 - 1], got {body.seed}.", "seed")
    # OpenAI's and vLLM's rule: options of a stream are an error on a request that is not one.
    if body.stream_options is not None and not body.stream:
        raise _invalid("'stream_options' is only allowed when 'stream' is true.", "stream_options")


# A logit_bias key: a token id written in decimal digits (JSON object keys are strings).
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _check_refused_fields(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Fields this pool does not serve: a value that asks for them is a 400, never ignored."""
    if isinstance(body, CompletionRequest):
        if body.best_of not in (None, 1):
            raise _invalid("Only best_of=1 is supported.", "best_of")
        if body.suffix:
            raise _invalid("'suffix' is not supported.", "suffix")


def _logprobs_asked(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """None: no logprobs; k: each token's logprob and its k most likely alternatives."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if not body.logprobs:
        if body.top_logprobs:
            raise _invalid("'top_logprobs' requires 'logprobs': true.", "top_logprobs")
        return None
    return body.top_logprobs or 0


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise _invalid(
            f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}.",
            "logit_bias",
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= vocab_size:
            raise _invalid(
                f"'logit_bias' keys must be token ids in [0, {vocab_size}) written as strings "
                f"of digits, got {key!r}.",
                "logit_bias",
            )
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise _invalid(
                f"'logit_bias' values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value} for token {key}.",
                "logit_bias",
            )
        out[int(key)] = float(value)
    return out


def _sampling_controls(
    body: CompletionRequest | ChatCompletionRequest, tok: PromptTokenizer
) -> dict[str, Any]:
    """The GenerationRequest fields of the controls past temperature and top_p, each checked
    (openai_types' Field bounds did the plain ranges) and neutral when omitted or null."""
    top_k = 0 if body.top_k is None else body.top_k
    if top_k < -1:
        raise _invalid(
            f"'top_k' must be -1 or 0 (off) or a positive integer, got {top_k}.", "top_k"
        )
    return {
        # -1 (vLLM's off) is 0 on the wire; k >= the vocabulary keeps every token: off too.
        "top_k": top_k if 0 < top_k < tok.vocab_size else 0,
        "min_p": 0.0 if body.min_p is None else float(body.min_p),
        "repetition_penalty": (
            1.0 if body.repetition_penalty is None else float(body.repetition_penalty)
        ),
        "presence_penalty": 0.0 if body.presence_penalty is None else float(body.presence_penalty),
        "frequency_penalty": (
            0.0 if body.frequency_penalty is None else float(body.frequency_penalty)
        ),
        "logit_bias": _logit_bias(body.logit_bias, tok.vocab_size),
        "logprobs": _logprobs_asked(body),
        "grammar": _grammar(body, tok),
        **_stopping(body, tok.vocab_size),
    }


def _stopping(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> dict[str, Any]:
    """vLLM's stopping extras as GenerationRequest fields (min_tokens against max_tokens is
    checked once the budget is known: `_min_tokens_fit`)."""
    min_tokens = 0 if body.min_tokens is None else body.min_tokens
    if min_tokens < 0:
        raise _invalid(f"'min_tokens' must be at least 0, got {min_tokens}.", "min_tokens")
    ids = list(body.stop_token_ids or [])
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(
            f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}.",
            "stop_token_ids",
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _invalid(
            f"'stop_token_ids' must be token ids in [0, {vocab_size}), got {bad}.",
            "stop_token_ids",
        )
    return {
        "ignore_eos": bool(body.ignore_eos),
        "min_tokens": min_tokens,
        "stop_token_ids": sorted(set(ids)),
        "include_stop_str_in_output": bool(body.include_stop_str_in_output),
    }


def _min_tokens_fit(min_tokens: int, max_tokens: int, param: str) -> None:
    if min_tokens > max_tokens:
        raise _invalid(
            f"'min_tokens' ({min_tokens}) must not exceed '{param}' ({max_tokens}).",
            "min_tokens",
        )


def _grammar(body: CompletionRequest | ChatCompletionRequest, tok: PromptTokenizer) -> str | None:
    """response_format as the llguidance grammar the worker enforces
    (router.admission.structured_output)."""
    try:
        return grammar_for(body.response_format, tok)
    except FormatError as exc:
        raise _invalid(str(exc), "response_format") from exc


def _requested_max_tokens(
    body: CompletionRequest | ChatCompletionRequest,
) -> tuple[str, int | None]:
    """(the param that names it, the count): OpenAI's newer name wins when both are sent."""
    if body.max_completion_tokens is not None:
        return "max_completion_tokens", body.max_completion_tokens
    return "max_tokens", body.max_tokens


def _stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _invalid(f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences.", "stop")
    return [s for s in stops if s]


def _max_tokens(
    requested: int | None,
    param: str,
    prompt_len: int,
    prompt_param: str,
    ctx: AdmissionContext,
    echo: bool = False,
) -> int:
    """The completion's token budget; 0 only with completions' `echo` (just the prompt back,
    and its logprobs when asked: OpenAI's way to score a text)."""
    context = ctx.tokenizer.context_length
    if requested is not None and requested < (0 if echo else 1):
        also = "" if echo or requested < 0 else " (0 only with 'echo': true)"
        raise _invalid(
            f"'{param}' must be at least {0 if echo else 1}{also}, got {requested}.", param
        )
    if requested is not None and requested > context:
        raise _invalid(
            f"'{param}' is {requested}, above the model's context length of {context}.", param
        )
    room = context - prompt_len
    wanted = requested if requested is not None else min(ctx.default_max_tokens, room)
    if room < (0 if requested == 0 else 1) or prompt_len + wanted > context:
        raise _Refused(
            Outcome.CONTEXT_EXCEEDED,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + max(wanted, 1)} tokens ({prompt_len} in the prompt, "
            f"{max(wanted, 1)} for the completion). Please reduce the prompt or '{param}'.",
            prompt_param,
        )
    return wanted


def _completion_prompts(body: CompletionRequest, tok: PromptTokenizer) -> list[list[int]]:
    """The token ids of each prompt: a string or token ids, or a list of either (a batch)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > MAX_PROMPTS:
            raise _invalid(f"'prompt' may hold at most {MAX_PROMPTS} prompts.", "prompt")
        return [_prompt_tokens(p, tok) for p in prompt]
    return [_prompt_tokens(prompt, tok)]


def _echo_texts(body: CompletionRequest, tok: PromptTokenizer) -> list[str]:
    """`echo`: each prompt's text, as `_completion_prompts` splits them: a string as sent, token
    ids decoded."""
    prompt = body.prompt
    batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
    prompts = list(prompt) if batch else [prompt]
    return [p if isinstance(p, str) else tok.decode(list(p)) for p in prompts]


def _prompt_tokens(prompt: str | list[int], tok: PromptTokenizer) -> list[int]:
    if isinstance(prompt, str):
        _fits_before_tokenizing(len(prompt), "prompt", tok)
        tokens = tok.encode(prompt) if prompt else []
    else:
        tokens = list(prompt)
        # min and max run in C: cheaper than a generator over a long prompt.
        if tokens and (min(tokens) < 0 or max(tokens) >= tok.vocab_size):
            raise _invalid(f"Token ids must be in [0, {tok.vocab_size}).", "prompt")
    if not tokens:
        raise _invalid("'prompt' must not be empty.", "prompt")
    return tokens


def _choices(first: GenerationRequest, n: int) -> list[GenerationRequest]:
    """n sequences of one prompt: the first as built, the others under their own request ids
    and, when seeded, seeds of their own (seed + i), so sampled choices differ reproducibly.
    With n > 1 they form one group (the first's request id): placed on one worker together,
    which computes their prompt once."""
    if n == 1:
        return [first]
    first = replace(first, group=first.request_id)
    out = [first]
    for i in range(1, n):
        seed = None if first.seed is None else (first.seed + i) % (MAX_SEED + 1)
        out.append(replace(first, request_id=uuid.uuid4().hex, seed=seed))
    return out


def _fits_before_tokenizing(
    chars: int, param: str, tok: PromptTokenizer, limit: int | None = None
) -> None:
    """Refuse text that cannot fit the context whatever it tokenizes to, so megabytes are never
    tokenized only to be refused: `limit` characters, by default the tokenizer's own bound
    (context length times the most characters one of its tokens covers)."""
    limit = tok.max_chars if limit is None else limit
    if chars > limit:
        raise _too_long(chars, param, tok, limit)


def _too_long(chars: int, param: str, tok: PromptTokenizer, limit: int) -> _Refused:
    return _Refused(
        Outcome.CONTEXT_EXCEEDED,
        f"'{param}' is {chars} characters: it cannot fit this model's context of "
        f"{tok.context_length} tokens (at most {limit} characters).",
        param,
    )


def _template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it (mlx_lm.server's and vLLM's shape): text content
    (null: ""), an assistant's tool calls with their arguments as a JSON object when they parse
    as one, a tool result's tool_call_id."""
    where = f"messages[{i}]"
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise _invalid(
            f"'{where}.content' may be null only in an assistant message with 'tool_calls'.",
            f"{where}.content",
        )
    if m.tool_calls is not None and m.role != "assistant":
        raise _invalid(
            f"'{where}.tool_calls' belongs to assistant messages only.", f"{where}.tool_calls"
        )
    if m.role == "tool" and not m.tool_call_id:
        raise _invalid(f"'{where}' (role 'tool') requires 'tool_call_id'.", f"{where}.tool_call_id")
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            try:
                arguments: Any = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments  # the template gets the string as sent
            fn = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": fn})
        out["tool_calls"] = calls
    return out


def _forces_call(body: ChatCompletionRequest) -> bool:
    """tool_choice "required" or a named function: the model must write a call."""
    return body.tool_choice is not None and body.tool_choice not in ("auto", "none")


def _forced_call(
    body: ChatCompletionRequest, tools: list[dict[str, Any]] | None, tok: PromptTokenizer
) -> str | None:
    """The grammar that makes the model write the call tool_choice forces (exactly one, in the
    template's tool-call format), or None when it forces none."""
    choice = body.tool_choice
    if not tools or choice is None or not _forces_call(body):
        return None
    name = None if isinstance(choice, str) else choice.function.name  # "required": any tool
    if body.response_format not in (None, {"type": "text"}):
        raise _invalid(
            "A 'tool_choice' that forces a call cannot be combined with a 'response_format'.",
            "tool_choice",
        )
    try:
        return forced_call_grammar(tools, name, tok.tool_parser(body.chat_template), tok)
    except FormatError as exc:
        raise _invalid(str(exc), exc.param or "tool_choice") from exc


def chat_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the template renders (and the parser may type arguments by): none when
    tool_choice is "none"; a named tool_choice must name one of them."""
    if not body.tools and body.tool_choice not in (None, "none", "auto"):
        raise _invalid("'tool_choice' requires 'tools'.", "tool_choice")
    if not body.tools or body.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    choice = body.tool_choice
    if not isinstance(choice, str) and choice is not None:
        names = {t.function.name for t in body.tools}
        if choice.function.name not in names:
            raise _invalid(
                f"'tool_choice' names the function {choice.function.name!r}, "
                "which 'tools' does not declare.",
                "tool_choice",
            )
    return tools


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    if not kwargs:
        return None
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise _invalid(
            f"'chat_template_kwargs' may not set {', '.join(reserved)} (request fields and the "
            "template call set them).",
            "chat_template_kwargs",
        )
    return kwargs


def _chat_tokens(
    body: ChatCompletionRequest, ctx: AdmissionContext, **render: bool
) -> tuple[list[int], str]:
    """The prompt's ids and template signature; `render`: encode_chat's keyword flags (only
    POST /tokenize sets them)."""
    tok = ctx.tokenizer
    if not body.messages:
        raise _invalid("'messages' must be a non-empty list.", "messages")
    if len(body.messages) > MAX_MESSAGES:
        raise _invalid(f"'messages' may hold at most {MAX_MESSAGES} messages.", "messages")
    if body.chat_template is not None and not ctx.trust_request_chat_template:
        raise _invalid(
            "A request's own 'chat_template' is not accepted by this pool (its operator can "
            "allow it with MLXCEL_TRUST_REQUEST_CHAT_TEMPLATE=true).",
            "chat_template",
        )
    messages = [_template_message(i, m) for i, m in enumerate(body.messages)]
    tools = chat_tools(body)
    kwargs = _template_kwargs(body.chat_template_kwargs)
    chars = sum(len(m["content"]) for m in messages) + sum(
        len(json.dumps(t, ensure_ascii=False)) for t in tools or []
    )
    # The general bound before rendering (a template may leave some content out), the
    # tokenizer's own on the rendered text, before it is encoded (encode_chat).
    _fits_before_tokenizing(chars, "messages", tok, tok.context_length * MAX_CHARS_PER_TOKEN)
    try:
        tokens, signature = tok.encode_chat(messages, body.chat_template, tools, kwargs, **render)
    except ChatTemplateError as exc:
        raise _invalid(str(exc), "chat_template") from exc
    except PromptTooLong as exc:
        raise _too_long(exc.chars, "messages", tok, exc.limit) from exc
    if not tokens:
        raise _invalid("The chat template rendered an empty prompt.", "messages")
    return tokens, signature


def _build(
    model_id: str,
    body: CompletionRequest | ChatCompletionRequest,
    tokens: list[int],
    max_tokens: int,
    signature: str,
    controls: dict[str, Any],
) -> GenerationRequest:
    return GenerationRequest(
        request_id=uuid.uuid4().hex,
        model=model_id,
        prompt_tokens=tokens,
        max_tokens=max_tokens,
        temperature=0.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=body.seed,
        **controls,
        stop=_stop_list(body.stop),
        session_key=body.prompt_cache_key or body.user or "",
        template_signature=signature,
        enqueued_at=time.time(),
        stream=bool(body.stream),
    )


def admit_completion(body: CompletionRequest, ctx: AdmissionContext) -> Admission:
    try:
        _check_common(body, ctx)
        _check_refused_fields(body)
        _stop_list(body.stop)
        controls = _sampling_controls(body, ctx.tokenizer)
        echo = bool(body.echo)
        # echo with logprobs: the prompt's tokens' logprobs too (the worker's scoring pass).
        controls["prompt_logprobs"] = controls["logprobs"] if echo else None
        controls["echo"] = echo
        prompts = _completion_prompts(body, ctx.tokenizer)
        n = body.n or 1
        if len(prompts) * n > MAX_TOTAL_CHOICES:
            raise _invalid(
                f"{len(prompts)} prompts x n={n} is more than {MAX_TOTAL_CHOICES} choices.", "n"
            )
        param, requested = _requested_max_tokens(body)
        gens: list[GenerationRequest] = []
        for tokens in prompts:
            max_tokens = _max_tokens(requested, param, len(tokens), "prompt", ctx, echo)
            _min_tokens_fit(controls["min_tokens"], max_tokens, param)
            gens += _choices(_build(ctx.model_id, body, tokens, max_tokens, "", controls), n)
        texts = _echo_texts(body, ctx.tokenizer) if echo else None
        per_choice = [texts[i // n] for i in range(len(gens))] if texts else None
        return Admission(Outcome.ADMIT, gens[0], requests=gens, echo=per_choice)
    except _Refused as refused:
        return refused.admission


def admit_chat(body: ChatCompletionRequest, ctx: AdmissionContext) -> Admission:
    try:
        _check_common(body, ctx)
        _check_refused_fields(body)
        _stop_list(body.stop)
        controls = _sampling_controls(body, ctx.tokenizer)
        forced = _forced_call(body, chat_tools(body), ctx.tokenizer)
        if forced is not None:
            controls["grammar"] = forced
        tokens, signature = _chat_tokens(body, ctx)
        param, requested = _requested_max_tokens(body)
        max_tokens = _max_tokens(requested, param, len(tokens), "messages", ctx)
        _min_tokens_fit(controls["min_tokens"], max_tokens, param)
        gen = _build(ctx.model_id, body, tokens, max_tokens, signature, controls)
        return Admission(Outcome.ADMIT, gen, requests=_choices(gen, body.n or 1))
    except _Refused as refused:
        return refused.admission


def chat_prompt_tokens(
    body: ChatCompletionRequest,
    ctx: AdmissionContext,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """The ids a chat completion of `body` would prompt with (the same checks, template, tools
    and bounds as `admit_chat`, so the counts agree; /tokenize of messages, the Messages API's
    count_tokens), or its refusal as an APIError. Blocking: call it off the event loop."""
    try:
        _check_common(body, ctx)
        render = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "add_special_tokens": add_special_tokens,
        }
        return _chat_tokens(body, ctx, **render)[0]
    except _Refused as refused:
        raise refused.admission.error() from None


def completion_prompt_tokens(
    prompt: str, ctx: AdmissionContext, add_special_tokens: bool = True
) -> list[int]:
    """POST /tokenize of a prompt: its ids as a completion of it would prompt with (with the
    same bound on its length before tokenizing), or its refusal as an APIError. Blocking."""
    try:
        _fits_before_tokenizing(len(prompt), "prompt", ctx.tokenizer)
    except _Refused as refused:
        raise refused.admission.error() from None
    return ctx.tokenizer.encode(prompt, add_special_tokens) if prompt else []
