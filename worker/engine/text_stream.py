"""Per-sequence text: streaming detokenization and stop strings.

Text that could still turn out to be the start of a stop string is held back, so a client never
sees part of a stop string. A stop string matches only where it ends in the text of a token
past the first `min_tokens` (vLLM's rule, which may take in held-back text before it); the
output ends right before it, or right after it with `include_stop`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TextDelta:
    text: str
    stopped: bool  # a stop string matched; `text` ends right before it


@dataclass
class TextStream:
    detokenizer: Any  # mlx_lm StreamingDetokenizer (a private copy per sequence)
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False  # a matched stop string stays in the text
    min_tokens: int = 0  # completion tokens whose text no stop string may end in
    _tokens: int = 0  # completion tokens pushed so far
    _held: str = ""
    _stopped: bool = False
    _pushed: bool = False
    matched: str | None = None  # the stop string that matched, once one did

    def prime(self, tokens: list[int]) -> None:
        """Continue the text after `tokens` (the prompt's last few, whose text the client has):
        their own text is dropped, and what follows keeps its leading space. Several, so a
        character whose bytes span the prompt's last tokens is decoded whole, not as U+FFFD."""
        for token in tokens:
            self.detokenizer.add_token(token)
        # What it holds back (a byte-level BPE holds a trailing space) is the prompt's too.
        self.detokenizer.finalize()
        _ = self.detokenizer.last_segment

    def push(self, token: int, silent: bool = False) -> TextDelta:
        """The text `token` adds. A `silent` one (an EOS generated past `ignore_eos`, special:
        vLLM skips its text) only counts toward min_tokens."""
        self._tokens += 1
        if silent:
            return TextDelta("", False)
        self._pushed = True
        self.detokenizer.add_token(token)
        return self._scan(self.detokenizer.last_segment)

    def finish(self) -> str:
        """Flush what the detokenizer and the stop-string hold-back kept."""
        if self._stopped or not self._pushed:
            return ""  # nothing after a stop string (or a primer's leftover) reaches the client
        self.detokenizer.finalize()
        delta = self._scan(self.detokenizer.last_segment)
        if delta.stopped:
            return delta.text
        out, self._held = delta.text + self._held, ""
        return out

    def _scan(self, segment: str) -> TextDelta:
        if not self.stop:
            return TextDelta(segment, False)
        text = self._held + segment
        found = self._match(text, len(self._held)) if self._tokens > self.min_tokens else None
        if found is not None:
            self._held = ""
            self._stopped = True
            cut, end = found
            self.matched = text[cut:end]
            return TextDelta(text[: end if self.include_stop else cut], True)
        keep = _longest_stop_prefix_suffix(text, self.stop)
        self._held = text[len(text) - keep :] if keep else ""
        return TextDelta(text[: len(text) - keep], False)

    def _match(self, text: str, new_from: int) -> tuple[int, int] | None:
        """(start, end) of the earliest stop string in `text` that ends past `new_from` (the
        held-back text never holds a whole one, except from before min_tokens)."""
        best: tuple[int, int] | None = None
        for s in self.stop:
            i = text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s))
        return best


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
