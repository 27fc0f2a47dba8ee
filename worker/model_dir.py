"""A model directory the worker cannot serve stops it at start, with a message naming the file
and the field at fault: config.json (missing, unreadable, no or an unknown `model_type`), the
weights (no `model*.safetensors`, a parameter missing, extra or of the wrong shape), the
tokenizer (more tokens, or an eos id, than config.json's `vocab_size` allows). Never a worker
that registers and then fails every request."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from shared.model_facts import ModelConfigError, read_config

# What mlx-lm's load_model reads as the weights (mlx_lm/utils.py).
WEIGHTS_GLOB = "model*.safetensors"
# mlx's strict load_weights: "Received N parameters not in model: \n<a>,\n<b>." / "Missing N
# parameters: \n..." / "Expected shape ... for parameter <name>".
_LISTED = re.compile(r"^(Received|Missing) (\d+) parameters[^:]*:\s*(.*?)\.?$", re.DOTALL)
_SHAPE_PARAM = re.compile(r"for parameter (\S+)")
# A message names this many parameters at most, then how many more.
NAMED_PARAMETERS = 5


class ModelDirError(ValueError):
    """This model directory cannot be served; the message names the file and the field."""


def check_before_load(model_dir: Path) -> dict[str, Any]:
    """What can be told from the directory alone, before any weight is read: config.json is a
    JSON object whose `model_type` mlx-lm knows, and weights exist. Returns config.json."""
    if not model_dir.is_dir():
        raise ModelDirError(f"model directory {model_dir} does not exist (MLXCEL_MODEL)")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelDirError(f"{config_path} is missing: mlx-lm needs it (its `model_type`)")
    try:
        config = read_config(model_dir)
    except ModelConfigError as exc:
        raise ModelDirError(str(exc)) from None
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelDirError(
            f"{config_path}: no `model_type` field (mlx-lm picks the architecture by it)"
        )
    _check_architecture(config, config_path)
    if not any(model_dir.glob(WEIGHTS_GLOB)):
        raise ModelDirError(f"{model_dir}: no weights (no {WEIGHTS_GLOB} file)")
    return config


def _check_architecture(config: dict[str, Any], config_path: Path) -> None:
    # mlx-lm's own lookup (model_type, remapped by `architectures`): it imports one module.
    import mlx_lm
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, ImportError) as exc:
        raise ModelDirError(
            f"{config_path}: `model_type` {config['model_type']!r} is not an architecture "
            f"mlx-lm {mlx_lm.__version__} supports ({exc})"
        ) from None


def load(model_dir: Path, config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's `load` in its two steps, weights then tokenizer, so a failure names its file."""
    from mlx_lm.utils import load_model, load_tokenizer

    try:
        model, loaded_config = load_model(model_dir)
    except Exception as exc:  # any failure to build the model from its files stops the worker
        raise _weights_error(model_dir, exc) from exc
    try:
        tokenizer = load_tokenizer(
            model_dir, None, eos_token_ids=loaded_config.get("eos_token_id", None)
        )
    except Exception as exc:  # likewise for the tokenizer's files
        raise ModelDirError(
            f"{model_dir}: the tokenizer (tokenizer.json, tokenizer_config.json) does not load: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return model, tokenizer


def _weights_error(model_dir: Path, exc: Exception) -> ModelDirError:
    """mlx's own words, led by the weight file that holds the parameter it names."""
    files = sorted(model_dir.glob(WEIGHTS_GLOB))
    text = " ".join(str(exc).split())  # one line
    listed = _LISTED.match(str(exc).strip())
    shape = _SHAPE_PARAM.search(text)
    model_type = _model_type(model_dir)
    if listed:
        kind, count = listed.group(1), int(listed.group(2))
        names = [n.strip() for n in listed.group(3).split(",\n") if n.strip()]
        shown = ", ".join(names[:NAMED_PARAMETERS])
        if count > NAMED_PARAMETERS:
            shown += f" and {count - NAMED_PARAMETERS} more"
        if kind == "Received":  # in the files, not in the model class
            where = _holders(files, names) or files
            return ModelDirError(
                f"{_names(where)}: {count} extra weights the model class of config.json's "
                f"`model_type` {model_type!r} does not have: {shown}"
            )
        return ModelDirError(
            f"{_names(files)}: {count} weights missing that the model class of config.json's "
            f"`model_type` {model_type!r} needs: {shown}"
        )
    if shape:
        where = _holders(files, [shape.group(1)]) or files
        return ModelDirError(f"{_names(where)}: a weight of the wrong shape: {text}")
    return ModelDirError(
        f"{model_dir}: the model does not load from {_names(files) or WEIGHTS_GLOB} and "
        f"config.json: {type(exc).__name__}: {text}"
    )


def _holders(files: list[Path], names: list[str]) -> list[Path]:
    wanted = set(names)
    return [f for f in files if wanted & _tensor_names(f)]


def _tensor_names(path: Path) -> set[str]:
    """The tensor names in a safetensors file's header (8-byte length, then JSON); no mlx."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return set()
    return {k for k in header if k != "__metadata__"} if isinstance(header, dict) else set()


def _names(files: list[Path]) -> str:
    return ", ".join(str(f) for f in files)


def _model_type(model_dir: Path) -> str:
    try:
        return str(read_config(model_dir).get("model_type"))
    except ModelConfigError:
        return "?"


def check_tokenizer(model_dir: Path, tokenizer: Any, vocab_size: int) -> None:
    """Every token id the tokenizer can produce, and every eos id, is below the model's
    `vocab_size` (config.json): the embedding has no row for a larger one."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF tokenizer
    n_tokens = len(hf)
    if n_tokens > vocab_size:
        raise ModelDirError(
            f"{model_dir / 'tokenizer.json'}: the tokenizer has {n_tokens} tokens, more than "
            f"{model_dir / 'config.json'} `vocab_size` {vocab_size}: the tokenizer does not "
            "belong to these weights"
        )
    bad = sorted(t for t in tokenizer.eos_token_ids if not 0 <= int(t) < vocab_size)
    if bad:
        raise ModelDirError(
            f"{model_dir / 'config.json'}: eos token id {', '.join(map(str, bad))} "
            f"(`eos_token_id`, or tokenizer_config.json's eos_token) is out of range for "
            f"`vocab_size` {vocab_size}"
        )
