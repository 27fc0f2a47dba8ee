"""A zoo of tiny random-weight models, one per mlx-lm architecture the worker should serve.

Each entry is built offline from mlx-lm's own `ModelArgs` and `Model` classes (seeded init, so
identical everywhere), saved with `mlx_lm.utils.save_model`/`save_config` as `mlx_lm.convert`
writes a model, and given the project's tiny model's tokenizer (`devmodel.builder`), with the
vocabulary size and the BOS/EOS/PAD ids taken from it. Sizes are a few hundred thousand
parameters, float32 except `llama4bit`, so a model builds and decodes in a moment.

`ensure_zoo_model(cache_dir, name)` builds a model once under `cache_dir/zoo/` (across processes,
atomically, like `devmodel.builder.ensure_model`) and returns its directory, which
`mlx_lm.load(dir)` loads.
"""

from __future__ import annotations

# This module imports mlx: a process preloads OpenBLAS (worker.mlx_cpu.blas) before importing it.
import contextlib
import fcntl
import hashlib
import importlib
import io
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from devmodel.builder import _swap_in, ensure_model

# Bump when the build itself changes (a spec's own change already changes its digest).
ZOO_VERSION = 1
ZOO_INFO_FILE = "mlxcel_zoo.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CONTEXT_LENGTH = 2048


@dataclass(frozen=True)
class ZooSpec:
    """One zoo model: its architecture's config fields (vocabulary and special ids come from the
    tokenizer) and, for a quantized one, the quantization mlx-lm's convert applies."""

    model_type: str
    config: dict[str, Any]
    quantization: dict[str, int] | None = None
    # Fills the parameters whose names end so: larger branch norms keep a tied head from
    # predicting the input token again.
    fills: tuple[tuple[str, float], ...] = ()
    about: str = ""


_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}

ZOO: dict[str, ZooSpec] = {
    "llama4bit": ZooSpec(
        "llama",
        {
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            **_ATTN,
        },
        quantization={"group_size": 64, "bits": 4},
        about="Llama, 4-bit affine (QuantizedLinear and QuantizedEmbedding)",
    ),
    "moe": ZooSpec(
        "qwen3_moe",
        {
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            **_ATTN,
        },
        about="Qwen3-MoE: 4 experts, 2 per token (SwitchGLU)",
    ),
    "gemma2": ZooSpec(
        "gemma2",
        {
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 32,
            **_ATTN,
        },
        fills=(
            ("post_attention_layernorm.weight", 7.0),
            ("post_feedforward_layernorm.weight", 7.0),
        ),
        about="Gemma 2, grouped-query (4 heads over 2 KV heads), soft-capped scores and logits",
    ),
    "gemma3_text": ZooSpec(
        "gemma3_text",
        {
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "intermediate_size": 256,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 32,
            "sliding_window": 32,
            "sliding_window_pattern": 2,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            **_ATTN,
        },
        about="Gemma 3 text: layers 0 and 2 slide over 32 tokens, layers 1 and 3 are global",
    ),
    "mistral_swa": ZooSpec(
        "mistral",
        # mlx-lm's llama ignores `sliding_window` without `layer_types`, and needs one full layer.
        {
            "hidden_size": 128,
            "num_hidden_layers": 3,
            "intermediate_size": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            **_ATTN,
        },
        about="Mistral (mlx-lm's llama): two layers slide over 64 tokens, one is global",
    ),
    "mamba2": ZooSpec(
        "mamba2",
        {
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_heads": 8,
            "head_dim": 32,
            "intermediate_size": 256,
            "state_size": 16,
            "n_groups": 1,
            "conv_kernel": 4,
            "use_bias": False,
            "use_conv_bias": True,
            "tie_word_embeddings": True,
            "layer_norm_epsilon": 1e-5,
            "time_step_limit": [0.0, 1000.0],
            "time_step_rank": "auto",
        },
        about="Mamba 2: state-space layers only",
    ),
    "qwen3_next": ZooSpec(
        "qwen3_next",
        {
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 128,
            "mlp_only_layers": [],
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "full_attention_interval": 2,
            "tie_word_embeddings": False,
            **_ATTN,
        },
        about="Qwen3-Next hybrid: a gated-delta linear layer, then a full-attention layer; MoE",
    ),
    "falcon_h1": ZooSpec(
        "falcon_h1",
        {
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "mamba_d_ssm": 128,
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 32,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            **_ATTN,
        },
        about="Falcon-H1 hybrid: each layer runs attention and a Mamba 2 mixer side by side",
    ),
}


Size = dict[str, Any]  # config fields that override a zoo spec's own (a bench-sized variant)


def zoo_dir(cache_dir: Path, name: str, seed: int = 0, size: Size | None = None) -> Path:
    """`<cache_dir>/zoo/mlxcel-zoo-<name>-s<seed>` (plus a tag of `size`, when given): where
    `ensure_zoo_model` builds `name`."""
    tag = f"-{hashlib.sha256(json.dumps(size, sort_keys=True).encode()).hexdigest()[:8]}"
    return Path(cache_dir) / "zoo" / f"mlxcel-zoo-{name}-s{seed}{tag if size else ''}"


