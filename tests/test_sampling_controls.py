"""Every sampling control and logprobs, on the real tiny model.

In-process through the Engine (as tests/test_engine.py): each control's effect, checked against
a plain reference decoder (a full forward pass per token, the control's formula applied in
numpy), controls mixed in ONE batch, seeds, and logprobs against the reference log-softmax.
Then through a real pool (router processes, a worker, Redis, HTTP): the OpenAI shapes of
logprobs, streamed and not, and the 400s that refuse bad values and unserved fields.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from shared.model_facts import model_facts
from shared.wire import GenerationRequest
from tests.pool_fixture import ok, post, sse_events
from tests.test_engine import (
    LONG,
    P1,
    P2,
    P3,
    Model,
    Run,
    alone,
    make_cache,
    make_engine,
    run_until_done,
    spec,
)

N = 12  # tokens per engine request
Adjust = Callable[[np.ndarray, list[int], list[int]], np.ndarray]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Model:
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_dir))
    facts = model_facts(tiny_model_dir)
    return Model(model, tokenizer, facts.model_id, facts.context_length)


@pytest.fixture(scope="module")
def counting(tiny: Model) -> list[int]:
    """ "1, 2, 3, 4, 5,": greedy answers " good parent good parent ... parent parent" (random
    weights repeat tokens), so every penalty changes its greedy continuation."""
    return list(tiny.tokenizer.encode("1, 2, 3, 4, 5,"))


@pytest.fixture(scope="module")
def fox(tiny: Model) -> list[int]:
    return list(tiny.tokenizer.encode("The quick brown fox"))


def reference_logits(tiny: Model, tokens: list[int]) -> np.ndarray:
    """The model's next-token logits after `tokens`: one full forward pass, no cache."""
    logits = tiny.model(mx.array([tokens]))[0, -1, :].astype(mx.float32)
    return np.array(logits).astype(np.float64)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def reference_greedy(
    tiny: Model, prompt: list[int], n: int = N, adjust: Adjust | None = None
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens (EOS left out) and each step's log-softmax, `adjust` applied to the logits
    as the control's formula says."""
    out: list[int] = []
    dists: list[np.ndarray] = []
    for _ in range(n):
        z = reference_logits(tiny, prompt + out)
        if adjust is not None:
            z = adjust(z, prompt, out)
        lp = log_softmax(z)
        token = int(np.argmax(lp))
        if token in tiny.tokenizer.eos_token_ids:
            break
        out.append(token)
        dists.append(lp)
    return out, dists


def repetition(penalty: float) -> Adjust:
    def adjust(z: np.ndarray, prompt: list[int], out: list[int]) -> np.ndarray:
        for t in set(prompt + out):
            z[t] = z[t] * penalty if z[t] < 0 else z[t] / penalty
        return z

    return adjust


def frequency_presence(freq: float, pres: float) -> Adjust:
    def adjust(z: np.ndarray, prompt: list[int], out: list[int]) -> np.ndarray:
        for t, count in Counter(out).items():
            z[t] -= freq * count + pres
        return z

    return adjust


def bias(table: dict[int, float]) -> Adjust:
    def adjust(z: np.ndarray, prompt: list[int], out: list[int]) -> np.ndarray:
        for t, b in table.items():
            z[t] += b
        return z

    return adjust


def tokens_of(tiny: Model, s: GenerationRequest) -> list[int]:
    return alone(tiny, s).tokens(s.request_id)


def entries(run: Run, rid: str) -> list[list[Any]]:
    return [e for ev in run.events[rid] if ev.kind == "delta" for e in ev.logprobs]


# -- each control's effect --------------------------------------------------------------------


def test_neutral_controls_are_plain_greedy(tiny: Model, counting: list[int]) -> None:
    plain = tokens_of(tiny, spec("g", counting, N))
    neutral = spec(
        "n",
        counting,
        N,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        top_p=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logit_bias={},
    )
    assert tokens_of(tiny, neutral) == plain == reference_greedy(tiny, counting)[0]


def test_logit_bias_forces_and_bans_tokens(tiny: Model, counting: list[int]) -> None:
    plain = tokens_of(tiny, spec("g", counting, N))
    forced = 100 if 100 not in plain else 101
    assert tokens_of(tiny, spec("f", counting, N, logit_bias={forced: 100.0})) == [forced] * N
    # Banning greedy's favourites: they never appear, and the rest follows the formula.
    banned = {t: -100.0 for t in set(plain)}
    got = tokens_of(tiny, spec("b", counting, N, logit_bias=banned))
    assert not set(got) & set(banned)
    assert got == reference_greedy(tiny, counting, adjust=bias(banned))[0]
    # A sampled request is forced as well (the bias comes before temperature).
    hot = spec("h", counting, N, temperature=1.5, seed=3, logit_bias={forced: 100.0})
    assert tokens_of(tiny, hot) == [forced] * N


def test_top_k_one_is_greedy_at_high_temperature(tiny: Model, fox: list[int]) -> None:
    greedy = tokens_of(tiny, spec("g", fox, N))
    hot = {"temperature": 2.0, "seed": 11}
    assert tokens_of(tiny, spec("t", fox, N, **hot)) != greedy  # the temperature samples
    assert tokens_of(tiny, spec("k", fox, N, top_k=1, **hot)) == greedy
    # top_k at least the vocabulary keeps every token: the same draws as no top_k.
    vocab = int(tiny.model.args.vocab_size)
    assert tokens_of(tiny, spec("v", fox, N, top_k=vocab, **hot)) == tokens_of(
        tiny, spec("t", fox, N, **hot)
    )


def test_min_p_one_and_tiny_top_p_are_greedy_at_high_temperature(
    tiny: Model, fox: list[int]
) -> None:
    greedy = tokens_of(tiny, spec("g", fox, N))
    hot = {"temperature": 2.0, "seed": 11}
    assert tokens_of(tiny, spec("m", fox, N, min_p=1.0, **hot)) == greedy
    assert tokens_of(tiny, spec("p", fox, N, top_p=1e-6, **hot)) == greedy


def test_repetition_penalty_changes_the_greedy_continuation(
    tiny: Model, counting: list[int]
) -> None:
    plain = tokens_of(tiny, spec("g", counting, N))
    got = tokens_of(tiny, spec("r", counting, N, repetition_penalty=1.5))
    assert got != plain
    assert got == reference_greedy(tiny, counting, adjust=repetition(1.5))[0]
    assert len(set(got)) > len(set(plain))


@pytest.mark.parametrize(("freq", "pres"), [(1.5, 0.0), (0.0, 1.5), (0.7, -0.4)])
def test_frequency_and_presence_penalties_follow_openai_formula(
    tiny: Model, counting: list[int], freq: float, pres: float
) -> None:
    plain = tokens_of(tiny, spec("g", counting, N))
    got = tokens_of(tiny, spec("fp", counting, N, frequency_penalty=freq, presence_penalty=pres))
    assert got != plain
    assert got == reference_greedy(tiny, counting, adjust=frequency_presence(freq, pres))[0]


def test_a_negative_frequency_penalty_repeats_more(tiny: Model, fox: list[int]) -> None:
    plain = tokens_of(tiny, spec("g", fox, N))
    got = tokens_of(tiny, spec("neg", fox, N, frequency_penalty=-2.0))
    assert got == reference_greedy(tiny, fox, adjust=frequency_presence(-2.0, 0.0))[0]
    assert len(set(got)) <= len(set(plain))


def test_logit_bias_out_of_the_vocabulary_fails_at_admission(tiny: Model) -> None:
    vocab = int(tiny.model.args.vocab_size)
    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(spec("bad", P1, logit_bias={vocab: 1.0})))
    assert run.kinds("bad") == ["error"] and engine.active == 0
    assert run.last("bad").error_type == "invalid_request_error"
    assert "logit_bias" in run.last("bad").error


