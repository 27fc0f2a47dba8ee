"""`response_format` -> one llguidance grammar, checked here so a worker only ever compiles a
grammar that compiled at the router.

    {"type": "text"}                                        -> None (no constraint)
    {"type": "json_object"}                                 -> any JSON object
    {"type": "json_schema", "json_schema": {"name", "schema"?, "strict"?}}
                                                            -> JSON valid against "schema"
    {"type": "regex", "regex": "..."}                       -> text the regex matches whole
    {"type": "grammar", "grammar": "<lark>"}                -> text the Lark grammar derives

`grammar_for` returns the grammar string `GenerationRequest.grammar` carries, or raises
`FormatError` (a 400 naming `response_format`): a malformed format, an unknown type, a schema,
regex or grammar past a bound of shared/schema_limits.py (checked before llguidance sees it: past
them its compiler overflows the native stack), past `MAX_GRAMMAR_BYTES`, or one llguidance
refuses. llguidance's check against the tokenizer runs in a helper process
(router/admission/grammar_sandbox.py), so a grammar that still crashes it costs only its own
request. The worker enforces it while decoding (worker/engine/grammar.py). JSON is compact (no
whitespace between tokens) unless a schema's own `x-guidance` options say otherwise: with flexible
whitespace a model can pad forever, and a bounded schema would no longer bound the output.

Imports llguidance (no mlx): its compiler and validator are plain Rust behind Python.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher

from router.admission.grammar_sandbox import (
    CallFailed,
    HelperCrashed,
    HelperTimeout,
    SetupFailed,
    load_tokenizer,
    sandbox,
    validate_grammar,
)
from router.admission.tokenization import PromptTokenizer
from shared.schema_limits import SchemaLimitError, check_lark, check_pattern, check_schema
from shared.wire import GRAMMAR_LIMITS, MAX_GRAMMAR_BYTES

PARAM = "response_format"
TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
# llguidance's JSON compile options, before a schema's own `x-guidance`: compact JSON.
JSON_DEFAULTS = {"whitespace_flexible": False}
# The worker's limits (LLParserLimits keywords, sent to the helper); errors without the parser's
# state dump (the client's own schema, but pages of it).
_LIMITS: dict[str, Any] = {**GRAMMAR_LIMITS, "verbose_errors": False}
# The longest llguidance message quoted back to the client.
MAX_MESSAGE_CHARS = 400


class FormatError(ValueError):
    """A response_format this pool cannot enforce; the message is for the client, `param` the
    request field it names when not the caller's own (a tool's parameters: "tools")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def grammar_for(fmt: dict[str, Any] | None, tokenizer: PromptTokenizer) -> str | None:
    """The llguidance grammar that enforces `fmt` (None: plain text), validated against the
    model's tokenizer."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in TYPES:
        raise FormatError(
            f"'response_format.type' must be one of {', '.join(TYPES)}; got {kind!r}."
        )
    if kind == "text":
        return None
    grammar = _compile(kind, fmt)
    size = len(grammar.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise FormatError(_too_big(size))
    _validate(grammar, tokenizer)
    return grammar


def _compile(kind: str, fmt: dict[str, Any]) -> str:
    try:
        _check_limits(kind, fmt)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(_schema_text(fmt), defaults=JSON_DEFAULTS)
        text = _source(fmt, kind)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(text)
        return LLMatcher.grammar_from_lark(text)
    except FormatError:
        raise
    except SchemaLimitError as exc:
        raise FormatError(str(exc)) from exc
    except Exception as exc:  # llguidance's own ValueErrors, a schema json cannot write, ...
        raise FormatError(f"'response_format' cannot be compiled: {_short(exc)}") from exc


def _check_limits(kind: str, fmt: dict[str, Any]) -> None:
    """shared/schema_limits.py's bounds on what llguidance will compile (SchemaLimitError)."""
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, dict):
            check_schema(schema, "'response_format.json_schema.schema'")
    elif kind == "regex" and isinstance(fmt.get("regex"), str):
        check_pattern(fmt["regex"], "'response_format.regex'")
    elif kind == "grammar" and isinstance(fmt.get("grammar"), str):
        check_lark(fmt["grammar"], "'response_format.grammar'")


def _schema_text(fmt: dict[str, Any]) -> str:
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise FormatError("'response_format.json_schema' must be an object with a 'name'.")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise FormatError("'response_format.json_schema.name' must be a non-empty string.")
    if not isinstance(spec.get("strict", False), bool | None):
        raise FormatError("'response_format.json_schema.strict' must be a boolean.")
    schema = spec.get("schema", {"type": "object"})  # no schema: any JSON object
    if not isinstance(schema, dict):
        raise FormatError("'response_format.json_schema.schema' must be a JSON Schema object.")
    text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    if len(text) > MAX_GRAMMAR_BYTES:  # characters: a cheap bound before any bytes are made
        raise FormatError(_too_big(len(text)))
    return text


