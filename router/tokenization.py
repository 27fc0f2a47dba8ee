"""The router's tokenizer: prompts become token ids here, so workers receive ids only.

Loaded once per router process (lifespan) with transformers' AutoTokenizer from the model
directory, local files only: the router never reaches the network and never imports mlx.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llguidance.hf import from_tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from router.tool_calls import ToolParser, infer_parser_name, load_parser
from shared.block_hash import template_signature
from shared.model_facts import FALLBACK_CONTEXT, ModelConfigError, model_facts

log = logging.getLogger(__name__)


class TokenizerLoadError(RuntimeError):
    """The model directory or its tokenizer cannot be used (raised at startup)."""


class ChatTemplateError(ValueError):
    """A chat template (the model's or the request's) failed to render."""


class TokenizerPool:
    """Copies of one HF tokenizer, each used by one thread at a time (a fast tokenizer fails
    with "Already borrowed" when shared across threads): a long tokenization holds one copy
    while other requests on the same process use the rest."""

    def __init__(self, copies: list[Any]) -> None:
        self.first = copies[0]
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for hf in copies:
            self._free.put(hf)

    @contextmanager
    def borrow(self) -> Iterator[Any]:
        hf = self._free.get()
        try:
            yield hf
        finally:
            self._free.put(hf)


@dataclass
class PromptTokenizer:
    pool: TokenizerPool
    context_length: int
    vocab_size: int
    default_template: str | None
    # llguidance's view of this tokenizer (router.structured_output), built on first use.
    _grammar_view: Any = field(default=None, init=False, repr=False, compare=False)
    _grammar_lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    @property
    def hf(self) -> Any:
        """One copy, for reading its fixed attributes (never to encode: borrow one for that)."""
        return self.pool.first

    def encode(self, text: str) -> list[int]:
        """Completions: the text as the model's tokenizer encodes it (special tokens included)."""
        with self.pool.borrow() as hf:
            return list(hf.encode(text))

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
    ) -> tuple[list[int], str]:
        """Chat: render the template (the request's, else the model's) with `tools` and the
        request's extra template variables, then encode the text without adding special tokens
        again (the template writes them). Returns (ids, signature).

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
                    add_generation_prompt=True,
                    **(template_kwargs or {}),
                )
            except Exception as exc:  # jinja2 errors of any kind: a bad template is bad input
                raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
            ids = list(hf.encode(text, add_special_tokens=False))
        return ids, template_signature(used)

    def grammar_tokenizer(self) -> Any:
        """llguidance's LLTokenizer over this tokenizer, which checks a response_format's grammar
        (router.structured_output): built once, on the first request that needs it (slow for a
        large vocabulary), then shared by every thread."""
        with self._grammar_lock:
            if self._grammar_view is None:
                with self.pool.borrow() as hf:
                    self._grammar_view = from_tokenizer(hf, n_vocab=max(self.vocab_size, len(hf)))
            return self._grammar_view

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


def load_tokenizer(model_dir: Path, copies: int = 1) -> PromptTokenizer:
    hint = "run `mlxcel-pool build-model` or set MLXCEL_MODEL to a model directory"
    if not model_dir.is_dir():
        raise TokenizerLoadError(f"model directory {model_dir} does not exist ({hint})")
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
    )