# -- one batch, many controls ------------------------------------------------------------------

MIXED = [
    ("plain", P1, {}),
    ("freq", P2, {"frequency_penalty": 1.2, "logprobs": 2}),
    (
        "hot",
        P3,
        {"temperature": 1.0, "seed": 5, "top_k": 20, "min_p": 0.02, "logit_bias": {7: 3.0}},
    ),
    (
        "nucleus",
        P1,
        {
            "temperature": 0.8,
            "seed": 9,
            "top_p": 0.9,
            "presence_penalty": 0.5,
            "repetition_penalty": 1.2,
            "logprobs": 3,
        },
    ),
]


def test_mixed_controls_in_one_batch_each_get_what_they_get_alone(tiny: Model) -> None:
    engine = make_engine(tiny)
    run = Run()
    for rid, prompt, controls in MIXED:
        run.add(engine.admit(spec(rid, prompt, N, **controls)))
    assert engine.active == len(MIXED)
    run_until_done(engine, 4 * N, run)
    for rid, prompt, controls in MIXED:
        solo = alone(tiny, spec(rid, prompt, N, **controls))
        assert run.tokens(rid) == solo.tokens(rid), rid
        for got, want in zip(entries(run, rid), entries(solo, rid), strict=True):
            assert got[1] == want[1]
            np.testing.assert_allclose([got[0], *got[2]], [want[0], *want[2]], atol=1e-5)
    assert run.tokens("plain") == reference_greedy(tiny, P1)[0]