def _source(fmt: dict[str, Any], kind: str) -> str:
    text = fmt.get(kind)
    if not isinstance(text, str) or not text:
        raise FormatError(f"'response_format.{kind}' must be a non-empty string.")
    if len(text) > MAX_GRAMMAR_BYTES:
        raise FormatError(_too_big(len(text)))
    return text


def _validate(grammar: str, tokenizer: PromptTokenizer, what: str = f"'{PARAM}'") -> None:
    """llguidance's check of `grammar` against the model's tokenizer, in a helper process."""
    key = tokenizer.grammar_key

    def setup() -> tuple[Any, tuple[Any, ...]]:
        return load_tokenizer, (key, *tokenizer.grammar_spec())

    try:
        is_error, messages = sandbox().call(
            validate_grammar, key, grammar, _LIMITS, key=key, setup=setup
        )
    except (SetupFailed, ValueError) as exc:  # not a fast tokenizer, a vocabulary it cannot read
        raise FormatError(
            f"{what} is not available for this model's tokenizer: {_short(exc)}"
        ) from exc
    except HelperCrashed as exc:
        raise FormatError(
            f"{what} cannot be enforced: the grammar compiler crashed on it ({exc}); "
            "simplify the schema or grammar (fewer or shallower $refs, definitions or rules)."
        ) from exc
    except HelperTimeout as exc:
        raise FormatError(f"{what} cannot be enforced: {exc}.") from exc
    except CallFailed as exc:  # llguidance answers with a message; this is belt and braces
        is_error, messages = True, [_short(exc)]
    if is_error:
        detail = _clip(messages[0]) if messages else "rejected by llguidance"
        raise FormatError(f"{what} cannot be enforced: {detail}")


# mlx-lm tool-call formats a grammar can make the model write: the call between the parser's
# markers is one JSON object {"name": ..., "arguments": {...}}.
JSON_CALL_FORMATS = frozenset({"json_tools"})


def forced_call_grammar(
    tools: list[dict[str, Any]], name: str | None, parser: Any, tokenizer: PromptTokenizer
) -> str:
    """A grammar under which the model writes exactly one call, in the template's tool-call
    format (`parser`: router.admission.tool_calls.ToolParser), of the function `name` (None: any of
    `tools`), its arguments valid against that function's parameters. FormatError when the
    format is not one a grammar can write or a parameter schema does not compile; one past a
    bound of shared/schema_limits.py names "tools"."""
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        try:
            if isinstance(params, dict):
                check_schema(params, f"'tools[{i}].function.parameters'")
        except SchemaLimitError as exc:
            raise FormatError(str(exc), "tools") from exc
    if parser is None or parser.name not in JSON_CALL_FORMATS:
        known = parser.name if parser is not None else "none"
        raise FormatError(
            f"Forcing a tool call needs a chat template whose calls are JSON between markers "
            f"({', '.join(sorted(JSON_CALL_FORMATS))}); this template's format is {known}."
        )
    variants = []
    for i, fn in enumerate(t["function"] for t in tools):
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        if params.get("type", "object") != "object":
            raise FormatError(f"The parameters of {fn['name']!r} must be an object schema.")
        # Its own base URI: a `#...` $ref in the parameters resolves against them, not against
        # the call object they are nested in.
        params = {"$id": f"urn:mlxcel:tool:{i}", **params}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not variants:
        raise FormatError(f"No tool named {name!r} is declared.")
    # anyOf, not oneOf: the names are consts, so the branches never overlap, and llguidance
    # would have to prove that for oneOf (two tools of one name would be refused).
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": JSON_DEFAULTS}
    try:
        lark = (
            f"start: {json.dumps(parser.start)} call {json.dumps(parser.end)}\n"
            f"call: %json {json.dumps(schema, ensure_ascii=False, allow_nan=False)}"
        )
        grammar = LLMatcher.grammar_from_lark(lark)
    except Exception as exc:
        raise FormatError(f"The tools' parameters cannot be compiled: {_short(exc)}") from exc
    size = len(grammar.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise FormatError(_too_big(size))
    _validate(grammar, tokenizer, "A forced tool call")
    return grammar


def _too_big(size: int) -> str:
    return (
        f"'response_format' compiles to a grammar of {size} bytes; at most "
        f"{MAX_GRAMMAR_BYTES} are accepted."
    )


def _short(exc: BaseException) -> str:
    return _clip(str(exc) or type(exc).__name__)


def _clip(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."
