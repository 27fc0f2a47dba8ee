"""Every architecture of the model zoo (devmodel/zoo.py) through the Engine in-process: greedy
output equals mlx-lm's own `stream_generate`, for one request alone and for four requests of
different prompt lengths batched together, with the worker's CPU ops on and off. Also the Gemma 2
batch-mask fix (worker/model_fixes/gemma2.py): mlx-lm's batched Gemma 2 is wrong without it and
right with it, and the cache classes each zoo model's `make_cache()` gives."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from devmodel.zoo import ZOO, ZOO_INFO_FILE, ensure_zoo_model
from shared.model_facts import model_facts
from tests.test_engine import (
    Model,
    Run,
    alone,
    make_engine,
    reference,
    run_until_done,
    settings,
    spec,
)
from worker import model_fixes
from worker.main import _prompt_cache
from worker.mlx_cpu import cpu_ops

MAX_TOKENS = 8


def _prompt(n: int, start: int) -> list[int]:
    """`n` token ids spread over the vocabulary, clear of the special ids 0..4."""
    return [(start + i * 37) % 1000 + 5 for i in range(n)]


# Lengths differ so a batch pads them; 80 is past both sliding windows (32 and 64).
PROMPTS = {"a": _prompt(20, 11), "b": _prompt(47, 300), "c": _prompt(80, 7), "d": _prompt(33, 555)}
ALONE = "c"

# What mlx-lm's make_prompt_cache(model) holds per layer for each zoo model.
CACHE_CLASSES = {
    "llama4bit": ["KVCache"] * 2,
    "moe": ["KVCache"] * 2,  # qwen3_moe has no make_cache: one KVCache a layer
    "gemma2": ["KVCache"] * 2,  # no make_cache either
    "gemma3_text": ["RotatingKVCache", "KVCache"] * 2,
    "mistral_swa": ["RotatingKVCache", "RotatingKVCache", "KVCache"],
    "mamba2": ["ArraysCache"] * 2,
    "qwen3_next": ["ArraysCache", "KVCache"],
    "falcon_h1": ["CacheList(ArraysCache, KVCache)"] * 2,
}


@dataclass
class Zoo(Model):
    """A loaded zoo model and mlx-lm's greedy answers to the prompts, computed once each."""

    name: str = ""
    answers: dict[str, tuple[list[int], str]] = field(default_factory=dict)

    def answer(self, prompt: list[int]) -> tuple[list[int], str]:
        key = ",".join(map(str, prompt))
        if key not in self.answers:
            self.answers[key] = reference(self, prompt, MAX_TOKENS)
        return self.answers[key]


def load_model(model_dir: Path, name: str, fixes: bool = True) -> Zoo:
    """Loaded as worker/main.py loads it: mlx-lm's load, then the model fixes."""
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    if fixes:
        model_fixes.install(model)
    facts = model_facts(model_dir)
    return Zoo(model, tokenizer, facts.model_id, facts.context_length, name=name)


def cpu_ops_installed(mp: pytest.MonkeyPatch, model: object) -> list[str]:
    """`cpu_ops.install(model)`, its module-level swaps put back when `mp` undoes. Our ops run
    at every size: the threshold (`MLX_BELOW`) would hand a small test model's work to mlx-lm's."""
    mp.setattr(cpu_ops, "MLX_BELOW", 0)
    module = sys.modules[type(model).__module__]
    for name in cpu_ops._REPLACEMENTS:
        if hasattr(module, name):
            mp.setattr(module, name, getattr(module, name))
    return cpu_ops.install(model)


@pytest.fixture(
    scope="module",
    params=[(name, fast) for name in ZOO for fast in (False, True)],
    ids=lambda p: f"{p[0]}-{'cpu_ops' if p[1] else 'mlx_ops'}",
)
def zoo(request: pytest.FixtureRequest, zoo_model_dir: Callable[[str], Path]) -> Iterator[Zoo]:
    name, fast = request.param
    m = load_model(zoo_model_dir(name), name)
    with pytest.MonkeyPatch.context() as mp:
        if fast:
            cpu_ops_installed(mp, m.model)
        yield m


