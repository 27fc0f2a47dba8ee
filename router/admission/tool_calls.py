"""Tool calls parsed from a chat completion's text, in the router, with mlx-lm's own parsers.

Where the parsing runs: the router, not the worker. The router is the one place that knows
everything a parser needs: the template that rendered the prompt (the model's or the request's
own, which picks the tool-call format), the request's `tools` (some parsers type the arguments
by them) and `tool_choice` ("none": nothing is parsed). The worker stays format-blind and the
wire (StreamEvent) unchanged: it streams text deltas as for any request, and the router turns
them into `content` and `tool_calls` deltas as they arrive (ToolCallStream), so text inside the
tool-call markers is never also streamed as content.

The router must never import mlx, and importing any `mlx_lm` submodule runs `mlx_lm/__init__`,
which imports mlx. mlx-lm's `tool_parsers/*.py` are pure Python (json, ast, regex), so the
router loads that folder by its path as a package of its own name (`_mlxcel_tool_parsers`),
found with `importlib.util.find_spec("mlx_lm")`, which locates a top-level package without
running it. Where mlx-lm is not installed next to the router, tools still reach the template but
no tool call is parsed (logged once).

Which parser: the tokenizer config's `tool_parser_type` when the model names one, else the rules
of `mlx_lm.tokenizer_utils._infer_tool_parser` (copied in PARSER_BY_TEMPLATE: that module
imports mlx) applied to the template that rendered the prompt, then to the vocabulary.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

PACKAGE = "_mlxcel_tool_parsers"

# (markers the template holds, parser): mlx_lm.tokenizer_utils._infer_tool_parser's order.
PARSER_BY_TEMPLATE: list[tuple[tuple[str, ...], str]] = [
    (("<minimax:tool_call>",), "minimax_m2"),
    (("<|tool_call>", "<tool_call|>"), "gemma4"),
    (("<start_function_call>",), "function_gemma"),
    (("<longcat_tool_call>",), "longcat"),
    (("<arg_key>",), "glm47"),
    (("<|tool_list_start|>",), "pythonic"),
    (("<|tool_call_start|>",), "pythonic"),
    (("<tool_call>\\n<function=",), "qwen3_coder"),
    (("<tool_call>\n<function=",), "qwen3_coder"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (('<function name="', '<param name="'), "minicpm5"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<atem:function_calls>",), "muse_spark"),
    (("<tool_call>", "tool_call.name"), "json_tools"),
]


def infer_parser_name(template: str | None, vocab: dict[str, int] | None = None) -> str | None:
    if isinstance(template, str):
        for markers, name in PARSER_BY_TEMPLATE:
            if all(m in template for m in markers):
                return name
    if vocab and "<|tool_call_start|>" in vocab and "<|tool_call_end|>" in vocab:
        return "pythonic"
    return None


@dataclass(frozen=True)
class ToolParser:
    """One mlx-lm tool-call format: its markers and its `parse_tool_call(text, tools)`."""

    name: str
    start: str
    end: str  # "" (mistral): the call runs to the end of the output
    parse: Callable[[str, Any], Any]


def _package() -> ModuleType | None:
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    spec = importlib.util.find_spec("mlx_lm")  # top level: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = f"{next(iter(spec.submodule_search_locations))}/tool_parsers"
    pkg_spec = importlib.util.spec_from_file_location(
        PACKAGE, f"{folder}/__init__.py", submodule_search_locations=[folder]
    )
    if pkg_spec is None or pkg_spec.loader is None:
        return None
    pkg = importlib.util.module_from_spec(pkg_spec)
    sys.modules[PACKAGE] = pkg
    pkg_spec.loader.exec_module(pkg)
    return pkg


@functools.cache
def load_parser(name: str) -> ToolParser | None:
    """mlx-lm's parser `name` (a module of mlx_lm/tool_parsers), or None when unavailable."""
    if not name.isidentifier():
        return None
    try:
        if _package() is None:
            log.warning("mlx-lm is not installed next to the router: tool calls are not parsed")
            return None
        module = importlib.import_module(f"{PACKAGE}.{name}")
    except Exception:  # a parser mlx-lm does not ship, or one that fails to load
        log.warning("cannot load mlx-lm's tool parser %r", name, exc_info=True)
        return None
    return ToolParser(name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


def openai_tool_calls(parsed: Any) -> list[dict[str, Any]]:
    """A parser's answer ({name, arguments} or a list of them) as OpenAI `tool_calls` entries."""
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"not a tool call: {call!r}")
        args = call.get("arguments", {})
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        out.append(
            {
                "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        )
    return out


@dataclass
class ToolCallStream:
    """Splits completion text, as it streams, into content and tool calls.

    Text that could still be the start of the start marker is held back; text between the
    markers is kept out of the content and parsed when the end marker arrives (or at the end of
    the output). A call that does not parse goes out as content, markers and all, so no text is
    ever lost."""

    parser: ToolParser
    tools: list[dict[str, Any]] | None = None
    # `parallel_tool_calls: false`: 1. A call past it is dropped, text and all (vLLM's rule: the
    # first parsed call is kept).
    max_calls: int | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)  # every call parsed so far
    _held: str = ""
    _inside: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool calls completed by this text)."""
        buf, self._held = self._held + text, ""
        content: list[str] = []
        new: list[dict[str, Any]] = []
        start, end = self.parser.start, self.parser.end
        while buf:
            if not self._inside:
                at = buf.find(start)
                if at < 0:
                    keep = _prefix_suffix(buf, start)
                    content.append(buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep :]
                    break
                content.append(buf[:at])
                buf, self._inside = buf[at + len(start) :], True
            else:
                at = buf.find(end) if end else -1
                if at < 0:
                    self._held = buf
                    break
                content.append(self._parse(buf[:at], new, start + buf[: at + len(end)]))
                buf, self._inside = buf[at + len(end) :], False
        return "".join(content), new

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the output: a call left open (no end marker) is parsed as it stands."""
        held, self._held = self._held, ""
        if not self._inside:
            return held, []
        self._inside = False
        new: list[dict[str, Any]] = []
        return self._parse(held, new, self.parser.start + held), new

    def _parse(self, body: str, new: list[dict[str, Any]], raw: str) -> str:
        try:
            calls = openai_tool_calls(self.parser.parse(body, self.tools))
        except Exception as exc:  # any parser's failure: the model's text was no valid call
            log.info("unparsed %s tool call (%s): sent as content", self.parser.name, exc)
            return raw
        if self.max_calls is not None:
            calls = calls[: max(0, self.max_calls - len(self.calls))]
        new.extend(calls)
        self.calls.extend(calls)
        return ""


def _prefix_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
