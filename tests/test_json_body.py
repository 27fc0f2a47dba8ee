"""The router's JSON body reader: which bodies go to the standard library's parser."""

from __future__ import annotations

import re

from hypothesis import example, given
from hypothesis import strategies as st

from router.edge.json_body import LONG_DIGITS, has_long_number

# What the check stands for: a run of LONG_DIGITS ASCII digits anywhere in the body.
LONG_RUN = re.compile(rb"[0-9]{%d}" % LONG_DIGITS)


@example(b"1" * LONG_DIGITS)
@example(b"[" + b"1" * (LONG_DIGITS - 1) + b", 1]")
@example(b"x" + b"9" * (LONG_DIGITS + 3) + b"x")
@given(st.binary(max_size=80) | st.lists(st.sampled_from(b"0123456789 ,\xb2\xb9-")).map(bytes))
def test_a_long_number_is_a_run_of_that_many_ascii_digits(body: bytes) -> None:
    assert has_long_number(body) == (LONG_RUN.search(body) is not None)


def test_every_number_past_int64_is_found() -> None:
    """orjson reads an integer past 2**64 - 1 (20 digits) as a float; the check sends every
    19-digit run on, the shortest that can pass 2**63 - 1 (a seed's bound)."""
    assert has_long_number(b'{"seed": %d}' % 2**64)  # 20 digits
    assert has_long_number(b'{"seed": %d}' % 2**63)  # 19 digits
    assert not has_long_number(b'{"seed": %d, "prompt": [1, 2]}' % (2**59))  # 18 digits
    assert not has_long_number("²³¹⁴⁵⁶⁷⁸⁹⁰¹²³⁴⁵⁶⁷⁸⁹⁰".encode())  # digits, but not ASCII
