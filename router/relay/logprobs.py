"""Logprobs in OpenAI's shapes, from the ids and floats a worker streams (StreamEvent.logprobs):
the router renders token strings and bytes with its own tokenizer, so the worker sends numbers
only.

Which distribution the numbers come from is the worker's choice, documented in
worker/engine/sampling.py: the log-softmax after the request's penalties and logit bias, before
temperature and top-k/top-p/min-p (for neutral controls, the model's own log-softmax).

Shapes:
- completions (`logprobs: k`, the legacy API): `{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}`, each a list with one item per token; an item of `top_logprobs` maps the k
  most likely tokens' strings to their logprobs, plus the sampled token's (up to k + 1 keys);
- chat (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...k]}]}`.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

from router.admission.tokenization import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token (or, with completions' echo, prompt token), as the worker reported it."""

    token: int
    logprob: float | None  # None: a prompt's first token (nothing before it to condition on)
    top: list[tuple[int, float]] | None  # the most likely tokens, most likely first
    offset: int  # characters of text before this token's delta (the echoed prompt: 0)


def from_event(token_ids: list[int], entries: list[list[Any]], offset: int) -> list[TokenLogprob]:
    """A delta's tokens with their entries (the decoder checked there is one per token)."""
    return [
        TokenLogprob(tid, lp, list(zip(ids, lps, strict=True)), offset)
        for tid, (lp, ids, lps) in zip(token_ids, entries, strict=True)
    ]


class TokenTable:
    """Every token id's bytes (what it adds to the text), built once per tokenizer."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._bytes = pieces
        self._text: dict[int, str] = {}

    def bytes_of(self, token: int) -> bytes:
        return self._bytes[token] if 0 <= token < len(self._bytes) else b""

    def text_of(self, token: int) -> str:
        """The token's text; part of a multi-byte character shows as U+FFFD (its `bytes` in
        the chat shape are exact)."""
        text = self._text.get(token)
        if text is None:
            text = self._text[token] = self.bytes_of(token).decode("utf-8", errors="replace")
        return text


_TABLES: dict[int, tuple[PromptTokenizer, TokenTable]] = {}  # id(tokenizer) -> (it, its table)
_TABLES_LOCK = threading.Lock()


def token_table(tokenizer: PromptTokenizer) -> TokenTable:
    """The tokenizer's table (blocking the first time: call it off the event loop)."""
    found = _TABLES.get(id(tokenizer))
    if found is not None and found[0] is tokenizer:
        return found[1]
    with _TABLES_LOCK:
        found = _TABLES.get(id(tokenizer))
        if found is None or found[0] is not tokenizer:
            with tokenizer.pool.borrow() as hf:
                table = TokenTable(_token_bytes(hf, tokenizer.vocab_size))
            _TABLES[id(tokenizer)] = found = (tokenizer, table)
    return found[1]


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: a byte-level BPE token's characters -> bytes."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(hf: Any) -> set[str]:
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # a tokenizer that cannot describe itself: decode token by token
        return set()
    return {decoder.get("type"), *(d.get("type") for d in decoder.get("decoders") or [])}


def _token_bytes(hf: Any, vocab_size: int) -> list[bytes]:
    """Each id's bytes: byte-level BPE pieces mapped back to bytes, SentencePiece pieces with
    their byte fallback and word marks, added tokens as their text; any other tokenizer decodes
    each id alone (exact unless a character spans tokens)."""
    n = max(vocab_size, len(hf))
    pieces = hf.convert_ids_to_tokens(list(range(n)))
    added = set(getattr(hf, "added_tokens_decoder", {}) or {})
    kinds = _decoder_types(hf)
    out: list[bytes] = []
    for tid, piece in enumerate(pieces):
        if piece is None:
            out.append(b"")
        elif tid in added:
            out.append(piece.encode("utf-8"))
        elif "ByteLevel" in kinds and all(c in _BYTE_DECODER for c in piece):
            out.append(bytes(_BYTE_DECODER[c] for c in piece))
        elif "ByteFallback" in kinds or "Metaspace" in kinds:
            byte = _BYTE_FALLBACK.fullmatch(piece)
            out.append(
                bytes([int(byte.group(1), 16)])
                if byte
                else piece.replace("\u2581", " ").encode("utf-8")
            )
        else:
            out.append(hf.decode([tid]).encode("utf-8"))
    return out


