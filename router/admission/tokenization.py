"""The router's tokenizer: prompts become token ids here, so workers receive ids only.

Loaded once per router process (lifespan) with transformers' AutoTokenizer from the model
directory, local files only: the router never reaches the network and never imports mlx.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import queue
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from devmodel.paths import built_model_dir
from router.admission.tool_calls import ToolParser, infer_parser_name, load_parser
from shared.block_hash import template_signature
from shared.model_facts import FALLBACK_CONTEXT, ModelConfigError, model_facts

log = logging.getLogger(__name__)


class TokenizerLoadError(RuntimeError):
    """The model directory or its tokenizer cannot be used (raised at startup)."""


class ModelFilesMissing(TokenizerLoadError):
    """The model directory is not on this host, or lacks the files the router reads: no retry
    mends it, only copying (or mounting) the files does."""

    def __init__(self, message: str, model_dir: Path, missing: str) -> None:
        super().__init__(message)
        self.model_dir = model_dir
        self.missing = missing  # what is wrong, in words (`missing_model_files`)


# What load_tokenizer reads of a model directory, never its weights: config.json (the context
# length and vocabulary, and AutoTokenizer's choice of class), the tokenizer in one of its forms,
# and its configuration and chat template where present. Named in every hint to copy them.
TOKENIZER_FILES = (
    "tokenizer files (config.json, tokenizer.json, tokenizer_config.json, "
    "special_tokens_map.json and any chat_template.jinja; a slow tokenizer's tokenizer.model, "
    "or vocab.json and merges.txt; not the weights)"
)
# The tokenizer itself, in each form AutoTokenizer loads: a directory needs one of them.
_TOKENIZER_FORMS = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ChatTemplateError(ValueError):
    """A chat template (the model's or the request's) failed to render."""


class PromptTooLong(ValueError):
    """A rendered prompt longer than any text that fits the context (refused unencoded)."""

    def __init__(self, chars: int, limit: int) -> None:
        super().__init__(f"{chars} characters, more than {limit}")
        self.chars = chars
        self.limit = limit


# A text longer than this many characters per token of context cannot fit, whatever it
# tokenizes to (no tokenizer's tokens are this long on average): refused before tokenizing. A
# tokenizer whose every token is known to cover fewer characters gets its own, tighter bound
# (`chars_per_token_bound`).
MAX_CHARS_PER_TOKEN = 64
# The tightest per-tokenizer bound: well above any real text's characters per token.
MIN_CHARS_PER_TOKEN = 16
# Texts longer than this (characters) are tokenized on the copies of the large lane only.
LARGE_TEXT_CHARS = 16_384


class TokenizerPool:
    """Copies of one HF tokenizer, each used by one thread at a time (a fast tokenizer fails
    with "Already borrowed" when shared across threads), in two lanes: a text past
    LARGE_TEXT_CHARS takes only a copy of the large lane (a quarter of them, at least one) and
    waits for one, a shorter text takes any free copy, its own lane's first; so however many
    long prompts arrive together, the small lane's copies stay free for the short ones. With one
    copy both lanes share it."""

    def __init__(self, copies: list[Any]) -> None:
        self.first = copies[0]
        self._small: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._large: queue.SimpleQueue[Any] = (
            queue.SimpleQueue() if len(copies) > 1 else self._small
        )
        large = max(1, len(copies) // 4) if len(copies) > 1 else 0
        for i, hf in enumerate(copies):
            (self._large if i < large else self._small).put(hf)

    @contextmanager
    def borrow(self, chars: int = 0) -> Iterator[Any]:
        """A copy for a text of `chars` characters, given back to the lane it came from."""
        lane, hf = self._take(chars > LARGE_TEXT_CHARS)
        try:
            yield hf
        finally:
            lane.put(hf)

    def idle(self) -> bool:
        """Whether a copy for a short text is free now (a thread may take it first: then a short
        text waits for another short text's encoding, never a long one's)."""
        return not self._small.empty() or not self._large.empty()

    def _take(self, large: bool) -> tuple[queue.SimpleQueue[Any], Any]:
        if large:
            return self._large, self._large.get()
        for lane in (self._small, self._large):
            try:
                return lane, lane.get_nowait()
            except queue.Empty:
                pass
        return self._small, self._small.get()


@dataclass
class PromptTokenizer:
    pool: TokenizerPool
    context_length: int
    vocab_size: int
    default_template: str | None
    # A text longer than context_length times this cannot fit (load_tokenizer sets it).
    max_chars_per_token: int = MAX_CHARS_PER_TOKEN
    # Names this tokenizer to the grammar helpers (router.admission.grammar_sandbox), which hold its
    # view.
    grammar_key: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False)
    # llguidance's view of this tokenizer as its parts (router.admission.structured_output), built
    # once.
    _grammar_view: Any = field(default=None, init=False, repr=False, compare=False)
    _ll_tokenizer: Any = field(default=None, init=False, repr=False, compare=False)
    _grammar_lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    @property
    def hf(self) -> Any:
        """One copy, for reading its fixed attributes (never to encode: borrow one for that)."""
        return self.pool.first

    @property
    def max_chars(self) -> int:
        """The longest text (characters) whose tokens can fit the context."""
        return self.context_length * self.max_chars_per_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Completions: the text as the model's tokenizer encodes it (special tokens included,
        unless POST /tokenize asks for none)."""
        with self.pool.borrow(len(text)) as hf:
            return list(hf.encode(text, add_special_tokens=add_special_tokens))

    def token_strings(self, tokens: list[int]) -> list[str]:
        """Each id's vocabulary entry (POST /tokenize's `token_strs`, as vLLM writes them)."""
        with self.pool.borrow() as hf:
            return [str(t) for t in hf.convert_ids_to_tokens(tokens)]

    def decode(self, tokens: list[int]) -> str:
        """Token ids as text (completions `echo` of a prompt sent as ids)."""
        with self.pool.borrow() as hf:
            return str(hf.decode(tokens))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> tuple[list[int], str]:
        """Chat: render the template (the request's, else the model's) with `tools` and the
        request's extra template variables, then encode the text without adding special tokens
        again (the template writes them). Returns (ids, signature); PromptTooLong, before
        encoding, when the rendered text is longer than `max_chars`. The keyword flags are
        POST /tokenize's (vLLM's); a chat completion keeps their defaults.

        A `developer` message (OpenAI's newer name for system) keeps its role when the template
        names that role, and is rendered as `system` otherwise."""
        used = template if template is not None else self.default_template
        if not used:
            raise ChatTemplateError("the model has no chat template; pass `chat_template`")
        if "developer" not in used:
            messages = [
                {**m, "role": "system"} if m.get("role") == "developer" else m for m in messages
            ]
        with self.pool.borrow() as hf:
            try:
                text = hf.apply_chat_template(
                    messages,
                    tools=tools or None,
                    chat_template=used,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(template_kwargs or {}),
                )
            except Exception as exc:  # jinja2 errors of any kind: a bad template is bad input
                raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
        if len(text) > self.max_chars:
            raise PromptTooLong(len(text), self.max_chars)
        with self.pool.borrow(len(text)) as hf:
            ids = list(hf.encode(text, add_special_tokens=add_special_tokens))
        return ids, template_signature(used)

    def grammar_spec(self) -> tuple[str, int, Any]:
        """llguidance's tokenizer as the parts llguidance.hf.from_tokenizer builds it from (the
        tokenizer's JSON, the vocabulary size, the EOS id), which the grammar helpers load once
        each (router.admission.grammar_sandbox); built on the first request that needs it.
        ValueError: not a fast tokenizer."""
        with self._grammar_lock:
            return self._spec_locked()

    def _spec_locked(self) -> tuple[str, int, Any]:
        if self._grammar_view is None:
            with self.pool.borrow() as hf:
                if not isinstance(hf, PreTrainedTokenizerFast):
                    raise ValueError("only fast tokenizers are supported")
                backend = copy.copy(hf.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                n_vocab = max(self.vocab_size, len(hf))
                self._grammar_view = (backend.to_str(), n_vocab, hf.eos_token_id)
        return self._grammar_view

    def grammar_tokenizer(self) -> Any:
        """llguidance's LLTokenizer over this tokenizer, in this process (the router's checks
        run in the grammar helpers: this is for reading a grammar here), built once."""
        with self._grammar_lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer

                spec, n_vocab, eos = self._spec_locked()
                self._ll_tokenizer = LLTokenizer(spec, n_vocab=n_vocab, eos_token=eos)
            return self._ll_tokenizer

    def tool_parser(self, template: str | None = None) -> ToolParser | None:
        """mlx-lm's tool-call parser for the template that renders the prompt (the request's,
        else the model's, whose tokenizer config may name its parser), or None: no format."""
        name = None
        if template is None:
            name = getattr(self.hf, "init_kwargs", {}).get("tool_parser_type")
        if not isinstance(name, str):
            used = template if template is not None else self.default_template
            name = infer_parser_name(used, self.hf.get_vocab())
        return load_parser(name) if name else None


# apply_chat_template's own parameters: a chat_template_kwargs key may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    name
    for name in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    if name not in ("self", "kwargs")
) | {"messages"}


