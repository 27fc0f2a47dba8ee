"""Bounds on what reaches llguidance's grammar compiler, checked in pure Python before it sees it.

llguidance compiles a JSON schema (and a Lark grammar) by recursion on the native stack, so a
schema whose `$ref`s chain through a few thousand definitions, or a Lark grammar whose rules do,
overflows the stack and kills the process (SIGSEGV), where a Python exception was wanted. With
llguidance 1.9 on an 8 MiB stack the crash begins at about:

    2,520 definitions each only a `$ref` to the next (about 90 KB of schema)
      930 objects nested through `$ref` (a definition whose one property refers to the next)
    1,050 `anyOf` levels through `$ref`; 1,100 arrays; 1,370 `allOf`
    2,000 definitions in one `$ref` cycle (each an object whose property refers to the next)
    2,650 Lark rules each referring to the next

Nesting written out in the schema's own JSON is refused by llguidance's JSON reader past 128
levels, with an error. The limits below sit far under the crashes (nesting followed through
`$ref`s at 256 containers is eight times under the shallowest, 2,100 containers of the anyOf
chain) and above what real schemas use. Crossing one is a `SchemaLimitError` naming the limit;
the router answers it with a 400 and the worker can run the same check on a job it takes.

Imports nothing outside the standard library (the router and the worker both use it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote


@dataclass(frozen=True)
class SchemaLimits:
    # `$ref`s anywhere in one schema.
    max_refs: int = 256
    # Entries of every `$defs` and `definitions` object in one schema, together.
    max_defs: int = 256
    # Containers (objects and arrays) nested in the schema's JSON as written.
    max_depth: int = 64
    # Containers nested when every `$ref` is followed into its target (a cycle counted once).
    max_ref_depth: int = 256
    # Property names of every `properties` object in one schema, together.
    max_properties: int = 2048
    # Values in one `enum`.
    max_enum: int = 2048
    # Characters of one regular expression: a `pattern`, a `patternProperties` key, a regex format.
    max_pattern_chars: int = 16_384
    # Rules and terminals defined in one Lark grammar.
    max_grammar_rules: int = 512


LIMITS = SchemaLimits()


class SchemaLimitError(ValueError):
    """A schema or grammar past one of the limits; the message names the limit, for the client."""


def check_schema(schema: Any, where: str, limits: SchemaLimits = LIMITS) -> None:
    """Raise SchemaLimitError when the JSON schema `schema` (as parsed JSON) crosses a limit;
    `where` names it in the message (e.g. "'response_format.json_schema.schema'")."""
    anchors = _walk(schema, where, limits)
    depth = _ref_depth(schema, anchors)
    if depth > limits.max_ref_depth:
        raise SchemaLimitError(
            f"{where} nests {depth} levels deep when its $refs are followed; at most "
            f"{limits.max_ref_depth} are accepted."
        )


def check_pattern(pattern: str, where: str, limits: SchemaLimits = LIMITS) -> None:
    if len(pattern) > limits.max_pattern_chars:
        raise SchemaLimitError(
            f"{where} is a regular expression of {len(pattern)} characters; at most "
            f"{limits.max_pattern_chars} are accepted."
        )


# A Lark definition: a rule (lowercase) or a terminal (uppercase), its modifiers and priority.
_LARK_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?[0-9]+)?[ \t]*:", re.M)
_LARK_JSON = re.compile(r"%json[ \t\r\n]*(?=\{)")


def check_lark(grammar: str, where: str, limits: SchemaLimits = LIMITS) -> None:
    """Raise SchemaLimitError when the Lark grammar defines too many rules or embeds (`%json`) a
    schema past a limit."""
    rules = len(_LARK_DEFINITION.findall(grammar))
    if rules > limits.max_grammar_rules:
        raise SchemaLimitError(
            f"{where} defines {rules} rules; at most {limits.max_grammar_rules} are accepted."
        )
    decoder = json.JSONDecoder()
    for match in _LARK_JSON.finditer(grammar):
        try:
            schema, _ = decoder.raw_decode(grammar, match.end())
        except (ValueError, RecursionError):
            continue  # not JSON: llguidance refuses the grammar with its own message
        check_schema(schema, f"A %json schema in {where}", limits)


def _walk(schema: Any, where: str, limits: SchemaLimits) -> dict[str, Any]:
    """The written-out limits, in one pass without recursion; returns the `$anchor`s by name.

    Keys are read as schema keywords wherever they appear (also inside `properties` or a
    `const`), which can only count more than the schema holds, never less."""
    refs = defs = properties = 0
    anchors: dict[str, Any] = {}
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise SchemaLimitError(
                f"{where} nests deeper than {limits.max_depth} levels; at most "
                f"{limits.max_depth} are accepted."
            )
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("$ref"), str):
            refs += 1
        if isinstance(node.get("$anchor"), str):
            anchors.setdefault(node["$anchor"], node)
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                defs += len(node[key])
        if isinstance(node.get("properties"), dict):
            properties += len(node["properties"])
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > limits.max_enum:
            raise SchemaLimitError(
                f"{where} has an enum of {len(enum)} values; at most {limits.max_enum} are "
                "accepted."
            )
        if isinstance(node.get("pattern"), str):
            check_pattern(node["pattern"], f"A pattern in {where}", limits)
        if isinstance(node.get("patternProperties"), dict):
            for key in node["patternProperties"]:
                check_pattern(key, f"A patternProperties key in {where}", limits)
        stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
    for count, limit, what in (
        (refs, limits.max_refs, "$refs"),
        (defs, limits.max_defs, "definitions ($defs and definitions)"),
        (properties, limits.max_properties, "properties"),
    ):
        if count > limit:
            raise SchemaLimitError(f"{where} has {count} {what}; at most {limit} are accepted.")
    return anchors


def _resolve(root: Any, ref: str, anchors: dict[str, Any]) -> Any:
    """The target of a `$ref` within this schema (a JSON pointer or an `$anchor` after `#`), or
    None when it points elsewhere; a target this misses is still bounded by the crash guard."""
    _, sep, fragment = ref.partition("#")
    if not sep:
        return None
    if not fragment.startswith("/"):
        return root if not fragment else anchors.get(unquote(fragment))
    node = root
    for part in fragment[1:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | list) else None


def _ref_depth(root: Any, anchors: dict[str, Any]) -> int:
    """Containers nested from `root` when each `$ref` counts as its target nested in place: a
    depth-first walk without recursion, each container's depth computed once, and a `$ref` back
    into a container still being walked (a cycle) counting nothing more."""
    if not isinstance(root, dict | list):
        return 0
    done: dict[int, int] = {}
    open_: set[int] = set()
    # (container, its children still to visit, the deepest child so far)
    stack: list[tuple[Any, list[Any], list[int]]] = []

    def children(node: Any) -> list[Any]:
        items = list(node.values()) if isinstance(node, dict) else list(node)
        kids = [v for v in items if isinstance(v, dict | list)]
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            target = _resolve(root, node["$ref"], anchors)
            if target is not None:
                kids.append(target)
        return kids

    open_.add(id(root))
    stack.append((root, children(root), [0]))
    while stack:
        node, kids, best = stack[-1]
        if kids:
            kid = kids.pop()
            if id(kid) in done:
                best[0] = max(best[0], done[id(kid)])
            elif id(kid) not in open_:
                open_.add(id(kid))
                stack.append((kid, children(kid), [0]))
            continue
        stack.pop()
        open_.discard(id(node))
        done[id(node)] = best[0] + 1
        if stack:
            parent_best = stack[-1][2]
            parent_best[0] = max(parent_best[0], done[id(node)])
    return done[id(root)]


def check_grammar(grammar: str, where: str, limits: SchemaLimits = LIMITS) -> None:
    """The same limits over an llguidance grammar text as the router hands it to a worker:
    `{"grammars": [{"json_schema": ...} | {"lark_grammar": ...}]}` or plain Lark, so a job no
    router validated (forged, or from an older router) cannot crash the compiler either."""
    try:
        parsed = json.loads(grammar)
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        check_lark(grammar, where, limits)
        return
    for part in parsed.get("grammars") or []:
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("json_schema"), dict):
            check_schema(part["json_schema"], where, limits)
        if isinstance(part.get("lark_grammar"), str):
            check_lark(part["lark_grammar"], where, limits)