# The longest run of tokens sharing one offset placed by the exact (quadratic) rule.
EXACT_RUN = 64


class LogprobRenderer:
    def __init__(self, table: TokenTable, chat: bool) -> None:
        self.table = table
        self.chat = chat

    def render(self, tokens: list[TokenLogprob], end: int | None = None) -> dict[str, Any]:
        """`end`: characters of completion text sent so far (where the last delta ends)."""
        return self._chat(tokens) if self.chat else self._completion(tokens, end)

    def _chat_item(self, token: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.table.text_of(token),
            "logprob": logprob,
            "bytes": list(self.table.bytes_of(token)),
        }

    def _chat(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for t in tokens:  # chat has no echo: every token has its logprob
            item = self._chat_item(t.token, t.logprob or 0.0)
            item["top_logprobs"] = [self._chat_item(tid, lp) for tid, lp in t.top or []]
            content.append(item)
        return {"content": content}

    def _offsets(self, tokens: list[TokenLogprob], end: int | None) -> list[int]:
        """Each token's `text_offset`. Tokens that came in one delta share its start; each is
        placed where the delta's text minus the text of it and the tokens after it ends (a
        character split over tokens counts once; a token inside one starts where it does), within
        the delta's span. A run longer than
        EXACT_RUN (an echoed prompt) is placed by the characters the tokens from it to the run's
        end decode to, counted forward: linear, where the exact rule is quadratic in the run.
        Both count back from the run's end, so text before its tokens' own (a BOS's) is skipped."""
        out = [t.offset for t in tokens]
        i = 0
        while i < len(tokens):
            j = i
            while j + 1 < len(tokens) and tokens[j + 1].offset == tokens[i].offset:
                j += 1
            stop = tokens[j + 1].offset if j + 1 < len(tokens) else end
            if j > i and stop is not None:
                start = tokens[i].offset
                before, inside, chars = self._counted_forward(tokens[i : j + 1])
                if j - i < EXACT_RUN:
                    tail = b""
                    for k in range(j, i, -1):
                        tail = self.table.bytes_of(tokens[k].token) + tail
                        # A token inside a character (one of a 4-byte emoji's byte tokens) starts
                        # where that character does: decoded alone, its orphan bytes would each
                        # count as a U+FFFD and place it before the tokens ahead of it.
                        after = (
                            chars - before[k - i]
                            if inside[k - i]
                            else len(tail.decode("utf-8", "replace"))
                        )
                        out[k] = min(max(start, stop - after), stop)
                else:  # each token's text before it, counted forward, placed from the end
                    for k, seen in zip(range(i, j + 1), before, strict=True):
                        out[k] = min(max(start, stop - (chars - seen)), stop)
            i = j + 1
        return out

    def _counted_forward(self, run: list[TokenLogprob]) -> tuple[list[int], list[bool], int]:
        """For each token of a run: the characters its tokens before it decode to, and whether
        it starts inside a character (bytes of one are pending); then the run's characters."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        before: list[int] = []
        inside: list[bool] = []
        chars = 0
        for t in run:
            before.append(chars)
            inside.append(bool(decoder.getstate()[0]))
            chars += len(decoder.decode(self.table.bytes_of(t.token)))
        chars += len(decoder.decode(b"", final=True))
        return before, inside, chars

    def _completion(self, tokens: list[TokenLogprob], end: int | None) -> dict[str, Any]:
        text_of = self.table.text_of
        tops: list[dict[str, float] | None] = []
        for t in tokens:
            if t.logprob is None or t.top is None:  # an echoed prompt's first token
                tops.append(None)
                continue
            top = {text_of(tid): lp for tid, lp in t.top}
            top.setdefault(text_of(t.token), t.logprob)  # the sampled token is always listed
            tops.append(top)
        return {
            "tokens": [text_of(t.token) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": tops,
            "text_offset": self._offsets(tokens, end),
        }
