"""worker/mlx_cpu/cpu_ops.py and last_logits.py against mlx / mlx-lm's own functions, on real arrays
and the real tiny model: same numbers (to float32 rounding), the same greedy tokens through
BatchGenerator (left padding, chunked prefill, decode), and the fallbacks they promise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models.llama as llama
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import activations, base
from mlx_lm.models.cache import make_prompt_cache

from worker.mlx_cpu import cpu_ops
from worker.mlx_cpu.last_logits import last_logits

TOL = 2e-5


def _close(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a - b).max().item())


def _qkv(b: int, q_heads: int, kv_heads: int, n_q: int, n_k: int) -> tuple[mx.array, ...]:
    mx.random.seed(n_q * 1000 + n_k)
    return (
        mx.random.normal((b, q_heads, n_q, 16)),
        mx.random.normal((b, kv_heads, n_k, 16)),
        mx.random.normal((b, kv_heads, n_k, 16)),
    )


@pytest.fixture(autouse=True)
def ours_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test compares our own math with mlx's at small shapes, which the real threshold
    (`MLX_BELOW`) hands to mlx-lm's functions: a test of the threshold sets it back."""
    monkeypatch.setattr(cpu_ops, "MLX_BELOW", 0)


@pytest.fixture(params=["device", "host"])
def softmax_side(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The attention tests run twice: the softmax on mlx (`mx.power`), and in numpy from any size
    (the real threshold only sends a prefill's large score matrices there)."""
    if request.param == "host":
        monkeypatch.setattr(cpu_ops, "HOST_SOFTMAX_MIN_SCORES", 0)
    else:
        monkeypatch.setattr(cpu_ops, "HOST_SOFTMAX_MIN_SCORES", 1 << 62)
    return str(request.param)


def test_the_host_softmax_takes_prefills_only(
    softmax_side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step (one query a sequence) keeps its graph lazy for mlx-lm's async eval."""
    calls: list[tuple[int, ...]] = []
    real = cpu_ops._exp_on_host

    def spy(scores: mx.array) -> tuple[mx.array, mx.array]:
        calls.append(tuple(scores.shape))
        return real(scores)

    monkeypatch.setattr(cpu_ops, "_exp_on_host", spy)
    for n_q in (1, 2, 7):
        q, k, v = _qkv(2, 6, 2, n_q, 40)
        cpu_ops.scaled_dot_product_attention(q, k, v, None, 0.25, "causal")
    assert calls == ([(2, 2, 6, 40), (2, 2, 21, 40)] if softmax_side == "host" else [])


@pytest.mark.usefixtures("softmax_side")
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "n_q", "n_k"),
    [(4, 4, 1, 9), (6, 2, 1, 40), (6, 2, 7, 40), (6, 2, 40, 40), (4, 1, 5, 5)],
)
def test_attention_matches_mlx_without_mask_and_causal(
    q_heads: int, kv_heads: int, n_q: int, n_k: int
) -> None:
    q, k, v = _qkv(2, q_heads, kv_heads, n_q, n_k)
    for mask in (None, "causal"):
        ours = cpu_ops.scaled_dot_product_attention(q, k, v, None, 0.25, mask)
        theirs = base.scaled_dot_product_attention(q, k, v, None, 0.25, mask)
        assert _close(ours, theirs) < TOL, mask


@pytest.mark.usefixtures("softmax_side")
def test_attention_matches_mlx_with_left_padding_masks() -> None:
    """BatchKVCache's masks: (b, 1, q, k) booleans, including rows with every key masked (mlx
    averages the values there; -inf would make them NaN and poison the batch)."""
    q, k, v = _qkv(3, 6, 2, 4, 12)
    left_padding = mx.array([0, 5, 11])
    positions = mx.arange(12)[None]
    mask = (mx.arange(8, 12)[:, None] >= positions) & (
        left_padding[:, None, None, None] <= positions
    )
    mask[2, 0, 0, :] = False  # a fully masked query row
    ours = cpu_ops.scaled_dot_product_attention(q, k, v, None, 0.25, mask)
    theirs = base.scaled_dot_product_attention(q, k, v, None, 0.25, mask)
    assert not mx.isnan(ours).any().item()
    assert _close(ours, theirs) < TOL


@pytest.mark.usefixtures("softmax_side")
def test_attention_matches_mlx_with_per_head_and_2d_masks() -> None:
    q, k, v = _qkv(2, 6, 2, 3, 10)
    mx.random.seed(7)
    per_head = mx.random.uniform(shape=(2, 6, 3, 10)) > 0.3
    flat = mx.random.uniform(shape=(3, 10)) > 0.3
    for mask in (per_head, flat):
        ours = cpu_ops.scaled_dot_product_attention(q, k, v, None, 0.25, mask)
        theirs = base.scaled_dot_product_attention(q, k, v, None, 0.25, mask)
        assert _close(ours, theirs) < TOL


@pytest.mark.usefixtures("softmax_side")
def test_attention_hands_what_it_does_not_handle_to_mlx() -> None:
    """An additive float mask and attention sinks go to mlx-lm's own function, bit for bit."""
    q, k, v = _qkv(1, 4, 2, 3, 8)
    additive = mx.random.normal((3, 8))
    ours = cpu_ops.scaled_dot_product_attention(q, k, v, None, 0.25, additive)
    assert mx.array_equal(ours, base.scaled_dot_product_attention(q, k, v, None, 0.25, additive))
    sinks = mx.zeros((4,))
    ours = cpu_ops.scaled_dot_product_attention(q, k, v, None, 0.25, "causal", sinks)
    theirs = base.scaled_dot_product_attention(q, k, v, None, 0.25, "causal", sinks)
    assert mx.array_equal(ours, theirs)


def test_small_work_goes_to_mlx_s_own_functions_and_large_work_to_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode step of one sequence over a short context has too few exps for our ops to pay;
    a prefill's scores and a wide batch's SwiGLU do."""
    monkeypatch.setattr(cpu_ops, "MLX_BELOW", 1 << 13)
    theirs: list[str] = []
    real_sdpa, real_swiglu = cpu_ops._mlx_sdpa, cpu_ops._mlx_swiglu

    def sdpa_spy(*args: Any) -> mx.array:
        theirs.append("sdpa")
        return real_sdpa(*args)

    def swiglu_spy(gate: mx.array, x: mx.array) -> mx.array:
        theirs.append("swiglu")
        return real_swiglu(gate, x)

    monkeypatch.setattr(cpu_ops, "_mlx_sdpa", sdpa_spy)
    monkeypatch.setattr(cpu_ops, "_mlx_swiglu", swiglu_spy)
    decode = _qkv(1, 12, 4, 1, 100)  # 1,200 scores
    prefill = _qkv(1, 12, 4, 64, 64)  # 49,152 scores
    cpu_ops.scaled_dot_product_attention(*decode, None, 0.25, None)
    assert theirs == ["sdpa"]
    cpu_ops.scaled_dot_product_attention(*prefill, None, 0.25, "causal")
    assert theirs == ["sdpa"]
    one, wide = mx.random.normal((1, 1, 1344)), mx.random.normal((16, 1, 1344))
    cpu_ops.swiglu(one, one)
    assert theirs == ["sdpa", "swiglu"]
    cpu_ops.swiglu(wide, wide)
    assert theirs == ["sdpa", "swiglu"]


def test_swiglu_matches_mlx_over_a_wide_range() -> None:
    gate = mx.concatenate([mx.linspace(-120, 120, 2001), mx.random.normal((4000,)) * 4])
    x = mx.random.normal(gate.shape)
    ours = cpu_ops.swiglu(gate, x)
    theirs = activations.swiglu(gate, x)
    assert not mx.isnan(ours).any().item()
    rel = mx.abs(ours - theirs) / (mx.abs(theirs) + 1e-6)
    assert float(rel.max().item()) < 1e-4


@pytest.fixture
def tiny(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The tiny model; whatever install() swaps into mlx_lm.models.llama is put back after."""
    monkeypatch.setattr(llama, "scaled_dot_product_attention", llama.scaled_dot_product_attention)
    monkeypatch.setattr(llama, "swiglu", llama.swiglu)
    model, _ = load(str(tiny_model_dir))
    return model


def _greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    gen = BatchGenerator(
        model,
        max_tokens=max_tokens,
        stop_tokens=[],
        completion_batch_size=8,
        prefill_batch_size=8,
        prefill_step_size=64,
    )
    uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(v) < max_tokens for v in out.values()):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
    return [out[u] for u in uids]