def missing_model_files(model_dir: Path) -> str | None:
    """What this host lacks of `model_dir` for `load_tokenizer`, in words ("there is no
    directory /m", "/m has no config.json"), else None. A few stats: cheap enough to ask
    whenever a model is seen."""
    if not model_dir.is_dir():
        return f"there is no directory {model_dir}"
    if not os.access(model_dir, os.R_OK | os.X_OK):
        return f"{model_dir} is not readable by this process"
    lacking = [] if (model_dir / "config.json").is_file() else ["config.json"]
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FORMS):
        lacking.append("tokenizer.json (nor tokenizer.model, nor vocab.json)")
    return f"{model_dir} has no {' and no '.join(lacking)}" if lacking else None


def own_model_fix(model_dir: Path) -> str:
    """How to mend the router's own model directory: build it, where it is the built-in model's
    (`devmodel.paths.built_model_dir`, what `configured_model_dir` names by default), else copy
    the tokenizer's files there or name another directory."""
    if model_dir == built_model_dir(model_dir.parent.parent):
        return f"run `mlxcel-pool build-model --out {model_dir}`"
    return (
        f"copy the model's {TOKENIZER_FILES} to {model_dir}, or set MLXCEL_MODEL to a model "
        "directory that has them"
    )


def load_tokenizer(model_dir: Path, copies: int = 1, fix: str | None = None) -> PromptTokenizer:
    """The tokenizer of `model_dir`, `copies` times. `fix` says how to mend a directory that is
    missing or broken (default: `own_model_fix`, for the router's own model).
    ModelFilesMissing: the directory or its files are not on this host; TokenizerLoadError: they
    are there but do not load."""
    hint = fix if fix is not None else own_model_fix(model_dir)
    missing = missing_model_files(model_dir)
    if missing is not None:
        host = socket.gethostname()
        message = f"cannot load the tokenizer: on this host ({host}) {missing}: {hint}"
        raise ModelFilesMissing(message, model_dir, missing)
    try:
        loaded = [
            AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            for _ in range(copies)
        ]
    except Exception as exc:  # transformers raises OSError/ValueError/... depending on the file
        raise TokenizerLoadError(
            f"cannot load the tokenizer from {model_dir}: {exc} ({hint})"
        ) from exc
    try:
        facts = model_facts(model_dir)
    except ModelConfigError as exc:
        raise TokenizerLoadError(f"{exc} ({hint})") from exc
    if not facts.context_from_config:
        log.warning("%s names no context length; assuming %d", model_dir, FALLBACK_CONTEXT)
    hf = loaded[0]
    template = getattr(hf, "chat_template", None)
    return PromptTokenizer(
        pool=TokenizerPool(loaded),
        context_length=facts.context_length,
        vocab_size=facts.vocab_size or len(hf),
        default_template=template if isinstance(template, str) else None,
        max_chars_per_token=chars_per_token_bound(hf),
    )


