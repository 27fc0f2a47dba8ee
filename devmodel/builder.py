"""Build a small Llama-architecture model offline (no model hub needed).

Random float32 weights (seeded, so identical everywhere) plus a byte-level BPE tokenizer trained
on :mod:`devmodel.corpus` and a ChatML chat template with Hermes-style tool calls. The result
loads with ``mlx_lm.load(dir)`` and ``transformers.AutoTokenizer.from_pretrained(dir)``. Random
weights produce repetitive text and rarely emit EOS, which suits load testing: generation length
is set by ``max_tokens``.
"""

from __future__ import annotations

# This module imports mlx: a process preloads OpenBLAS (worker.mlx_cpu.blas) before importing it.
import argparse
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from devmodel import corpus
from devmodel.paths import (
    BUILD_INFO_FILE,
    BUILDER_VERSION,
    WEIGHTS_FILE,
    built_model_dir,
    is_built,
)

Progress = Callable[[str], None]


BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)  # ids 0..4, in this order

# ChatML, with tools and tool calls in the Qwen2.5/Hermes format: the tools as JSON in a system
# turn, each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (mlx-lm infers its
# json_tools parser from this text, and the router forces a call with that format's grammar), tool
# results in <tool_response> tags of a user turn. A chat without tools renders as plain ChatML.
CHAT_TEMPLATE = (
    # Text content: a string, or OpenAI-style parts ({"type": "text", "text": ...}; others skipped).
    "{%- macro text(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is not none %}"
    "{%- for part in content %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    # Tools: one system turn (after the conversation's own system text) listing them as JSON.
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- text(messages[0]['content']) + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and'"
    " ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    ' \'{"name": <function-name>, "arguments": <args-json-object>}\\n\''
    " '</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    # Already written in the tools turn.
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + text(message['content']) }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": ' }}{{- tool_call.name | tojson }}"
    "{{- ', \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    # Consecutive tool results share one user turn, each in <tool_response> tags.
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


MODEL_SIZES: dict[str, ModelSize] = {
    # Tests and the embedded default: ~0.85M params, builds and decodes in well under a second.
    "tiny": ModelSize(128, 4, 4, 2, 256, 1024, 2048),
    # ~50M params: big enough that batching and the prefix cache show in benchmarks.
    "bench": ModelSize(768, 8, 12, 4, 1344, 8192, 4096),
}

INIT_STD = 0.02  # HF-style init for embeddings and projections
# Larger lm_head init spreads the logits (std ~1) so greedy argmax has clear top-1/top-2
# margins, keeping results stable across batched vs. single-sequence numerics.
LM_HEAD_GAIN = 1.0


def _report(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


# --- tokenizer ---------------------------------------------------------------------------


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the deterministic corpus; special tokens get ids 0..4."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.iter_lines(), trainer=trainer)
    return tok


def _tokenizer_config(max_len: int) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(max_len))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    _write_json(out / "special_tokens_map.json", specials)


# --- weights -----------------------------------------------------------------------------


def _model_config(spec: ModelSize, vocab_size: int, tok: Tokenizer) -> dict[str, Any]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": ids[BOS],
        # <|im_end|> ends a chat turn, so it stops generation too.
        "eos_token_id": [ids[EOS], ids[IM_END]],
        "pad_token_id": ids[PAD],
    }


def _parameter_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes exactly as mlx_lm's Llama expects them (built lazily, never evaluated)."""
    from mlx_lm.models import llama

    fields = llama.ModelArgs.__dataclass_fields__
    args = llama.ModelArgs(**{k: v for k, v in config.items() if k in fields})
    model = llama.Model(args)
    return [(name, tuple(p.shape)) for name, p in tree_flatten(model.parameters())]