@pytest.mark.usefixtures("softmax_side")
@pytest.mark.parametrize("mlx_below", [0, cpu_ops.MLX_BELOW], ids=["ours-always", "threshold"])
def test_install_swaps_in_for_a_float32_cpu_model_and_greedy_tokens_stay(
    tiny: Any, mlx_below: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_ops, "MLX_BELOW", mlx_below)
    vocab = tiny.args.vocab_size
    prompts = [
        [(i * 37 + j * 11) % (vocab - 2) + 1 for j in range(n)]
        for i, n in enumerate((3, 29, 150, 70, 9))
    ]
    before = _greedy(tiny, prompts, 12)
    assert cpu_ops.install(tiny) == ["scaled_dot_product_attention", "swiglu"]
    assert llama.scaled_dot_product_attention is cpu_ops.scaled_dot_product_attention
    assert llama.swiglu is cpu_ops.swiglu
    assert _greedy(tiny, prompts, 12) == before


def test_install_leaves_a_non_float32_model_alone(tiny: Any) -> None:
    tiny.set_dtype(mx.float16)
    assert cpu_ops.install(tiny) == []
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_last_logits_equal_the_full_call_s_last_row(tiny: Any) -> None:
    tokens = mx.array([[5, 9, 14, 3, 77, 21]])
    cache_a, cache_b = make_prompt_cache(tiny), make_prompt_cache(tiny)
    full = tiny(tokens, cache=cache_a)[:, -1, :]
    ours = last_logits(tiny, tokens, cache_b)
    assert ours.shape == (1, tiny.args.vocab_size)
    assert _close(ours, full) < 1e-5
    assert [c.offset for c in cache_b] == [c.offset for c in cache_a]


