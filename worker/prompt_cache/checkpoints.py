"""Where a snapshot-mode prompt keeps checkpoints while it is prefilled.

A model whose cache cannot be cut back (rotating KV, recurrent or SSM state) can resume a prompt
only where a copy of its state was taken. The prefill stops at these positions (mlx-lm's
BatchGenerator segments), the state there is copied into the snapshot shelf, and a later prompt
sharing the prefix resumes from the deepest one inside what it shares (SGLang's Mamba radix
cache, llama.cpp's context checkpoints). Positions are absolute and on block boundaries, so two
prompts sharing a prefix keep their checkpoints at the same places and the routing index can
name each by the hash of the block it ends.
"""

from __future__ import annotations


def checkpoint_positions(
    start: int, prompt_len: int, *, every: int, block: int, min_tokens: int
) -> list[int]:
    """The checkpoints of a prompt of `prompt_len` tokens prefilled from `start`: each multiple
    of `every`, and the last block boundary before the prompt's last token (the point an
    identical prompt resumes at, with its last token left to compute), past `start` and at
    least `min_tokens` deep.

    >>> checkpoint_positions(0, 1024, every=256, block=16, min_tokens=32)
    [256, 512, 768, 1008]
    >>> checkpoint_positions(768, 1000, every=256, block=16, min_tokens=32)
    [992]
    """
    if every <= 0 or prompt_len < 2:
        return []
    last = (prompt_len - 1) // block * block
    first = max(start + 1, min_tokens)
    marks = [p for p in range(every, last, every) if p >= first]
    if last >= first:
        marks.append(last)
    return marks


def split_at(tokens: list[int], start: int, marks: list[int]) -> list[list[int]]:
    """`tokens` (the prompt from absolute position `start` on) cut at the absolute `marks`."""
    cuts = [m - start for m in marks]
    edges = [0, *cuts, len(tokens)]
    return [tokens[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]