def _init_tensor(name: str, shape: tuple[int, ...], key: mx.array, hidden: int) -> mx.array:
    if name.endswith("norm.weight"):
        return mx.ones(shape, dtype=mx.float32)
    std = LM_HEAD_GAIN / hidden**0.5 if name.startswith("lm_head") else INIT_STD
    return mx.random.normal(shape, dtype=mx.float32, key=key) * std


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def init_weights(
    config: dict[str, Any], seed: int, progress: Progress | None = None
) -> dict[str, mx.array]:
    """Seeded float32 weights; tensor i always uses key i, so results don't depend on timing."""
    shapes = _parameter_shapes(config)
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    n_layers = int(config["num_hidden_layers"])
    hidden = int(config["hidden_size"])
    weights: dict[str, mx.array] = {}
    last_layer: int | None = None
    for i, (name, shape) in enumerate(shapes):
        layer = _layer_of(name)
        if layer is not None and layer != last_layer:
            _report(progress, f"initialising weights layer {layer + 1}/{n_layers}")
            last_layer = layer
        weights[name] = _init_tensor(name, shape, keys[i], hidden)
        mx.eval(weights[name])
    return weights


def count_parameters(weights: dict[str, mx.array]) -> int:
    return sum(int(w.size) for w in weights.values())


# --- build / cache -----------------------------------------------------------------------


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _build_into(tmp: Path, size: str, seed: int, progress: Progress | None) -> None:
    spec = MODEL_SIZES[size]
    _report(progress, f"training tokenizer (target vocab {spec.vocab_size})")
    tok = train_tokenizer(spec.vocab_size)
    # Model vocab == tokenizer vocab: ids the tokenizer can't decode would break detokenizers.
    vocab_size = tok.get_vocab_size()
    config = _model_config(spec, vocab_size, tok)
    weights = init_weights(config, seed, progress)
    _report(progress, f"saving {count_parameters(weights):,} parameters")
    mx.save_safetensors(str(tmp / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    _write_json(tmp / "config.json", config)
    _write_tokenizer(tok, tmp, spec.max_position_embeddings)
    info = {"builder_version": BUILDER_VERSION, "size": size, "seed": seed, **asdict(spec)}
    info["parameters"] = count_parameters(weights)
    _write_json(tmp / BUILD_INFO_FILE, info)


def _swap_in(tmp: Path, out_dir: Path) -> None:
    """Atomically publish ``tmp`` as ``out_dir``, replacing any previous build."""
    old: Path | None = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build_model(
    out_dir: Path, size: str = "tiny", seed: int = 0, progress: Progress | None = None
) -> Path:
    """Build a model into ``out_dir`` (via a temp dir beside it, then rename). Returns out_dir."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the published model should be world-readable
    try:
        _build_into(tmp, size, seed, progress)
        _swap_in(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    _report(progress, f"model ready at {out_dir}")
    return out_dir


def ensure_model(
    cache_dir: Path, size: str = "tiny", seed: int = 0, progress: Progress | None = None
) -> Path:
    """Return ``cache_dir/models/mlxcel-{size}-s{seed}``, building it once across processes."""
    model_dir = built_model_dir(cache_dir, size, seed)
    models_dir = model_dir.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    if is_built(model_dir):
        return model_dir
    lock_path = models_dir / f".{model_dir.name}.lock"
    with open(lock_path, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder finishes before we look again
        try:
            if not is_built(model_dir):
                build_model(model_dir, size, seed, progress)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return model_dir


# --- CLI ---------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mlxcel-pool build-model", description="Build a local random-weight Llama model."
    )
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output dir (default: <cache_dir>/models/mlxcel-SIZE-sSEED, where `mlxcel-pool up`, "
        "`router` and `worker` look for the built-in model; the cache dir is MLXCEL_CACHE_DIR)",
    )
    return parser.parse_args(argv)


def _default_out(size: str, seed: int) -> Path:
    """The cache dir's path for this model (the built-in one: where every part looks for it)."""
    from shared.config import load_settings

    return built_model_dir(load_settings().cache_dir, size, seed)


def main(argv: Sequence[str] | None = None) -> int:
    """``mlxcel-pool build-model``: progress on stderr, final path on stdout."""
    from shared.config import EXIT_CONFIG, ConfigError

    args = _parse_args(argv)
    try:
        out = args.out or _default_out(args.size, args.seed)
    except ConfigError as exc:
        print(f"mlxcel-pool build-model: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    path = build_model(out, args.size, args.seed, progress)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