def test_last_logits_use_a_model_s_own_call_when_its_head_is_not_plain(tiny: Any) -> None:
    class Softcapped(type(tiny)):  # type: ignore[misc]
        def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
            return 30.0 * mx.tanh(super().__call__(inputs, cache=cache) / 30.0)

    tiny.__class__ = Softcapped
    tokens = mx.array([[5, 9, 14, 3]])
    capped = last_logits(tiny, tokens, make_prompt_cache(tiny))
    assert _close(capped, tiny(tokens, cache=make_prompt_cache(tiny))[:, -1, :]) < 1e-6
    assert float(mx.abs(capped).max().item()) <= 30.0


def test_the_plain_head_architectures_still_have_llama_s_call() -> None:
    """last_logits takes the shortcut only for these modules: each Model.__call__ must still be
    exactly llama's (inner model, then lm_head or tied embeddings), or an mlx-lm upgrade that adds
    e.g. logit soft-capping would be skipped silently."""
    import importlib
    import inspect

    from worker.mlx_cpu import last_logits as ll

    plain = inspect.getsource(llama.Model.__call__)
    for name in ll._PLAIN_HEAD_MODULES:
        module = importlib.import_module(f"mlx_lm.models.{name}")
        assert inspect.getsource(module.Model.__call__) == plain, name
