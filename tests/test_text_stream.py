"""Stop strings are cut exactly and never leak partially to the client."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.engine.text_stream import TextStream


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(tiny_model_dir)


def _run(tokenizer, text: str, stop: list[str]) -> tuple[list[str], bool, str]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer.detokenizer, stop)
    pieces: list[str] = []
    for t in ids:
        delta = stream.push(t)
        pieces.append(delta.text)
        if delta.stopped:
            return pieces, True, stream.finish()
    return pieces, False, stream.finish()


def test_no_stop_reproduces_text(tokenizer) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    pieces, stopped, tail = _run(tokenizer, text, [])
    assert not stopped
    assert "".join(pieces) + tail == text


def test_stop_string_cuts_before_it_and_holds_partial_matches(tokenizer) -> None:
    text = "alpha beta STOP gamma"
    pieces, stopped, tail = _run(tokenizer, text, ["STOP"])
    assert stopped
    assert "".join(pieces) + tail == "alpha beta "
    # No piece ever carried a prefix of the stop string.
    assert all("S" not in p for p in pieces)


def test_held_back_prefix_is_released_when_it_does_not_match(tokenizer) -> None:
    text = "one ST two"
    pieces, stopped, tail = _run(tokenizer, text, ["STOP"])
    assert not stopped
    assert "".join(pieces) + tail == text


def test_earliest_of_several_stops_wins(tokenizer) -> None:
    pieces, stopped, tail = _run(tokenizer, "a b c d e", ["d", "c"])
    assert stopped
    assert "".join(pieces) + tail == "a b "