def test_a_seeded_request_samples_the_same_alone_and_beside_others(tiny: Model) -> None:
    seeded = {"temperature": 1.0, "seed": 1234, "top_p": 0.95, "top_k": 50}
    solo = tokens_of(tiny, spec("s", P3, N, **seeded))
    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(spec("x", P1, N, temperature=1.0, seed=1)))
    run.add(engine.admit(spec("s", P3, N, **seeded)))
    run.add(engine.admit(spec("y", P2, N, frequency_penalty=0.5)))
    run_until_done(engine, 4 * N, run)
    assert run.tokens("s") == solo
    other_seed = tokens_of(tiny, spec("o", P3, N, **{**seeded, "seed": 99}))
    assert other_seed != solo, "another seed should sample other tokens"


def test_the_fast_start_applies_the_controls(tiny: Model) -> None:
    """A warm request's first token is sampled in admit, outside BatchGenerator: the same
    processors, over the same tokens, and its logprob entry too."""
    controls = {
        "frequency_penalty": 1.0,
        "repetition_penalty": 1.3,
        "logprobs": 2,
        "logit_bias": {9: 2.0},
    }
    pc = make_cache(tiny, "dense")
    engine = make_engine(tiny, pc)
    first = Run()
    first.add(engine.admit(spec("A", LONG)))
    run_until_done(engine, 40, first)
    prompt = LONG + first.tokens("A") + [42, 43]
    warm = Run()
    admitted = warm.add(engine.admit(spec("B", prompt, N, **controls)))
    assert not admitted.prefill_pending and warm.kinds("B") == ["start", "delta"]
    run_until_done(engine, 4 * N, warm)
    cold = alone(tiny, spec("B", prompt, N, **controls))
    assert warm.tokens("B") == cold.tokens("B")
    for got, want in zip(entries(warm, "B"), entries(cold, "B"), strict=True):
        assert got[1] == want[1]
        np.testing.assert_allclose([got[0], *got[2]], [want[0], *want[2]], atol=1e-4)


# -- logprobs ----------------------------------------------------------------------------------


def test_greedy_logprobs_are_the_model_log_softmax(tiny: Model) -> None:
    run = alone(tiny, spec("l", P1, N, logprobs=5))
    tokens = run.tokens("l")
    want_tokens, dists = reference_greedy(tiny, P1)
    assert tokens == want_tokens
    got = entries(run, "l")
    assert len(got) == len(tokens)
    for token, (lp, ids, lps), dist in zip(tokens, got, dists, strict=True):
        assert abs(lp - dist[token]) < 1e-4
        assert len(ids) == len(lps) == 5
        assert ids[0] == token and lps == sorted(lps, reverse=True)
        np.testing.assert_allclose(lps, np.sort(dist)[::-1][:5], atol=1e-4)
        np.testing.assert_allclose(lps, dist[ids], atol=1e-4)


def test_logprobs_zero_and_none(tiny: Model) -> None:
    run = alone(tiny, spec("z", P2, N, logprobs=0))
    assert [len(e[1]) for e in entries(run, "z")] == [0] * N
    assert all(e[0] <= 0 for e in entries(run, "z"))
    plain = alone(tiny, spec("n", P2, N))
    assert entries(plain, "n") == [] and plain.tokens("n") == run.tokens("z")


