"""vLLM's per-request stopping extras (`ignore_eos`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`) and the completion's first leading space.

Text level: TextStream's stop-string rules. Engine level (the real tiny model, no pool): each
extra against the model's own greedy tokens, alone and in one batch with requests without
them. Pool level (shared_pool): both endpoints, streamed and not, many mixed requests at once,
and admission's 400s naming the param.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.config import load_settings
from shared.model_facts import model_facts
from shared.wire import MAX_STOP_TOKEN_IDS, GenerationRequest, WireError, pack, unpack
from tests.conftest import continuation
from tests.pool_fixture import post, sse_events
from tests.streams import TINY_MODEL
from worker.engine.engine import Engine
from worker.engine.grammar_compile import InlineExecutor
from worker.engine.text_stream import TextStream
from worker.main import _prompt_cache

P1 = [5, 6, 7, 8, 9, 10]  # greedy: no EOS within 26 tokens
EOS_PROMPT = [100, 200, 300, 400]  # greedy: an EOS after some twenty tokens
COUNTING = "1, 2, 3, 4, 5,"  # greedy: the first token is a space-led word
CHAT = [{"role": "user", "content": "Say something"}]  # the assistant's first: space-led
LONG = [(17 + i * 13) % 1000 + 5 for i in range(60)]


@dataclass
class Tiny:
    model: Any
    tokenizer: Any
    model_id: str
    context_length: int

    @property
    def eos(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Tiny:
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_dir))
    facts = model_facts(tiny_model_dir)
    return Tiny(model, tokenizer, facts.model_id, facts.context_length)


def decoded_after(tiny: Tiny, prompt: list[int], completion: list[int]) -> str:
    """The tokenizer's own decode of prompt and completion, less the prompt's: OpenAI's and
    vLLM's completion text."""
    head = tiny.tokenizer.decode(list(prompt))
    whole = tiny.tokenizer.decode(list(prompt) + list(completion))
    assert whole.startswith(head)
    return whole[len(head) :]


