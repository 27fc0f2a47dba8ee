"""Structured outputs while decoding: a request's grammar (`GenerationRequest.grammar`, which
router/admission/structured_output.py compiled from its `response_format`) as one more logits
processor.

`GrammarConstraint` holds the sequence's llguidance `LLMatcher`, a copy of the one its grammar
compiled to (worker/engine/grammar_compile.py compiles each grammar once, off the loop). Each
call consumes the sequence's newest generated token(s) (the tokens past its prompt that it has
not consumed yet; prompt tokens never reach the matcher), then sets every token the grammar
does not allow next to -inf. It is the sequence's LAST processor (after the penalties and
logit_bias, see worker/engine/sampling.py), so whatever the bias adds, a disallowed token stays
at -inf and cannot be sampled at any temperature or truncation; logprobs (the log-softmax after
the processors) are those of the constrained distribution. Once the grammar is complete the
matcher allows only the model's EOS tokens, which end the sequence with finish_reason "stop".

A token the matcher rejects (it can only be sampled past the mask: a NaN row, a grammar that
allows nothing) never raises inside BatchGenerator's step, where an exception would fail the
whole batch: the constraint records `error`, allows only EOS from then on, and the engine
fails that request alone when it reads the step's token.

Per step the matcher writes its mask as a bitmask (one bit per token, numpy, computed in
Rust); numpy unpacks it and one `mx.where` applies it: no Python loop over the vocabulary.
Reading the newest token makes the step wait for the previous one (`tolist`), so a batch with
a constrained sequence gives up the overlap of one step's sampling with the next.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.hf import from_tokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from shared.schema_limits import SchemaLimitError, check_grammar
from shared.wire import GRAMMAR_LIMITS

# The longest llguidance message an error event quotes (its parser-state dump is pages).
MAX_ERROR_CHARS = 300
# The worker cannot tell which request field a grammar came from.
GRAMMAR_SOURCE = "The grammar of response_format or tool_choice"


class GrammarError(ValueError):
    """A grammar the matcher cannot compile (a job the router would not have written)."""


class GrammarTokenizer:
    """llguidance's view of the worker's tokenizer, with the model's EOS tokens (the ones the
    engine stops on), built by the first grammar compile (slow for a large vocabulary, so off
    the loop: worker/engine/grammar_compile.py) and kept for the worker's life. Its vocabulary
    is at least the model's, so every logit has a bit in the mask."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds it
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll: LLTokenizer | None = None

    def get(self) -> LLTokenizer:
        if self._ll is None:
            n_vocab = max(self.vocab_size, len(self._hf))
            self._ll = from_tokenizer(self._hf, n_vocab=n_vocab, eos_token=self.eos_token_ids)
        return self._ll

    def compile(self, grammar: str) -> LLMatcher:
        """A matcher of `grammar` in its start state; GrammarError when it does not compile.
        llguidance drops the GIL while it builds one, so this may run in another thread."""
        try:  # first: past these limits llguidance's native code can crash the process
            check_grammar(grammar, GRAMMAR_SOURCE)
        except SchemaLimitError as exc:
            raise GrammarError(str(exc)) from exc
        matcher = LLMatcher(
            self.get(), grammar, log_level=0, limits=LLParserLimits(**GRAMMAR_LIMITS)
        )
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {_clip(matcher.get_error())}")
        return matcher


class GrammarConstraint:
    """One sequence's grammar, as a logits processor `(tokens, logits) -> logits`."""

    def __init__(
        self, matcher: LLMatcher, tokenizer: LLTokenizer, prompt_len: int, vocab_size: int
    ) -> None:
        self.matcher = matcher  # this sequence's own (a copy of its grammar's compiled one)
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size
        self.consumed = 0  # generated tokens the matcher has taken
        self.error = ""  # set once the matcher rejects a token or allows none
        self._bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
        self._eos_only = np.zeros(vocab_size, dtype=bool)
        self._eos_only[[t for t in tokenizer.eos_tokens if t < vocab_size]] = True

    def advance(self, tokens: list[int]) -> None:
        """Feed generated tokens to the matcher; a rejected one sets `error`."""
        for token in tokens:
            if self.error:
                return
            if not self.matcher.consume_token(token):
                self.error = f"token {token} is not allowed by the grammar: " + _clip(
                    self.matcher.get_error()
                )
                return
            self.consumed += 1

    def allowed(self) -> np.ndarray:
        """A bool per token of the model's vocabulary: may it come next?"""
        if self.error:
            return self._eos_only
        fill_next_token_bitmask(self.matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = bits[: self.vocab_size].astype(bool)
        if not allowed.any():
            self.error = "the grammar allows no next token"
            return self._eos_only
        return allowed

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            new = int(tokens.shape[0]) - self.prompt_len - self.consumed
            if new > 0 and not self.error:
                self.advance(tokens[-new:].tolist())
            allowed = self.allowed()
        except Exception as exc:  # never raise inside the batched step: this sequence fails
            self.error = f"{type(exc).__name__}: {exc}"
            allowed = self._eos_only
        floor = mx.array(-mx.inf, dtype=logits.dtype)
        return mx.where(mx.array(allowed[: logits.shape[-1]]), logits, floor)


def _clip(message: str) -> str:
    message = message.strip().splitlines()[0] if message.strip() else "no detail"
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."
