"""shared/model_facts on real config.json files, and the router's tokenizer agreeing with it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from devmodel.paths import built_model_dir
from shared.model_facts import (
    FALLBACK_CONTEXT,
    ModelConfigError,
    configured_model_dir,
    model_facts,
    model_id_for,
)


def write_model(tmp_path: Path, config: Any, name: str = "some-model") -> Path:
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize("key", ["max_position_embeddings", "max_sequence_length", "max_seq_len"])
def test_context_length_from_each_spelling(tmp_path: Path, key: str) -> None:
    facts = model_facts(write_model(tmp_path, {key: 8192, "vocab_size": 32000}))
    assert facts.context_length == 8192
    assert facts.context_from_config is True
    assert facts.vocab_size == 32000


def test_preferred_key_wins_when_several_are_named(tmp_path: Path) -> None:
    config = {"max_seq_len": 1024, "max_position_embeddings": 4000}
    assert model_facts(write_model(tmp_path, config)).context_length == 4000


def test_nested_text_config(tmp_path: Path) -> None:
    config = {"model_type": "vlm", "text_config": {"max_position_embeddings": 131072}}
    facts = model_facts(write_model(tmp_path, config))
    assert facts.context_length == 131072
    assert facts.context_from_config is True


def test_top_level_wins_over_text_config(tmp_path: Path) -> None:
    config = {"max_seq_len": 2048, "text_config": {"max_position_embeddings": 131072}}
    assert model_facts(write_model(tmp_path, config)).context_length == 2048


def test_no_context_key_falls_back(tmp_path: Path) -> None:
    facts = model_facts(write_model(tmp_path, {"model_type": "llama", "text_config": {}}))
    assert facts.context_length == FALLBACK_CONTEXT
    assert facts.context_from_config is False
    assert facts.vocab_size is None


@pytest.mark.parametrize("bad", [True, 0, -1, "4096", None])
def test_non_positive_int_values_are_ignored(tmp_path: Path, bad: Any) -> None:
    # A bad value at the top level does not hide a good one nested, nor become the answer.
    config = {
        "max_position_embeddings": bad,
        "vocab_size": bad,
        "text_config": {"max_seq_len": 512},
    }
    facts = model_facts(write_model(tmp_path, config))
    assert facts.context_length == 512
    assert facts.vocab_size is None


def test_only_bad_values_fall_back(tmp_path: Path) -> None:
    config = {"max_position_embeddings": False, "max_sequence_length": 0, "max_seq_len": -8}
    facts = model_facts(write_model(tmp_path, config))
    assert facts.context_length == FALLBACK_CONTEXT
    assert facts.context_from_config is False


def test_vocab_size_top_level_and_nested(tmp_path: Path) -> None:
    top = {"vocab_size": 151936, "text_config": {"vocab_size": 1000}}
    assert model_facts(write_model(tmp_path, top, "top")).vocab_size == 151936
    nested = {"text_config": {"vocab_size": 262208}}
    assert model_facts(write_model(tmp_path, nested, "nested")).vocab_size == 262208


def test_missing_config_raises(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelConfigError, match="config.json"):
        model_facts(empty)
    with pytest.raises(ModelConfigError):
        model_facts(tmp_path / "does-not-exist")


def test_unparseable_config_raises(tmp_path: Path) -> None:
    model_dir = tmp_path / "broken"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="cannot read"):
        model_facts(model_dir)


@pytest.mark.parametrize("config", [[1, 2], "text", 42, None])
def test_non_object_config_raises(tmp_path: Path, config: Any) -> None:
    with pytest.raises(ModelConfigError, match="JSON object"):
        model_facts(write_model(tmp_path, config))


def test_model_id(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, {"max_seq_len": 64}, "Qwen3-4B-4bit")
    assert model_id_for(model_dir) == "Qwen3-4B-4bit"
    assert model_id_for(model_dir / ".." / "Qwen3-4B-4bit") == "Qwen3-4B-4bit"
    assert model_id_for(model_dir, "served-name") == "served-name"
    assert model_facts(model_dir).model_id == "Qwen3-4B-4bit"
    assert model_facts(model_dir, "served-name").model_id == "served-name"


def test_configured_model_dir(tmp_path: Path) -> None:
    assert configured_model_dir(str(tmp_path / "m"), tmp_path / "cache") == tmp_path / "m"
    assert configured_model_dir("~/m", tmp_path) == Path.home() / "m"
    assert configured_model_dir("", tmp_path / "cache") == built_model_dir(tmp_path / "cache")


def test_router_tokenizer_agrees_with_model_facts(tiny_model_dir: Path, tmp_path: Path) -> None:
    from router.admission.tokenization import load_tokenizer

    facts = model_facts(tiny_model_dir)
    assert facts.context_from_config is True
    tokenizer = load_tokenizer(tiny_model_dir)
    assert tokenizer.context_length == facts.context_length
    assert tokenizer.vocab_size == facts.vocab_size

    copy = tmp_path / "tiny-max-seq-len"
    shutil.copytree(tiny_model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    context = config.pop("max_position_embeddings") + 512  # differs from the original's
    config["max_seq_len"] = context
    (copy / "config.json").write_text(json.dumps(config))

    assert model_facts(copy).context_length == context
    assert load_tokenizer(copy).context_length == context
