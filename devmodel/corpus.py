"""Deterministic English-ish training text for the offline tokenizer.

No hub and no machine-dependent files: the text is generated from embedded word lists with
a self-contained PRNG (splitmix64), so every machine and Python version produces the same
bytes, hence the same BPE merges and the same token ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

_MASK = (1 << 64) - 1


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_FUNCTION = _words(
    "the a an this that these those some every each no any my your our their his her its "
    "and but or so because while when if then than as of in on at by for with from to into "
    "over under between after before about through during without within across"
)
_NOUNS = _words(
    "time year people way day man woman child world life hand part place case week company "
    "system program question work government number night point home water room mother area "
    "money story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office "
    "door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education river mountain garden window table kitchen letter "
    "street market train bridge island forest cloud storm engine server request token model "
    "worker queue cache memory signal network picture music song voice paper road village"
)
_VERBS = _words(
    "find give tell ask work seem feel try leave call keep hold bring begin show hear play run "
    "move live believe write provide sit stand lose pay meet include continue set learn lead "
    "understand watch follow stop create speak read allow add spend grow open walk win offer "
    "remember love consider appear buy wait serve build stay fall cut reach kill remain carry "
    "send measure decide explain report describe cover answer paint visit compute store"
)
_ADJECTIVES = _words(
    "good new first last long great little own other old right big high different small large "
    "next early young important few public bad same able late hard major better economic "
    "strong possible whole free military true federal political real best sure clear full "
    "special easy certain recent quiet bright dark warm cold green blue red golden heavy "
    "simple quick slow gentle careful ancient modern empty busy distant"
)
_ADVERBS = _words("quickly slowly quietly often never always carefully suddenly finally rarely")
_SYLLABLES = _words(
    "ka lo mi ra ne tu sa vi do re el an or is um bar tin gol mar fen dor lia ven qua zor "
    "pel rin ash ber cal dun eth fal gar hol ith jor kel lum nor oth pra sel tor ul vor wyn"
)
_PUNCT = (".", ".", ".", "!", "?", ";")


class _Rng:
    """splitmix64: tiny, fast and identical everywhere (unlike library PRNGs across versions)."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, items: tuple[str, ...] | list[str]) -> str:
        return items[self.below(len(items))]


def _name(rng: _Rng) -> str:
    """Pseudo proper noun: gives BPE many distinct words so large vocabularies fill up."""
    parts = [rng.pick(_SYLLABLES) for _ in range(2 + rng.below(2))]
    return "".join(parts).capitalize()


def _sentence(rng: _Rng, names: list[str]) -> str:
    noun = rng.pick(_NOUNS)
    plural = noun + "s" if rng.below(3) == 0 else noun
    verb = rng.pick(_VERBS)
    verb = verb + "s" if plural == noun else verb  # singular subject
    words = [rng.pick(_FUNCTION[:12]), rng.pick(_ADJECTIVES), plural]
    if rng.below(4) == 0:
        words.append(rng.pick(_ADVERBS))
    words += [verb, rng.pick(_FUNCTION[:12]), rng.pick(_NOUNS)]
    if rng.below(2) == 0:
        words += [rng.pick(_FUNCTION[18:]), rng.pick(names)]
    if rng.below(5) == 0:
        words += ["in", str(1800 + rng.below(230))]
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.pick(_PUNCT)


def _paragraph(rng: _Rng, names: list[str]) -> str:
    return " ".join(_sentence(rng, names) for _ in range(3 + rng.below(5)))


def _dialogue(rng: _Rng, names: list[str]) -> str:
    who = rng.pick(names)
    q = f"Where did {who} {rng.pick(_VERBS)} the {rng.pick(_ADJECTIVES)} {rng.pick(_NOUNS)}?"
    return f"User: {q}\nAssistant: {_sentence(rng, names)} {_sentence(rng, names)}"


def _arithmetic(rng: _Rng) -> str:
    a, b = rng.below(1000), rng.below(1000)
    return f"{a} + {b} = {a + b}, and {a} * {b % 50} = {a * (b % 50)}."


def _code(rng: _Rng) -> str:
    fn, arg = rng.pick(_VERBS), rng.pick(_NOUNS)
    return (
        f"def {fn}_{arg}({arg}, count={rng.below(10)}):\n"
        f'    """{rng.pick(_ADJECTIVES).capitalize()} helper."""\n'
        f"    return [{arg} for _ in range(count)]\n"
    )


def _roster(rng: _Rng) -> str:
    """Fresh names each time: enough distinct words for an 8k vocabulary to fill up."""
    names = ", ".join(_name(rng) for _ in range(16 + rng.below(24)))
    return f"The {rng.pick(_NOUNS)} list of {1 + rng.below(99)} names: {names}."


def _chunks(seed: int) -> Iterator[str]:
    rng = _Rng(seed)
    names = [_name(rng) for _ in range(4000)]
    while True:
        kind = rng.below(10)
        if kind < 6:
            yield _paragraph(rng, names)
        elif kind < 8:
            yield _dialogue(rng, names)
        elif kind == 8:
            yield _roster(rng)
        else:
            yield _arithmetic(rng) if rng.below(2) else _code(rng)


@lru_cache(maxsize=4)
def generate_corpus(size_bytes: int = 400_000, seed: int = 1234) -> str:
    """Return about ``size_bytes`` of deterministic text (paragraphs separated by blank lines)."""
    out: list[str] = []
    total = 0
    for chunk in _chunks(seed):
        out.append(chunk)
        total += len(chunk) + 2
        if total >= size_bytes:
            break
    return "\n\n".join(out)


def iter_lines(size_bytes: int = 400_000, seed: int = 1234) -> Iterator[str]:
    """Corpus split into non-empty lines, the unit the tokenizer trainer consumes."""
    for line in generate_corpus(size_bytes, seed).splitlines():
        if line.strip():
            yield line