def assert_as_mlx_lm(m: Zoo, run: Run, rid: str) -> None:
    want, want_text = m.answer(PROMPTS[rid])
    assert run.tokens(rid) == want, f"{m.name}: request {rid}"
    assert run.text(rid) == want_text
    done = run.last(rid)
    assert done.kind == "done"
    assert done.finish_reason == ("length" if len(want) == MAX_TOKENS else "stop")


def test_one_request_alone_equals_mlx_lm(zoo: Zoo) -> None:
    run = alone(zoo, spec(ALONE, PROMPTS[ALONE], max_tokens=MAX_TOKENS))
    assert_as_mlx_lm(zoo, run, ALONE)


def test_four_requests_batched_equal_mlx_lm(zoo: Zoo) -> None:
    engine = make_engine(zoo)
    run = Run()
    for rid, prompt in PROMPTS.items():
        run.add(engine.admit(spec(rid, prompt, max_tokens=MAX_TOKENS)))
    assert engine.active == len(PROMPTS)
    run_until_done(engine, 4 * MAX_TOKENS + 8, run)
    for rid in PROMPTS:
        assert_as_mlx_lm(zoo, run, rid)


SHARED = _prompt(300, 3)  # a shared system prompt, past a checkpoint (256) and paged pages
AFTER_HIT = {"x": SHARED + _prompt(24, 900), "y": SHARED + _prompt(24, 50), "z": SHARED + [9] * 30}


def test_a_shared_prefix_is_reused_and_decodes_as_mlx_lm(zoo: Zoo) -> None:
    """Cold, then two prompts sharing its prefix batched together: both start from the cached
    prefix (a paged or dense entry, or a snapshot model's prefill checkpoint) and decode
    exactly what mlx-lm decodes cold."""
    prompt_cache, reported = _prompt_cache(settings("auto"), zoo.model, zoo.model_id, "w-zoo")
    assert prompt_cache is not None, reported
    engine = make_engine(zoo, prompt_cache)
    run = Run()
    run.add(engine.admit(spec("x", AFTER_HIT["x"], max_tokens=MAX_TOKENS)))
    run_until_done(engine, 4 * MAX_TOKENS + 16, run)
    for rid in ("y", "z"):
        run.add(engine.admit(spec(rid, AFTER_HIT[rid], max_tokens=MAX_TOKENS)))
    run_until_done(engine, 4 * MAX_TOKENS + 16, run)
    cached = {rid: run.events[rid][0].cached_tokens for rid in AFTER_HIT}
    assert cached["x"] == 0 and cached["y"] > 0 and cached["z"] > 0, (reported, cached)
    for rid, prompt in AFTER_HIT.items():
        want, _ = zoo.answer(prompt)
        assert run.tokens(rid) == want, f"{zoo.name} ({reported['storage_mode']}): {rid}"


# -- the zoo itself ---------------------------------------------------------------------------
def describe(cache: object) -> str:
    inner = getattr(cache, "caches", None)
    if inner is None:
        return type(cache).__name__
    return f"{type(cache).__name__}({', '.join(type(c).__name__ for c in inner)})"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_each_zoo_model_loads_with_its_cache_classes(
    name: str, zoo_model_dir: Callable[[str], Path]
) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    m = load_model(zoo_model_dir(name), name)
    assert [describe(c) for c in make_prompt_cache(m.model)] == CACHE_CLASSES[name]
    assert m.model.model_type == ZOO[name].model_type
    dtypes = {p.dtype for _, p in tree_flatten(m.model.parameters())}
    quantized = any(isinstance(q, nn.QuantizedLinear) for q in m.model.modules())
    assert quantized == (ZOO[name].quantization is not None)
    assert quantized or dtypes == {mx.float32}
    # The tiny model's tokenizer: the vocabulary and the stop ids match it.
    assert m.model.args.vocab_size == len(m.tokenizer.get_vocab())
    assert m.tokenizer.eos_token_ids == {1, 4}


