"""The bounds on what reaches llguidance (shared/schema_limits.py), the 404's quoting of a model
name, and the tokenizer's character bound and lanes (router/admission/tokenization.py): pure Python
and the tiny model's real tokenizer, no pool."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from router.admission.admit import MAX_CHARS_PER_TOKEN, quoted
from router.admission.tokenization import (
    LARGE_TEXT_CHARS,
    MIN_CHARS_PER_TOKEN,
    TokenizerPool,
    chars_per_token_bound,
    load_tokenizer,
)
from router.pool_view.model_catalog import unknown_model_message
from shared.schema_limits import LIMITS, SchemaLimitError, check_lark, check_schema


def ref_chain(n: int) -> dict[str, Any]:
    """The issue's reproducer: n definitions, each only a $ref to the next."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def nested_through_refs(n: int) -> dict[str, Any]:
    """n objects, each one property that refers to the next definition."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    return {"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def refused(schema: Any) -> str:
    with pytest.raises(SchemaLimitError) as exc:
        check_schema(schema, "'s'")
    return str(exc.value)


def test_the_ref_chain_is_refused_naming_the_limit() -> None:
    message = refused(ref_chain(3000))
    assert "$refs" in message and str(LIMITS.max_refs) in message
    check_schema(ref_chain(200), "'s'")  # a long chain still far from the crash passes


def test_nesting_followed_through_refs_is_bounded_cycles_counted_once() -> None:
    assert "levels deep when its $refs are followed" in refused(nested_through_refs(120))
    check_schema(nested_through_refs(60), "'s'")
    # One cycle through 150 definitions: each walked once, still too deep.
    cycle = {
        "$defs": {
            f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{(i + 1) % 150}"}}}
            for i in range(150)
        },
        "$ref": "#/$defs/d0",
    }
    assert "$refs are followed" in refused(cycle)
    # A recursive tree (a cycle of one) is as deep as it is written.
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    check_schema(tree, "'s'")


def test_each_written_out_limit() -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(LIMITS.max_depth):
        deep = {"type": "array", "items": deep}
    assert f"deeper than {LIMITS.max_depth}" in refused(deep)
    many_defs = {"$defs": {f"d{i}": {"type": "integer"} for i in range(LIMITS.max_defs + 1)}}
    assert "definitions" in refused(many_defs)
    props = {
        "type": "object",
        "properties": {f"p{i}": {} for i in range(LIMITS.max_properties + 1)},
    }
    assert "properties" in refused(props)
    assert "enum of" in refused({"enum": list(range(LIMITS.max_enum + 1))})
    assert "regular expression" in refused({"type": "string", "pattern": "a" * 20_000})
    assert "patternProperties" in refused({"patternProperties": {"a" * 20_000: {}}})


def test_a_real_schema_passes() -> None:
    from tests.test_structured_output import SCHEMA

    check_schema(SCHEMA, "'s'")
    wide = {
        "type": "object",
        "properties": {
            f"p{i}": {
                "type": "object",
                "properties": {f"q{j}": {"enum": ["a", "b", "c"]} for j in range(20)},
            }
            for i in range(90)
        },
    }
    check_schema(wide, "'s'")  # 1,890 properties, about 100 KB: within every limit


def test_lark_rules_and_embedded_json_schemas() -> None:
    rules = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(600)) + '\nr600: "a"'
    with pytest.raises(SchemaLimitError, match="defines 602 rules"):
        check_lark(rules, "'g'")
    import json

    with pytest.raises(SchemaLimitError, match=r"A %json schema in 'g' has 3001 \$refs"):
        check_lark(f"start: %json {json.dumps(ref_chain(3000))}", "'g'")
    check_lark('start: "a" | b\nb: %json {"type": "integer"}', "'g'")


def test_the_404_quotes_a_long_model_name_cut() -> None:
    assert quoted("m") == "'m'"
    name = "x" * 10_000_000
    message = unknown_model_message(name, ["tiny"])
    assert len(message) < 400 and "(10000000 characters)" in message and "'tiny'" in message
    assert message.startswith("The model '" + "x" * 200 + "...'")


def test_the_character_bound_comes_from_the_vocabulary(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    longest = max(len(t) for t in tok.hf.get_vocab())
    assert tok.max_chars_per_token == chars_per_token_bound(tok.hf)
    assert tok.max_chars_per_token == min(
        MAX_CHARS_PER_TOKEN, max(MIN_CHARS_PER_TOKEN, 2 * longest)
    )
    assert (
        tok.max_chars
        == tok.context_length * tok.max_chars_per_token
        < (tok.context_length * MAX_CHARS_PER_TOKEN)
    )
    # No text past the bound tokenizes to fewer tokens than the context: here, the text made of
    # the vocabulary's longest entry, its bound worth of it, still needs more tokens than that.
    entry = max(tok.hf.get_vocab(), key=len)
    text = tok.hf.convert_tokens_to_string([entry]) * tok.context_length
    assert len(tok.encode(text)) >= tok.context_length


def test_a_long_text_never_holds_the_small_lane() -> None:
    pool = TokenizerPool(["big", "s1", "s2", "s3"])
    held = threading.Event()
    release = threading.Event()

    def hold_large() -> None:
        with pool.borrow(LARGE_TEXT_CHARS + 1):
            held.set()
            release.wait(5)

    thread = threading.Thread(target=hold_large)
    thread.start()
    held.wait(5)
    with pool.borrow(10) as a, pool.borrow(10) as b, pool.borrow(10) as c:
        assert {a, b, c} == {"s1", "s2", "s3"}  # all three small copies, the large one held
    release.set()
    thread.join()
    with pool.borrow(10) as a, pool.borrow(10) as b, pool.borrow(10) as c, pool.borrow(1) as d:
        assert {a, b, c, d} == {"big", "s1", "s2", "s3"}  # a short text may take the large one
    alone = TokenizerPool(["only"])
    with alone.borrow(LARGE_TEXT_CHARS + 1) as hf:
        assert hf == "only"


def test_the_worker_checks_the_grammar_it_is_handed_before_compiling_it() -> None:
    """A job no router validated (forged, or from an older router) carrying the $ref chain that
    crashes llguidance fails as the caller's error before native code sees it."""
    from llguidance import LLMatcher

    from worker.engine.grammar import GrammarError, GrammarTokenizer

    chain = {
        "$defs": {
            **{f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)},
            "d3000": {"type": "integer"},
        },
        "$ref": "#/$defs/d0",
    }
    grammar = LLMatcher.grammar_from_json_schema(chain)
    tokenizer = GrammarTokenizer(None, 8, frozenset())  # never built: the check comes first
    with pytest.raises(GrammarError, match=r"\$ref"):
        tokenizer.compile(grammar)
    with pytest.raises(GrammarError, match="rules"):
        tokenizer.compile("start: a\n" + "".join(f'r{i}: "x"\n' for i in range(600)))