def test_logprobs_come_after_the_processors_and_before_temperature(
    tiny: Model, counting: list[int]
) -> None:
    """The documented distribution: log-softmax of the logits after the request's penalties
    and bias, before temperature and truncation (worker/engine/sampling.py)."""
    table = {5: 4.0, 77: -3.0}
    s = spec(
        "p",
        counting,
        N,
        temperature=1.7,
        seed=21,
        top_k=40,
        logit_bias=table,
        frequency_penalty=0.8,
        presence_penalty=0.3,
        logprobs=1,
    )
    run = alone(tiny, s)
    tokens = run.tokens("p")
    adjust = [bias(table), frequency_presence(0.8, 0.3)]
    for i, (token, (lp, ids, lps)) in enumerate(zip(tokens, entries(run, "p"), strict=True)):
        z = reference_logits(tiny, counting + tokens[:i])
        for a in adjust:
            z = a(z, counting, tokens[:i])
        dist = log_softmax(z)
        assert abs(lp - dist[token]) < 1e-4
        assert ids == [int(np.argmax(dist))] and abs(lps[0] - dist.max()) < 1e-4


# -- through the pool: OpenAI shapes and 400s ----------------------------------------------------

CHAT = [{"role": "user", "content": "1, 2, 3, 4, 5,"}]


@pytest.fixture(scope="module")
def pool(shared_pool: Any) -> Any:
    return shared_pool  # the session's pool: this module needs no settings of its own


@pytest.mark.pool
def test_completion_logprobs_legacy_shape(pool: Any, tiny: Model, counting: list[int]) -> None:
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 8, "logprobs": 3}
    out = ok(post(pool, "/v1/completions", body))
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n = out["usage"]["completion_tokens"]
    assert n == 8 and all(len(lp[k]) == n for k in lp)
    # Each offset points at its token in the text (mlx-lm's detokenizer, like the reference the
    # pool's text is tested against, drops the first token's leading space).
    text = choice["text"]
    assert "".join(lp["tokens"]).endswith(text) and lp["text_offset"][0] == 0
    for token, offset in zip(lp["tokens"][1:], lp["text_offset"][1:], strict=True):
        assert text[offset:].startswith(token)
    want, dists = reference_greedy(tiny, counting, n)
    assert lp["tokens"] == [tiny.tokenizer.decode([t]) for t in want]
    for token, token_lp, top, wanted, dist in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], want, dists, strict=True
    ):
        assert abs(token_lp - dist[wanted]) < 1e-4
        assert len(top) == 3 and top[token] == token_lp == max(top.values())
        assert list(top.values()) == sorted(top.values(), reverse=True)
        np.testing.assert_allclose(list(top.values()), np.sort(dist)[::-1][:3], atol=1e-4)
    # Streamed: the chunks' logprobs, joined, are the body's.
    resp = post(pool, "/v1/completions", {**body, "stream": True})
    assert resp.status_code == 200, resp.text
    chunks = [c["choices"][0] for c in sse_events(resp) if c["choices"]]
    joined: dict[str, list[Any]] = {k: [] for k in lp}
    for c in chunks:
        if c["logprobs"] is not None:
            assert c["text"] or c["finish_reason"], "logprobs come with their tokens' text"
            for k in joined:
                joined[k].extend(c["logprobs"][k])
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    np.testing.assert_allclose(joined["token_logprobs"], lp["token_logprobs"], atol=1e-5)
    # Asked for none: null, as before.
    assert (
        ok(post(pool, "/v1/completions", {**body, "logprobs": None}))["choices"][0]["logprobs"]
        is None
    )


def _prompt_offsets_point_at_their_tokens(lp: dict[str, list[Any]], text: str) -> None:
    assert lp["text_offset"][0] == 0
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[offset:].startswith(token), (token, offset, text)


