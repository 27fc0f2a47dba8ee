"""devmodel.builder: an offline tiny Llama that mlx_lm and transformers both load."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devmodel import builder as model_builder  # preloads OpenBLAS before mlx below  # isort: skip
import mlx.core as mx  # noqa: I001
from mlx_lm import load, stream_generate

REPO = Path(__file__).resolve().parents[1]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Where is the river?"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    steps: list[str] = []
    path = model_builder.build_model(tmp_path_factory.mktemp("a") / "tiny", "tiny", 0, steps.append)
    assert any("training tokenizer" in s for s in steps)
    assert any("layer 4/4" in s for s in steps)
    return path


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path) -> tuple[object, object]:
    return load(str(tiny_dir))


def _greedy_tokens(model: object, tokenizer: object, n: int = 16) -> list[int]:
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)  # type: ignore[attr-defined]
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=n)]  # type: ignore[arg-type]


def test_build_layout(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == 1024
    assert not list(tiny_dir.parent.glob(".tiny.tmp-*")), "temp build dir left behind"


def test_mlx_lm_generates_16_greedy_tokens(loaded: tuple[object, object]) -> None:
    model, tokenizer = loaded
    tokens = _greedy_tokens(model, tokenizer)
    assert len(tokens) == 16
    assert all(0 <= t < 1024 for t in tokens)
    assert tokens == _greedy_tokens(model, tokenizer), "greedy decoding must be repeatable"


def test_top2_logit_margin_is_clear(loaded: tuple[object, object]) -> None:
    model, _ = loaded
    rng = random.Random(0)
    for _ in range(8):
        prompt = mx.array([[rng.randrange(5, 1024) for _ in range(rng.randrange(4, 32))]])
        top = mx.sort(model(prompt)[0, -1])  # type: ignore[operator]
        assert (top[-1] - top[-2]).item() > 1e-3  # far above float32 batching noise


def test_same_seed_is_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    again = model_builder.build_model(tmp_path / "again", "tiny", 0)
    for f in tiny_dir.iterdir():
        assert f.read_bytes() == (again / f.name).read_bytes(), f.name
    other = model_builder.build_model(tmp_path / "other", "tiny", 1)
    weights = "model.safetensors"
    assert (other / weights).read_bytes() != (tiny_dir / weights).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_same_seed_gives_same_tokens(loaded: tuple[object, object], tmp_path: Path) -> None:
    rebuilt = load(str(model_builder.build_model(tmp_path / "m", "tiny", 0)))
    assert _greedy_tokens(*rebuilt) == _greedy_tokens(*loaded)


def test_chat_template(loaded: tuple[object, object]) -> None:
    _, tokenizer = loaded
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert "<|im_start|>user\nWhere is the river?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)  # type: ignore[attr-defined]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # type: ignore[attr-defined]
    assert set(tokenizer.eos_token_ids) == {1, 4}  # type: ignore[attr-defined]


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
TOOL_TURNS = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"c": "Rome"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"c": 1}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "sun"},
    {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "rain"}]},
]


def test_chat_template_writes_hermes_tool_calls(loaded: tuple[object, object]) -> None:
    """Tools, calls and results in the Qwen2.5/Hermes format, which mlx-lm recognises (its
    json_tools parser) and the router can force; a chat without tools is plain ChatML."""
    _, tokenizer = loaded
    assert tokenizer.has_tool_calling  # type: ignore[attr-defined]
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")  # type: ignore[attr-defined]
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [MESSAGES[0], *TOOL_TURNS], tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in system
    assert rest == (
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant"
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"c": "Rome"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"c": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsun\n</tool_response>"
        "\n<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(MESSAGES, tokenize=False)  # type: ignore[attr-defined]
    assert plain == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhere is the river?<|im_end|>\n"
    )


def test_an_older_build_is_rebuilt_with_the_current_template(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A cached model of an earlier builder version (another chat template) is rebuilt, so a
    template change reaches every cache dir."""
    from transformers import AutoTokenizer

    from devmodel.paths import BUILD_INFO_FILE, BUILDER_VERSION, built_model_dir
    from shared.block_hash import BlockHasher, canary

    old = built_model_dir(tmp_path, "tiny", 0)
    shutil.copytree(tiny_dir, old)
    info = json.loads((old / BUILD_INFO_FILE).read_text())
    (old / BUILD_INFO_FILE).write_text(json.dumps({**info, "builder_version": BUILDER_VERSION - 1}))
    config = json.loads((old / "tokenizer_config.json").read_text())
    (old / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "x"}))
    assert not model_builder.is_built(old)
    before = AutoTokenizer.from_pretrained(old)
    assert model_builder.ensure_model(tmp_path, "tiny", 0) == old
    assert model_builder.is_built(old)
    config = json.loads((old / "tokenizer_config.json").read_text())
    assert config["chat_template"] == model_builder.CHAT_TEMPLATE
    # A worker still on the old build and a router on the new one hash the routing canary
    # differently: the side that starts second refuses to (shared.canary_check), never silently.
    hasher = BlockHasher()
    after = AutoTokenizer.from_pretrained(old)
    assert canary(before, "m", hasher) != canary(after, "m", hasher)


def test_transformers_autotokenizer(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert tok.model_max_length == 2048
    text = "Hello world, 12 + 30 = 42!"
    assert tok.decode(tok.encode(text)) == text
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"


ENSURE = """
import sys
from pathlib import Path
from devmodel import builder as model_builder
log = Path(sys.argv[2])
def progress(msg):
    if "training tokenizer" in msg:
        with log.open("a") as f:
            f.write("built\\n")
print(model_builder.ensure_model(Path(sys.argv[1]), "tiny", 7, progress))
"""


@pytest.mark.pool
def test_ensure_model_builds_once_across_processes(tmp_path: Path) -> None:
    log = tmp_path / "builds.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", ENSURE, str(tmp_path / "cache"), str(log)]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    expected = tmp_path / "cache" / "models" / "mlxcel-tiny-s7"
    assert outs == [str(expected)] * 2
    assert log.read_text().count("built") == 1
    assert model_builder.is_built(expected)
    # Third call (in-process) reuses the cache without building.
    steps: list[str] = []
    assert model_builder.ensure_model(tmp_path / "cache", "tiny", 7, steps.append) == expected
    assert steps == []