def greedy(tiny: Tiny, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy tokens, EOS included (the reference the engine must equal)."""
    from mlx_lm import stream_generate

    return [r.token for r in stream_generate(tiny.model, tiny.tokenizer, prompt, max_tokens=n)]


# -- text level ---------------------------------------------------------------------------------


def _stream(tiny: Tiny, text: str, stop: list[str], **kw: Any) -> tuple[str, bool]:
    """(the text a client gets, whether a stop string ended it) for `text`'s tokens."""
    stream = TextStream(tiny.tokenizer.detokenizer, stop, **kw)
    out = ""
    for t in tiny.tokenizer.encode(text, add_special_tokens=False):
        delta = stream.push(t)
        out += delta.text
        if delta.stopped:
            return out + stream.finish(), True
    return out + stream.finish(), False


def test_include_stop_str_keeps_the_stop_string_and_drops_what_follows(tiny: Tiny) -> None:
    assert _stream(tiny, "alpha beta STOP gamma", ["STOP"]) == ("alpha beta ", True)
    got = _stream(tiny, "alpha beta STOP gamma", ["STOP"], include_stop=True)
    assert got == ("alpha beta STOP", True)


def test_stop_strings_wait_for_min_tokens(tiny: Tiny) -> None:
    text = "a b c d c e"
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    pieces = [tiny.tokenizer.decode([t]) for t in ids]
    first_c = pieces.index(" c")
    assert _stream(tiny, text, [" c"]) == ("a b", True)
    # The first " c" lies within the first min_tokens tokens: only the second one stops it.
    got = _stream(tiny, text, [" c"], min_tokens=first_c + 1)
    assert got == ("a b c d", True)
    assert _stream(tiny, text, [" c"], min_tokens=len(ids)) == (text, False)
    # vLLM's window: a stop string that ends in the text of a token past min_tokens matches,
    # even when it starts before (" b" is within min_tokens, " c" after).
    assert _stream(tiny, text, ["b c"], min_tokens=first_c) == ("a ", True)


# -- engine level -------------------------------------------------------------------------------


@dataclass
class Outcome:
    tokens: list[int]
    text: str
    finish: str | None
    completion_tokens: int
    cached_tokens: int


def engine(tiny: Tiny, cache: bool = False) -> Engine:
    cfg = load_settings(
        overrides={
            "worker": {"batch_size": 8, "prefill_batch_size": 8},
            "prompt_cache": {"storage": "dense", "min_prefix_tokens": 16},
        },
        environ={},
    )
    pc = _prompt_cache(cfg, tiny.model, tiny.model_id, "w-extras")[0] if cache else None
    return Engine(
        tiny.model,
        tiny.tokenizer,
        cfg.worker,
        model_id=tiny.model_id,
        worker_id="w-extras",
        context_length=tiny.context_length,
        prompt_cache=pc,
        grammar_executor=InlineExecutor(),
    )


def spec(rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, model=TINY_MODEL, prompt_tokens=list(prompt), max_tokens=max_tokens, **kw
    )


def run(eng: Engine, specs: list[GenerationRequest]) -> dict[str, Outcome]:
    """Admit every spec at once (one batch), step until all end; each one's outcome."""
    events: dict[str, list[Any]] = {s.request_id: [] for s in specs}
    results = [eng.admit(s) for s in specs]
    for _ in range(200):
        if not eng.active:
            break
        results.append(eng.step())
    assert eng.active == 0
    for res in results:
        for req, evs in res.events.items():
            events[req.id].extend(evs)
    out = {}
    for rid, evs in events.items():
        done = evs[-1]
        assert done.kind == "done", evs
        deltas = [e for e in evs if e.kind == "delta"]
        tokens = [t for e in deltas for t in e.token_ids]
        text = "".join(e.text for e in deltas)
        out[rid] = Outcome(
            tokens, text, done.finish_reason, done.completion_tokens, done.cached_tokens
        )
    return out


def alone(tiny: Tiny, s: GenerationRequest) -> Outcome:
    return run(engine(tiny), [s])[s.request_id]


def first_new(tokens: list[int], start: int = 2) -> int:
    """The index of the first token from `start` on that did not come before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_ignore_eos_runs_past_eos_to_max_tokens(tiny: Tiny) -> None:
    want = greedy(tiny, EOS_PROMPT, 26)
    end = next(i for i, t in enumerate(want) if t in tiny.eos)
    plain = alone(tiny, spec("p", EOS_PROMPT, 26))
    assert (plain.tokens, plain.finish, plain.completion_tokens) == (want[:end], "stop", end)
    got = alone(tiny, spec("i", EOS_PROMPT, 26, ignore_eos=True))
    assert (got.finish, got.completion_tokens) == ("length", 26)
    assert got.tokens[: end + 1] == want[: end + 1] and got.tokens[end] in tiny.eos
    # The EOS is a special token: it counts, but has no text (vLLM skips special tokens).
    texted = [t for t in got.tokens if t not in tiny.eos]
    assert got.text == continuation(tiny.tokenizer, EOS_PROMPT, texted)
    assert "<|" not in got.text


def test_a_first_token_eos_returns_tokens_with_ignore_eos(tiny: Tiny) -> None:
    forced = {tiny.eos[0]: 100.0}  # EOS is every step's token
    plain = alone(tiny, spec("p", P1, 5, logit_bias=forced))
    assert (plain.tokens, plain.text, plain.finish, plain.completion_tokens) == ([], "", "stop", 0)
    got = alone(tiny, spec("i", P1, 5, logit_bias=forced, ignore_eos=True))
    assert (got.tokens, got.finish, got.completion_tokens) == ([tiny.eos[0]] * 5, "length", 5)


def test_ignore_eos_and_min_tokens_hold_on_a_fast_start(tiny: Tiny) -> None:
    """A prompt-cache hit samples its first token outside the batch: the same rules apply."""
    eng = engine(tiny, cache=True)
    forced = {tiny.eos[0]: 100.0}
    run(eng, [spec("warm", LONG, 2)])
    got = run(eng, [spec("i", LONG, 4, logit_bias=forced, ignore_eos=True)])["i"]
    assert got.cached_tokens > len(LONG) - 16  # a hit: the first token sampled outside the batch
    assert (got.tokens, got.finish) == ([tiny.eos[0]] * 4, "length")
    held = run(eng, [spec("m", LONG, 8, logit_bias=forced, min_tokens=3)])["m"]
    assert held.cached_tokens > len(LONG) - 16
    assert (held.completion_tokens, held.finish) == (3, "stop")
    assert not set(held.tokens) & set(tiny.eos)


def test_min_tokens_keeps_eos_and_stop_tokens_back(tiny: Tiny) -> None:
    forced = {tiny.eos[0]: 100.0}
    got = alone(tiny, spec("m", P1, 8, logit_bias=forced, min_tokens=3))
    assert (got.completion_tokens, got.finish) == (3, "stop")
    assert len(got.tokens) == 3 and not set(got.tokens) & set(tiny.eos)
    stop_id = 777
    got = alone(tiny, spec("s", P1, 8, logit_bias={stop_id: 100.0}, stop_token_ids=[stop_id]))
    assert (got.tokens, got.finish) == ([], "stop")
    got = alone(
        tiny, spec("s", P1, 8, logit_bias={stop_id: 100.0}, stop_token_ids=[stop_id], min_tokens=2)
    )
    assert (got.completion_tokens, got.finish) == (2, "stop") and stop_id not in got.tokens


def test_a_stop_token_id_ends_it_out_of_the_text(tiny: Tiny) -> None:
    want = greedy(tiny, P1, 12)
    k = first_new(want)
    got = alone(tiny, spec("s", P1, 12, stop_token_ids=[want[k], 1000]))
    assert (got.tokens, got.finish, got.completion_tokens) == (want[:k], "stop", k)
    assert got.text == continuation(tiny.tokenizer, P1, want[:k])


def test_a_stop_token_id_past_the_vocabulary_fails_the_job_alone(tiny: Tiny) -> None:
    """A job no router would write (the router's 400 comes first) fails as the caller's."""
    eng = engine(tiny)
    vocab = int(tiny.model.args.vocab_size)
    res = eng.admit(spec("bad", P1, 4, stop_token_ids=[vocab]))
    (events,) = res.events.values()
    assert [e.kind for e in events] == ["error"]
    assert events[0].error_type == "invalid_request_error" and "stop_token_ids" in events[0].error
    assert eng.active == 0 and run(eng, [spec("ok", P1, 4)])["ok"].completion_tokens == 4


def test_a_batch_mixing_extras_gives_each_its_own_result(tiny: Tiny) -> None:
    """One batch: requests with and without the extras, each as it runs alone."""
    want = greedy(tiny, P1, 12)
    forced = {tiny.eos[0]: 100.0}
    specs = [
        spec("plain", P1, 12),
        spec("plain-eos", EOS_PROMPT, 26),
        spec("ignore", EOS_PROMPT, 26, ignore_eos=True),
        spec("stop-id", P1, 12, stop_token_ids=[want[first_new(want)]]),
        spec("min", P1, 8, logit_bias=forced, min_tokens=4),
        spec("forced", P1, 8, logit_bias=forced),
        spec("include", P1, 12, stop=["reen"], include_stop_str_in_output=True),
        spec("late-stop", P1, 12, stop=["4"], min_tokens=5),
    ]
    together = run(engine(tiny), specs)
    for s in specs:
        assert together[s.request_id] == alone(tiny, s), s.request_id
    assert together["plain"].tokens == want
    assert together["ignore"].completion_tokens == 26
    assert together["forced"].tokens == [] and together["min"].completion_tokens == 4
    assert together["include"].text.endswith("reen") and together["include"].finish == "stop"
    full = continuation(tiny.tokenizer, P1, want)
    assert together["include"].text == full[: full.index("reen") + 4]
    # The "4"s among the first five tokens do not stop it; the one after them does.
    late = together["late-stop"]
    head = continuation(tiny.tokenizer, P1, want[:5])
    assert late.finish == "stop" and late.text == full[: full.index("4", len(head))]


def test_the_first_leading_space_is_kept(tiny: Tiny) -> None:
    prompt = list(tiny.tokenizer.encode(COUNTING))
    want = greedy(tiny, prompt, 6)
    assert tiny.tokenizer.decode(want[:1]).startswith(" ")
    got = alone(tiny, spec("c", prompt, 6))
    assert got.tokens == want and got.text.startswith(" ")
    assert got.text == decoded_after(tiny, prompt, want)


# -- the wire -----------------------------------------------------------------------------------


def test_the_extras_cross_the_wire_and_stay_off_it_at_their_defaults() -> None:
    base = spec("w", P1, 8)
    assert not {"ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output"} & set(
        base.to_wire()
    )
    used = spec(
        "w",
        P1,
        8,
        ignore_eos=True,
        min_tokens=8,
        stop_token_ids=[3, 9],
        include_stop_str_in_output=True,
    )
    assert GenerationRequest.from_wire(unpack(pack(used.to_wire()))) == used
    for bad in (
        {"min_tokens": 9},
        {"min_tokens": -1},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": [1.5]},
        {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
        {"ignore_eos": 1},
    ):
        with pytest.raises(WireError):
            GenerationRequest.from_wire({**base.to_wire(), **bad})


# -- pool level ---------------------------------------------------------------------------------


def _ids(tiny: Tiny, kind: str, prompt: str) -> list[int]:
    if kind == "chat":
        return list(
            tiny.tokenizer.apply_chat_template(_messages(prompt), add_generation_prompt=True)
        )
    return list(tiny.tokenizer.encode(prompt))


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


async def _call(
    client: httpx.AsyncClient, kind: str, prompt: str, stream: bool, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": TINY_MODEL, "temperature": 0, **extra}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        resp = await client.post(
            "/v1/chat/completions", json={**body, "messages": _messages(prompt)}
        )
    else:
        resp = await client.post("/v1/completions", json={**body, "prompt": prompt})
    assert resp.status_code == 200, resp.text
    if not stream:
        data = resp.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        return {
            "text": text,
            "finish": choice["finish_reason"],
            "usage": data["usage"],
            "pieces": [text],
        }
    chunks = sse_events(resp)
    pieces, finish = [], None
    for c in chunks:
        for ch in c["choices"]:
            pieces.append((ch["delta"].get("content") or "") if kind == "chat" else ch["text"])
            finish = ch.get("finish_reason") or finish
    return {
        "text": "".join(pieces),
        "finish": finish,
        "usage": chunks[-1]["usage"],
        "pieces": pieces,
    }


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_extras_on_both_endpoints_at_once(
    shared_pool: Any, tiny: Tiny, kind: str, stream: bool
) -> None:
    """Many requests at once, with and without the extras: one worker batches them, and each
    gets its own rule's result."""
    prompt = COUNTING if kind == "completions" else CHAT[0]["content"]
    ids = _ids(tiny, kind, prompt)
    want = greedy(tiny, ids, 8)
    assert not set(want) & set(tiny.eos)
    full = continuation(tiny.tokenizer, ids, want)
    # The stop token: the first that differs from the first (the first itself if none does).
    k = next((i for i, t in enumerate(want) if t != want[0]), 0)
    stop = full[2:5]
    at = full.index(stop)
    forced = {str(tiny.eos[0]): 100}
    cases: dict[str, dict[str, Any]] = {
        "plain": {"max_tokens": 8},
        "forced-eos": {"max_tokens": 5, "logit_bias": forced},
        "ignore-eos": {"max_tokens": 5, "logit_bias": forced, "ignore_eos": True},
        "min-tokens": {"max_tokens": 8, "logit_bias": forced, "min_tokens": 3},
        "stop-id": {"max_tokens": 8, "stop_token_ids": [want[k]]},
        "include": {"max_tokens": 8, "stop": [stop], "include_stop_str_in_output": True},
        "exclude": {"max_tokens": 8, "stop": [stop], "include_stop_str_in_output": False},
    }

    async def all_at_once() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=shared_pool.url, timeout=120) as client:
            return await asyncio.gather(
                *(_call(client, kind, prompt, stream, **body) for body in cases.values())
            )

    got = dict(zip(cases, asyncio.run(all_at_once()), strict=True))
    for name, res in got.items():
        assert res["usage"]["prompt_tokens"] == len(ids), name
    plain = got["plain"]
    # The first leading space is kept: the text continues the prompt's, as OpenAI's and vLLM's.
    assert plain["text"] == full == decoded_after(tiny, ids, want) and full.startswith(" ")
    assert next(p for p in plain["pieces"] if p).startswith(" ")
    assert (got["forced-eos"]["text"], got["forced-eos"]["finish"]) == ("", "stop")
    assert got["forced-eos"]["usage"]["completion_tokens"] == 0
    assert (got["ignore-eos"]["text"], got["ignore-eos"]["finish"]) == ("", "length")
    assert got["ignore-eos"]["usage"]["completion_tokens"] == 5
    assert got["min-tokens"]["finish"] == "stop"
    assert got["min-tokens"]["usage"]["completion_tokens"] == 3
    assert got["stop-id"]["finish"] == "stop"
    assert got["stop-id"]["usage"]["completion_tokens"] == k
    assert got["stop-id"]["text"] == continuation(tiny.tokenizer, ids, want[:k])
    assert (got["include"]["text"], got["include"]["finish"]) == (full[: at + len(stop)], "stop")
    assert (got["exclude"]["text"], got["exclude"]["finish"]) == (full[:at], "stop")


def test_chat_keeps_the_assistants_leading_space(shared_pool: Any, tiny: Tiny) -> None:
    """A forced space-led token: the content starts with its space, streamed or not."""
    space_led = tiny.tokenizer.encode(" the")
    assert len(space_led) == 1
    body = {"messages": CHAT, "max_tokens": 3, "logit_bias": {str(space_led[0]): 100}}
    resp = post(shared_pool, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == " the the the"
    streamed = post(shared_pool, "/v1/chat/completions", {**body, "stream": True})
    contents = [
        c["choices"][0]["delta"].get("content") or "" for c in sse_events(streamed) if c["choices"]
    ]
    assert "".join(contents) == " the the the"
    assert next(c for c in contents if c) == " the"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"min_tokens": "2"}, "min_tokens"),
        ({"stop_token_ids": [1024]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["5"]}, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ],
)
def test_bad_extras_are_a_400_naming_the_param(
    shared_pool: Any, path: str, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 4, **extra}
    body |= {"messages": CHAT} if "chat" in path else {"prompt": COUNTING}
    resp = post(shared_pool, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert (err["param"] or "").startswith(param), err
    assert param in err["message"]