# Normalizers and pre-tokenizers that can drop characters (so that a run of them becomes no
# token at all), and tokenizer models that can cover an unknown span of any length with one
# token: with any of them a tokenizer's characters per token have no bound but the general one.
_DROPPING = frozenset(
    {
        "BertNormalizer",
        "StripAccents",
        "Strip",
        "Precompiled",
        "BertPreTokenizer",
        "Whitespace",
        "WhitespaceSplit",
        "CharDelimiterSplit",
    }
)


def chars_per_token_bound(hf: Any) -> int:
    """Characters one token of `hf` can stand for, at most, with a margin: twice its longest
    vocabulary entry (an entry is the token's bytes, or its characters, so at least the
    characters it covers; twice for a normalizer's composing of several characters into one),
    at least MIN_CHARS_PER_TOKEN. MAX_CHARS_PER_TOKEN where that does not hold: not a BPE
    model, an unknown token that can fuse a run of characters, a normalizer or pre-tokenizer
    that drops characters, an added token that absorbs the whitespace beside it."""
    try:
        spec = json.loads(hf.backend_tokenizer.to_str())
        model = spec["model"]
        if model.get("type") != "BPE":
            return MAX_CHARS_PER_TOKEN
        if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback"):
            return MAX_CHARS_PER_TOKEN
        if _drops_characters(spec.get("normalizer")) or _drops_characters(
            spec.get("pre_tokenizer")
        ):
            return MAX_CHARS_PER_TOKEN
        if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
            return MAX_CHARS_PER_TOKEN
        longest = max((len(t) for t in hf.get_vocab()), default=MAX_CHARS_PER_TOKEN)
    except Exception:  # a slow tokenizer, a backend of another shape: the general bound
        return MAX_CHARS_PER_TOKEN
    return min(MAX_CHARS_PER_TOKEN, max(MIN_CHARS_PER_TOKEN, 2 * longest))


def _drops_characters(component: Any) -> bool:
    stack = [component]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") in _DROPPING or node.get("behavior") == "Removed":
                return True
            if node.get("type") == "Replace" and not node.get("content"):
                return True
            stack.extend(v for v in node.values() if isinstance(v, dict | list))
    return False
