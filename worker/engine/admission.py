"""What the engine checks before a request runs: token ids within the model's vocabulary and
prompt plus budget within its context. A request that fails a check fails alone, as the
caller's error (an `invalid_request_error`), before anything is computed for it.
"""

from __future__ import annotations

from shared.wire import GenerationRequest


class AdmissionError(ValueError):
    """A request this model cannot run (token ids or length out of range)."""


def check_admissible(spec: GenerationRequest, vocab_size: int, context_length: int) -> None:
    """Raise AdmissionError naming what is out of range; return when the request can run."""
    n = len(spec.prompt_tokens)
    if max(spec.prompt_tokens) >= vocab_size:
        raise AdmissionError(f"prompt token id out of range for vocab size {vocab_size}")
    if spec.logit_bias and max(spec.logit_bias) >= vocab_size:
        raise AdmissionError(f"logit_bias token id out of range for vocab size {vocab_size}")
    if spec.stop_token_ids and max(spec.stop_token_ids) >= vocab_size:
        raise AdmissionError(f"stop_token_ids token id out of range for vocab size {vocab_size}")
    if n + spec.max_tokens > context_length:
        raise AdmissionError(
            f"prompt ({n} tokens) + max_tokens ({spec.max_tokens}) exceeds the model's "
            f"context length {context_length}"
        )