def test_a_built_zoo_model_is_reused(cache_dir: Path) -> None:
    first = ensure_zoo_model(cache_dir, "mamba2")
    stamp = (first / ZOO_INFO_FILE).stat().st_mtime_ns
    assert ensure_zoo_model(cache_dir, "mamba2") == first
    assert (first / ZOO_INFO_FILE).stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="unknown zoo model"):
        ensure_zoo_model(cache_dir, "nope")


# -- the Gemma 2 batch-mask fix ---------------------------------------------------------------
GEMMA2_PROMPTS = [PROMPTS["a"], PROMPTS["b"], PROMPTS["d"]]


def token_ids(m: Zoo, prompts: list[list[int]]) -> list[list[int]]:
    """mlx-lm's own batch_generate, greedy."""
    from mlx_lm import batch_generate

    out = batch_generate(
        m.model, m.tokenizer, prompts, max_tokens=MAX_TOKENS, return_token_ids=True
    )
    return out.token_ids


def test_without_the_fix_mlx_lm_batched_gemma2_is_wrong(
    zoo_model_dir: Callable[[str], Path],
) -> None:
    raw = load_model(zoo_model_dir("gemma2"), "gemma2", fixes=False)
    alone_ids = [raw.answer(p)[0] for p in GEMMA2_PROMPTS]
    with pytest.raises(ValueError, match="broadcast_shapes"):
        token_ids(raw, GEMMA2_PROMPTS)  # three sequences against two KV heads
    two = token_ids(raw, GEMMA2_PROMPTS[:2])  # two: the batch axis meets the KV heads silently
    assert two != alone_ids[:2]


@pytest.mark.parametrize("fast", [False, True], ids=["mlx_ops", "cpu_ops"])
def test_with_the_fix_mlx_lm_batched_gemma2_is_right(
    zoo_model_dir: Callable[[str], Path], fast: bool
) -> None:
    m = load_model(zoo_model_dir("gemma2"), "gemma2", fixes=False)
    with pytest.MonkeyPatch.context() as mp:
        if fast:
            assert cpu_ops_installed(mp, m.model) == []  # gemma2 calls neither module function
        assert model_fixes.install(m.model) == ["gemma2_batch_mask"]
        assert model_fixes.install(m.model) == []  # once is enough
        alone_ids = [m.answer(p)[0] for p in GEMMA2_PROMPTS]
        assert token_ids(m, GEMMA2_PROMPTS) == alone_ids
        assert token_ids(m, GEMMA2_PROMPTS[:2]) == alone_ids[:2]


def test_the_fix_leaves_other_models_alone(zoo_model_dir: Callable[[str], Path]) -> None:
    import mlx_lm.models.gemma2  # noqa: F401  (loaded, so install looks at the model)

    m = load_model(zoo_model_dir("gemma3_text"), "gemma3_text", fixes=False)
    before = [type(layer) for layer in m.model.modules()]
    assert model_fixes.install(m.model) == []
    assert [type(layer) for layer in m.model.modules()] == before


def test_the_fixed_mask_gets_the_repeats_axis() -> None:
    import mlx.core as mx

    from worker.model_fixes.gemma2 import with_repeats_axis

    batch = mx.ones((3, 1, 5, 7), dtype=mx.bool_)
    assert with_repeats_axis(batch, 2, 2).shape == (3, 1, 1, 5, 7)
    per_head = mx.arange(3 * 4 * 5 * 7).reshape(3, 4, 5, 7)
    split = with_repeats_axis(per_head, 2, 2)
    assert split.shape == (3, 2, 2, 5, 7) and mx.array_equal(split[:, 1, 0], per_head[:, 2])
    single = mx.ones((5, 7), dtype=mx.bool_)
    assert with_repeats_axis(single, 2, 2) is single
    assert with_repeats_axis(batch, 4, 1) is batch  # no grouped-query heads: nothing to split
