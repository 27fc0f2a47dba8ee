"""`text_offset` of tokens that came in one delta (router/relay/logprobs.py): each token is placed
where its text starts in the returned text, by the exact rule for a short run and forward for a
long one (an echoed prompt), and both agree on text whose characters each fit one token."""

from __future__ import annotations

import pytest

from router.relay.logprobs import EXACT_RUN, LogprobRenderer, TokenLogprob, TokenTable

PIECES = [b"The", b" quick", b" brown", b" fox", b"\xe6\x9d", b"\xb1", b" caf\xc3", b"\xa9"]


def offsets(ids: list[int], start: int = 0) -> list[int]:
    renderer = LogprobRenderer(TokenTable(PIECES), chat=False)
    text = b"".join(PIECES[i] for i in ids).decode("utf-8", "replace")
    tokens = [TokenLogprob(i, -1.0, [], start) for i in ids]
    return renderer.render(tokens, start + len(text))["text_offset"]


def where(ids: list[int], start: int = 0) -> list[int]:
    """Each token's start in the text, counted by decoding the tokens before it."""
    return [start + len(b"".join(PIECES[i] for i in ids[:k]).decode()) for k in range(len(ids))]


@pytest.mark.parametrize("repeat", [1, EXACT_RUN])  # a short run, then one past EXACT_RUN
def test_tokens_of_one_delta_each_get_their_own_offset(repeat: int) -> None:
    words = [0, 1, 2, 3] * repeat
    assert offsets(words, start=7) == where(words, start=7)


@pytest.mark.parametrize("repeat", [1, EXACT_RUN])
def test_a_character_split_over_tokens_counts_once(repeat: int) -> None:
    ids = [0, 4, 5, 6, 7] * repeat  # "The東 café" again and again: 東 and é span two tokens
    got = offsets(ids)
    text = b"".join(PIECES[i] for i in ids).decode()
    assert got == sorted(got) and got[-1] < len(text)
    for k, i in enumerate(ids):
        if i in (0, 6):  # a token that starts a character starts where its text does
            assert text[got[k] :].startswith(PIECES[i][:3].decode())


@pytest.mark.parametrize("repeat", [1, EXACT_RUN])
def test_text_before_the_tokens_own_shifts_nothing(repeat: int) -> None:
    """A run whose text starts with more than its tokens' bytes (a tokenizer's BOS text before
    an echoed prompt): every token is still placed where its own text is, from the run's end."""
    ids = [0, 1, 2, 3] * repeat
    renderer = LogprobRenderer(TokenTable(PIECES), chat=False)
    tokens = [TokenLogprob(i, -1.0, [], 0) for i in ids]
    bos = "<|begin_of_text|>"
    text = bos + b"".join(PIECES[i] for i in ids).decode()
    got = renderer.render(tokens, len(text))["text_offset"]
    assert got[1:] == where(ids, start=len(bos))[1:]


# "a 🚀 b" with the rocket as one token per byte, as a byte-level BPE tokenizer can emit it.
BYTE_PIECES = [b"a", b" ", b"\xf0", b"\x9f", b"\x9a", b"\x80", b" b"]


@pytest.mark.parametrize("repeat", [1, EXACT_RUN])
def test_a_character_split_into_byte_tokens_never_goes_backwards(repeat: int) -> None:
    """Every byte token of a 4-byte character starts where the character does (the text before
    it): decoded alone, its orphan continuation bytes must not count as a U+FFFD each."""
    renderer = LogprobRenderer(TokenTable(BYTE_PIECES), chat=False)
    ids = list(range(len(BYTE_PIECES))) * repeat
    tokens = [TokenLogprob(i, -1.0, [], 0) for i in ids]
    got = renderer.render(tokens, len("a 🚀 b") * repeat)["text_offset"]
    assert got[:7] == [0, 1, 2, 2, 2, 2, 3]
    assert got == sorted(got)
    # Equal to the length of the text emitted before each token (a pending character: none).
    emitted = [
        len(b"".join(BYTE_PIECES[i] for i in ids[:k]).decode(errors="ignore"))
        for k in range(len(ids))
    ]
    assert got == emitted