def model_config(name: str, tokenizer_dir: Path, size: Size | None = None) -> dict[str, Any]:
    """config.json for zoo model `name` (before quantization) with `tokenizer_dir`'s ids."""
    spec = ZOO[name]
    tok_config = json.loads((Path(tokenizer_dir) / "config.json").read_text(encoding="utf-8"))
    return {
        "model_type": spec.model_type,
        **spec.config,
        **(size or {}),
        "vocab_size": tok_config["vocab_size"],
        "bos_token_id": tok_config["bos_token_id"],
        "eos_token_id": tok_config["eos_token_id"],
        "pad_token_id": tok_config["pad_token_id"],
        "max_position_embeddings": CONTEXT_LENGTH,
        "torch_dtype": "float32",
    }


def _digest(name: str, seed: int, config: dict[str, Any], tokenizer_dir: Path) -> str:
    """Names everything a build depends on: a new mlx-lm or tokenizer rebuilds the model too."""
    from mlx_lm import __version__ as mlx_lm_version

    spec = ZOO[name]
    # Every file copied in, the chat template's config too: a new template rebuilds the model.
    tokenizer = hashlib.sha256(
        b"".join((Path(tokenizer_dir) / file).read_bytes() for file in TOKENIZER_FILES)
    ).hexdigest()
    parts = {
        "zoo_version": ZOO_VERSION,
        "seed": seed,
        "config": config,
        "quantization": spec.quantization,
        "fills": spec.fills,
        "mlx_lm": mlx_lm_version,
        "tokenizer": tokenizer,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def is_zoo_built(model_dir: Path, digest: str) -> bool:
    """True when `model_dir` holds a complete build of exactly this spec (the info file is
    written into the temporary directory last, so it exists only in a complete build)."""
    try:
        info = json.loads((Path(model_dir) / ZOO_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info.get("digest") == digest and (Path(model_dir) / "model.safetensors").exists()


def _model_classes(model_type: str) -> tuple[type, type]:
    from mlx_lm.utils import MODEL_REMAPPING

    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    return module.Model, module.ModelArgs


def _fill(model: nn.Module, fills: tuple[tuple[str, float], ...]) -> None:
    def fill(path: str, p: mx.array) -> mx.array:
        value = next((v for suffix, v in fills if path.endswith(suffix)), None)
        return p if value is None else mx.full(p.shape, value, dtype=p.dtype)

    model.update(tree_map_with_path(fill, model.parameters()))


def build_model_into(
    out: Path, name: str, seed: int, tokenizer_dir: Path, size: Size | None = None
) -> dict[str, Any]:
    """Write zoo model `name` into the existing directory `out`; returns its config."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    spec = ZOO[name]
    config = model_config(name, tokenizer_dir, size)
    model_cls, args_cls = _model_classes(spec.model_type)
    mx.random.seed(seed)  # parameters are drawn in construction order from this seed
    model = model_cls(args_cls.from_dict(config))
    if spec.fills:
        _fill(model, spec.fills)
    mx.eval(model.parameters())
    digest = _digest(name, seed, config, tokenizer_dir)
    if spec.quantization is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
            model, config = quantize_model(model, config, **spec.quantization)
    save_model(out, model)
    save_config(config, out / "config.json")
    for file in TOKENIZER_FILES:
        shutil.copy2(Path(tokenizer_dir) / file, out / file)
    parameters = sum(int(p.size) for _, p in tree_flatten(model.parameters()))
    info = {
        "zoo_version": ZOO_VERSION,
        "name": name,
        "seed": seed,
        "digest": digest,
        "model_type": spec.model_type,
        "parameters": parameters,
        "about": spec.about,
    }
    (out / ZOO_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return config


def ensure_zoo_model(
    cache_dir: Path,
    name: str,
    seed: int = 0,
    *,
    size: Size | None = None,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Return zoo model `name`'s directory under `cache_dir`, building it once across processes
    (the tokenizer is the tiny model's, built first under the same `cache_dir` if need be, or
    the one in `tokenizer_dir`; `size` overrides the spec's config, as benchmarks need)."""
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; choose from {sorted(ZOO)}")
    tokenizer_dir = tokenizer_dir or ensure_model(cache_dir, "tiny")
    model_dir = zoo_dir(cache_dir, name, seed, size)
    digest = _digest(name, seed, model_config(name, tokenizer_dir, size), tokenizer_dir)
    if is_zoo_built(model_dir, digest):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f".{model_dir.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder finishes before we look again
        try:
            if not is_zoo_built(model_dir, digest):
                tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
                tmp.chmod(0o755)
                try:
                    build_model_into(tmp, name, seed, tokenizer_dir, size)
                    _swap_in(tmp, model_dir)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return model_dir