@pytest.mark.pool
def test_echo_returns_the_prompt_then_its_completion(
    pool: Any, tiny: Model, counting: list[int]
) -> None:
    prompt = "1, 2, 3, 4, 5,"
    want, _ = reference_greedy(tiny, counting, 8)
    out = ok(post(pool, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "echo": True}))
    text = out["choices"][0]["text"]
    # The prompt, then the completion continuing its text (its leading space kept).
    assert text.startswith(prompt) and text == tiny.tokenizer.decode(counting + want)
    assert out["usage"]["completion_tokens"] == 8
    assert out["usage"]["prompt_tokens"] == len(counting)
    # Streamed, the prompt's text is the first chunk.
    resp = post(
        pool, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "echo": True, "stream": True}
    )
    assert resp.status_code == 200, resp.text
    chunks = [c["choices"][0] for c in sse_events(resp) if c["choices"]]
    assert chunks[0]["text"] == prompt and "".join(c["text"] for c in chunks) == text
    # max_tokens 0: the prompt alone (OpenAI's way to score one), a prompt of ids decoded.
    for sent in (prompt, counting):
        only = ok(post(pool, "/v1/completions", {"prompt": sent, "max_tokens": 0, "echo": True}))
        assert only["choices"][0]["text"] == prompt
        assert only["choices"][0]["finish_reason"] == "length"
        assert only["usage"]["completion_tokens"] == 0
    # Every choice of every prompt starts with its own prompt.
    fox = "The quick brown fox"
    many = ok(
        post(
            pool,
            "/v1/completions",
            {"prompt": [prompt, fox], "n": 2, "max_tokens": 3, "echo": True},
        )
    )
    starts = [c["text"][: len(prompt if c["index"] < 2 else fox)] for c in many["choices"]]
    assert starts == [prompt, prompt, fox, fox]
    # A prompt whose last character spans several tokens, or that ends in a space the
    # detokenizer holds back: the completion continues it as the whole text decodes (never a
    # U+FFFD for the character's tail, never the space twice).
    for wide in ("I like 😀", "naïve café 東京", "Hello "):  # and one ending in a space token
        ids = tiny.tokenizer.encode(wide, add_special_tokens=False)
        got = ok(post(pool, "/v1/completions", {"prompt": wide, "max_tokens": 6, "echo": True}))
        more, _ = reference_greedy(tiny, ids, 6)
        assert got["choices"][0]["text"] == wide + tiny.tokenizer.decode(ids + more)[len(wide) :]
    # Without echo, max_tokens 0 is refused, naming the param.
    refused = post(pool, "/v1/completions", {"prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert "echo" in refused.json()["error"]["message"]


@pytest.mark.pool
def test_echo_logprobs_of_the_prompt_are_what_its_greedy_continuation_reported(
    pool: Any, tiny: Model, counting: list[int]
) -> None:
    """The prompt's tokens' logprobs (echo with logprobs): on a prompt that is a shorter prompt
    plus its greedy continuation, the continuation's tokens get, as prompt tokens, the logprobs
    the model reported when it generated them; the first prompt token's is null."""
    cont = ok(post(pool, "/v1/completions", {"prompt": counting, "max_tokens": 6, "logprobs": 2}))
    cont_lp = cont["choices"][0]["logprobs"]
    generated, _ = reference_greedy(tiny, counting, 6)
    prompt = counting + generated
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    scored = ok(post(pool, "/v1/completions", body))["choices"][0]
    lp = scored["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(lp[k]) == len(prompt) for k in lp)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"] == [tiny.tokenizer.decode([t]) for t in prompt]
    assert scored["text"] == tiny.tokenizer.decode(prompt)
    _prompt_offsets_point_at_their_tokens(lp, scored["text"])
    k = len(counting)
    np.testing.assert_allclose(lp["token_logprobs"][k:], cont_lp["token_logprobs"], atol=1e-4)
    for got, want in zip(lp["top_logprobs"][k:], cont_lp["top_logprobs"], strict=True):
        assert list(got) == list(want)  # the same alternatives, most likely first
        np.testing.assert_allclose(list(got.values()), list(want.values()), atol=1e-4)
    # Every prompt token's logprob is the model's log-softmax after the tokens before it.
    for i in range(1, len(prompt)):
        dist = log_softmax(reference_logits(tiny, prompt[:i]))
        assert abs(lp["token_logprobs"][i] - dist[prompt[i]]) < 1e-4
        assert len(lp["top_logprobs"][i]) in (2, 3)  # the 2 most likely, plus the token's own

    # With a completion: the prompt's entries, then the completion's, offsets running on.
    both = ok(post(pool, "/v1/completions", {**body, "prompt": counting, "max_tokens": 6}))
    blp, text = both["choices"][0]["logprobs"], both["choices"][0]["text"]
    assert len(blp["tokens"]) == k + 6 and blp["tokens"][k:] == cont_lp["tokens"]
    np.testing.assert_allclose(blp["token_logprobs"][k:], cont_lp["token_logprobs"], atol=1e-4)
    np.testing.assert_allclose(blp["token_logprobs"][1:k], lp["token_logprobs"][1:k], atol=1e-4)
    _prompt_offsets_point_at_their_tokens(blp, text)
    # Streamed: the first chunk carries the prompt's text and its tokens' logprobs.
    resp = post(
        pool, "/v1/completions", {**body, "prompt": counting, "max_tokens": 6, "stream": True}
    )
    assert resp.status_code == 200, resp.text
    chunks = [c["choices"][0] for c in sse_events(resp) if c["choices"]]
    assert chunks[0]["text"] == tiny.tokenizer.decode(counting)
    assert chunks[0]["logprobs"]["tokens"] == blp["tokens"][:k]
    joined: dict[str, list[Any]] = {name: [] for name in blp}
    for c in chunks:
        for name in joined:
            joined[name].extend((c["logprobs"] or {}).get(name, []))
    assert joined["tokens"] == blp["tokens"] and joined["text_offset"] == blp["text_offset"]


@pytest.mark.pool
def test_chat_logprobs_shape(pool: Any) -> None:
    body = {"messages": CHAT, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}
    out = ok(post(pool, "/v1/chat/completions", body))
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert set(choice["logprobs"]) == {"content"}
    assert 1 <= len(content) == out["usage"]["completion_tokens"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(item["bytes"]).decode("utf-8", "replace") == item["token"]
        top = item["top_logprobs"]
        assert len(top) == 2 and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        assert top[0]["logprob"] >= top[1]["logprob"]
        assert top[0]["token"] == item["token"] and top[0]["logprob"] == item["logprob"]
    text = b"".join(bytes(item["bytes"]) for item in content).decode("utf-8")
    assert text.endswith(choice["message"]["content"])
    resp = post(pool, "/v1/chat/completions", {**body, "stream": True})
    assert resp.status_code == 200, resp.text
    streamed = [
        item
        for c in sse_events(resp)
        for ch in c["choices"]
        if ch["logprobs"] is not None
        for item in ch["logprobs"]["content"]
    ]
    assert [i["token"] for i in streamed] == [i["token"] for i in content]
    np.testing.assert_allclose(
        [i["logprob"] for i in streamed], [i["logprob"] for i in content], atol=1e-5
    )
    # logprobs without top_logprobs: each token's own logprob, no alternatives.
    plain = ok(post(pool, "/v1/chat/completions", {**body, "top_logprobs": None}))
    assert all(i["top_logprobs"] == [] for i in plain["choices"][0]["logprobs"]["content"])
    none = ok(post(pool, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}))
    assert none["choices"][0]["logprobs"] is None


@pytest.mark.pool
def test_controls_reach_the_worker(pool: Any) -> None:
    body = {"prompt": "hi", "max_tokens": 5, "logit_bias": {"100": 100}, "logprobs": 0}
    forced = ok(post(pool, "/v1/completions", body))
    lp = forced["choices"][0]["logprobs"]
    assert len(set(lp["tokens"])) == 1 and forced["usage"]["completion_tokens"] == 5
    # max_completion_tokens is max_tokens' newer name on completions too.
    newer = ok(post(pool, "/v1/completions", {"prompt": "hi", "max_completion_tokens": 3}))
    assert newer["usage"]["completion_tokens"] == 3
    # What the pool serves of the refused fields passes: their defaults.
    fine = {
        "prompt": "hi",
        "max_tokens": 2,
        "echo": False,
        "best_of": 1,
        "suffix": None,
        "response_format": {"type": "text"},
        "top_k": -1,
        "min_p": 0,
    }
    ok(post(pool, "/v1/completions", fine))
    # Structured outputs are served (tests/test_structured_output.py checks what they produce).
    for fmt in (
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    ):
        ok(
            post(
                pool,
                "/v1/chat/completions",
                {"messages": CHAT, "max_tokens": 2, "response_format": fmt},
            )
        )
    penalized = {
        "messages": CHAT,
        "max_tokens": 4,
        "repetition_penalty": 1.3,
        "top_k": 5,
        "presence_penalty": 1,
        "frequency_penalty": -1,
        "temperature": 1,
        "seed": 3,
    }
    ok(post(pool, "/v1/chat/completions", penalized))


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"top_k": 1.5}, "top_k"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"min_p": -0.1}, "min_p"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"repetition_penalty": 11}, "repetition_penalty"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"-5": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {" 5": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"1024": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": "high"}}, "logit_bias.5"),
    ("completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"echo": True, "max_tokens": -1}, "max_tokens"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "tail"}, "suffix"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    (
        "completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            }
        },
        "response_format",
    ),
    ("completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.mark.pool
@pytest.mark.parametrize(("kind", "extra", "param"), BAD)
def test_bad_controls_are_400_naming_the_param(
    pool: Any, kind: str, extra: dict[str, Any], param: str
) -> None:
    if kind == "chat":
        resp = post(pool, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **extra})
    else:
        resp = post(pool, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"]
