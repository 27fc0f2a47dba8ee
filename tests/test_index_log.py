"""The prompt cache's block index log: what the next publish writes to the worker's block set,
and which of those members are a prompt's first block (listed in the pool's holders sets)."""

from __future__ import annotations

from worker.prompt_cache.index_log import BlockIndexLog

A, B, C = b"a" * 8, b"b" * 8, b"c" * 8


def test_first_blocks_are_told_apart_in_each_take_and_in_what_is_held() -> None:
    log = BlockIndexLog()
    log.add(A, first=True)
    log.add(B)
    assert log.take() == ({A: True, B: True}, {A})
    assert log.held_firsts() == {A}
    log.add(A, first=True)  # a second entry behind it: no change until the last one leaves
    log.remove(A)
    assert log.take() == ({}, set())
    log.remove(A)
    log.remove(B)
    assert log.take() == ({A: False, B: False}, {A})  # its removal is a first block's, too
    assert log.held_firsts() == set() and log.held() == []


def test_a_first_block_gone_and_back_between_two_takes_is_listed_once_more() -> None:
    log = BlockIndexLog()
    log.add(C, first=True)
    log.take()
    log.remove(C)
    log.add(C, first=True)
    assert log.take() == ({C: True}, {C})
    assert log.held_firsts() == {C}
