"""Prompt-cache bookkeeping: trie, APC clamp, limits, LRU/TTL, declines, paged blocks, reset.

Real mlx arrays in real mlx-lm cache objects; a tiny random Llama where the KV content matters.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from shared.config import PromptCacheConfig
from shared.reject import RejectReason
from worker.prompt_cache.apc import BlockHasher, clamp_to_blocks
from worker.prompt_cache.block_pool import BlockPool
from worker.prompt_cache.counters import CacheCounters
from worker.prompt_cache.entries import DenseEntry, PagedEntry
from worker.prompt_cache.keys import CacheNamespace
from worker.prompt_cache.store import Disabled, OversizedEntry, PrefixTooShort, PromptStore
from worker.prompt_cache.trie import TokenTrie

NS = CacheNamespace("m", "", "tpl")
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # K+V, float32


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def kv(n: int, seed: int = 0) -> list[KVCache]:
    """Per-layer KVCache objects filled the way a model fills them (update_and_fetch)."""
    mx.random.seed(seed)
    caches = []
    for _ in range(LAYERS):
        c = KVCache()
        c.update_and_fetch(
            mx.random.normal((1, KV_HEADS, n, HEAD_DIM)),
            mx.random.normal((1, KV_HEADS, n, HEAD_DIM)),
        )
        caches.append(c)
    return caches


def dense(tokens: list[int], seed: int = 0) -> DenseEntry:
    return DenseEntry.detach(tokens, kv(len(tokens), seed))


def make_store(mode: str = "dense", **cfg: object) -> tuple[PromptStore, list, Clock]:
    rejects: list = []
    clock = Clock()
    config = PromptCacheConfig(min_prefix_tokens=cfg.pop("min_prefix_tokens", 4), **cfg)
    store = PromptStore(
        config,
        mode=mode,
        counters=CacheCounters(),
        clock=clock,
        record_reject=lambda r, s, n: rejects.append((r, s, n)),
    )
    return store, rejects, clock


def paged_entry(store: PromptStore, tokens: list[int], seed: int = 0) -> PagedEntry:
    pool = store.pool
    assert pool is not None
    ids = pool.store(NS.seed(), tokens, kv(len(tokens), seed))
    return PagedEntry(
        tuple(tokens[: len(ids) * pool.block_size]),
        ids,
        pool.block_size,
        pool.block_nbytes,
        pool.clone,
        pool.free,
    )


# -- trie / apc ---------------------------------------------------------------------------------
def test_trie_longest_prefix_among_many_entries() -> None:
    rng = random.Random(1)
    trie = TokenTrie()
    base = tuple(rng.randrange(256) for _ in range(1000))
    for i in range(2000):
        cut = rng.randrange(1, 1000)
        trie.insert(base[:cut] + tuple(rng.randrange(256, 512) for _ in range(5)), i)
    trie.insert(base[:900], 99999)
    found = trie.longest_match(base[:950] + (7, 7))
    assert found.length >= 900
    prompt = base[:600] + (1000,)
    assert trie.longest_match(prompt).length == 600
    trie.remove(base[:900], 99999)
    assert 99999 not in trie.longest_match(base[:950]).entry_ids
    assert len(trie) == 2000


def test_trie_whole_prefix_only() -> None:
    trie = TokenTrie()
    trie.insert((1, 2, 3), 1)
    trie.insert((1, 2, 3, 4, 5), 2)
    assert trie.longest_whole_prefix((1, 2, 3, 4, 5, 6), 5).entry_ids == (2,)
    assert trie.longest_whole_prefix((1, 2, 3, 4, 5), 4).entry_ids == (1,)
    assert trie.longest_whole_prefix((1, 2, 9), 2).entry_ids == ()


def test_apc_chain_and_clamp() -> None:
    h = BlockHasher(16, "sha256")
    a = list(range(64))
    b = list(range(40)) + [999] * 24
    ha, hb = h.chain(a), h.chain(b)
    assert len(ha) == 4 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert clamp_to_blocks(40, ha, hb, 16) == 32
    assert BlockHasher(16, "sha1").chain(a)[0] != ha[0]
    assert len(BlockHasher(16, "blake2b").chain(a)) == 4


# -- matching -----------------------------------------------------------------------------------
def test_lookup_longest_prefix_and_apc_clamp() -> None:
    store, rejects, _ = make_store(min_prefix_tokens=16)
    base = list(range(100))
    store.insert(NS, "", dense(base[:40]))
    store.insert(NS, "", dense(base[:70]))
    m = store.lookup(NS, "", base[:75] + [300])
    assert m is not None and m.entry_len == 70 and m.matched == 64  # clamped to 16-blocks
    # A match that clamps below the minimum is a miss, and not a reject.
    assert store.lookup(NS, "", base[:15] + [300]) is None
    assert rejects == []


def test_namespaces_isolate() -> None:
    store, _, _ = make_store()
    store.insert(NS, "", dense(list(range(64))))
    other = CacheNamespace("m", "", "other-template")
    assert store.lookup(other, "", list(range(64))) is None
    assert store.lookup(CacheNamespace("m", "lora", "tpl"), "", list(range(64))) is None
    assert store.lookup(NS, "", list(range(64))) is not None


def test_session_tie_break_and_longer_cross_session() -> None:
    store, _, clock = make_store(apc_enabled=False)
    toks = list(range(50))
    store.insert(NS, "alice", dense(toks[:40]))
    clock.t += 1
    store.insert(NS, "bob", dense(toks[:40], seed=1))
    m = store.lookup(NS, "alice", toks)
    assert m is not None and store.main.slots()[0].entry is m.entry  # same session wins a tie
    m = store.lookup(NS, "carol", toks)
    assert m is not None and store.main.slots()[1].entry is m.entry  # else the most recent
    clock.t += 1
    store.insert(NS, "bob", dense(toks[:45], seed=2))
    m = store.lookup(NS, "alice", toks)
    assert m is not None and m.entry_len == 45  # a longer cross-session match wins


# -- limits -------------------------------------------------------------------------------------
def test_byte_budget_never_exceeded_over_1000_prompts() -> None:
    capacity = 40 * 64 * TOKEN_BYTES
    store, _, _ = make_store(capacity_bytes=capacity, max_entries=10_000)
    rng = random.Random(0)
    template = kv(80)
    for i in range(1000):
        n = rng.randrange(16, 80)
        toks = [i % 256, i // 256] + [rng.randrange(256) for _ in range(n - 2)]
        store.insert(NS, "", DenseEntry.detach(toks, template))
        assert store.bytes <= capacity
    assert store.counters.evictions_lru > 0
    assert store.counters.inserts == 1000


def test_lru_evicts_least_recent_and_hit_refreshes() -> None:
    store, _, clock = make_store(max_entries=3, apc_enabled=False)
    prompts = [[k] * 20 for k in range(4)]
    for p in prompts[:3]:
        store.insert(NS, "", dense(p))
        clock.t += 1
    hit = store.lookup(NS, "", prompts[0] + [9])
    assert hit is not None
    store.touch(hit)
    store.insert(NS, "", dense(prompts[3]))
    assert store.lookup(NS, "", prompts[0] + [9]) is not None  # refreshed: kept
    assert store.lookup(NS, "", prompts[1] + [9]) is None  # least recently used: gone
    assert store.counters.evictions_lru == 1


def test_ttl_with_injected_clock() -> None:
    store, _, clock = make_store(ttl_s=10)
    store.insert(NS, "", dense(list(range(32))))
    clock.t += 5
    assert store.lookup(NS, "", list(range(40))) is not None
    clock.t += 11
    assert store.lookup(NS, "", list(range(40))) is None
    assert store.counters.evictions_ttl == 1 and len(store.main) == 0


def test_insert_declines_in_order_and_free_what_they_held() -> None:
    store, rejects, _ = make_store(enabled=False)
    assert store.insert(NS, "", dense([1] * 2)) == Disabled()  # disabled beats too-short
    store, rejects, _ = make_store(min_prefix_tokens=8, capacity_bytes=10 * TOKEN_BYTES)
    assert store.insert(NS, "", dense([1] * 5)) == PrefixTooShort(got=5, min_required=8)
    big = dense([1] * 20)
    assert store.insert(NS, "", big, seq_id="s1", context_len=21) == OversizedEntry(
        20 * TOKEN_BYTES, 10 * TOKEN_BYTES
    )
    assert big.layers == []  # released
    assert [r[0] for r in rejects] == [RejectReason.PREFIX_TOO_SHORT, RejectReason.OVERSIZED]
    assert rejects[1] == (RejectReason.OVERSIZED, "s1", 21)
    assert store.counters.rejections_oversized == 1
    # The paged kind: a declined entry's blocks go back to the pool.
    store, _, _ = make_store("paged", min_prefix_tokens=64)
    entry = paged_entry(store, list(range(40)))
    assert store.pool is not None and store.pool.counts().live == 1
    assert isinstance(store.insert(NS, "", entry), PrefixTooShort)
    assert store.pool.counts().live == 0 and store.pool.bytes_in_use == 0


# -- paged --------------------------------------------------------------------------------------
def test_paged_blocks_shared_between_entries_with_common_prefix() -> None:
    store, _, _ = make_store("paged")
    pool = store.pool
    assert pool is not None
    turn1 = list(range(70))
    turn2 = turn1 + list(range(100, 160))
    store.insert(NS, "", paged_entry(store, turn1))
    e2 = paged_entry(store, turn2, seed=3)  # same prefix tokens: shares the first 2 blocks
    store.insert(NS, "", e2)
    assert pool.counts().live == 4 < 2 + 4
    assert pool.bytes_in_use == 4 * pool.block_nbytes
    clone = pool.clone(e2.block_ids[:2])
    assert clone[0].offset == 64
    lease = pool.pin(e2.block_ids[:2])
    assert pool._blocks[e2.block_ids[0]].ref_cnt == 3
    lease.release()
    assert pool._blocks[e2.block_ids[0]].ref_cnt == 2


def test_paged_budget_evicts_cold_entries() -> None:
    store, _, _ = make_store("paged", paged_block_budget=4, apc_enabled=False)
    pool = store.pool
    assert pool is not None
    for k in range(5):
        store.insert(NS, "", paged_entry(store, [k] * 64, seed=k))
        assert pool.counts().live <= 4
    assert store.counters.evictions_lru == 3 and len(store.main) == 2


def test_reset_frees_everything_including_paged_blocks() -> None:
    store, _, _ = make_store("paged")
    pool = store.pool
    assert pool is not None
    e = paged_entry(store, list(range(96)))
    store.insert(NS, "", e)
    lease = pool.pin(e.block_ids)
    cleared, freed_bytes, freed_entries = store.reset()
    assert (cleared, freed_bytes, freed_entries) == (True, 3 * pool.block_nbytes, 1)
    assert pool.counts().live == 0 and pool.bytes_in_use == 0 and len(store.main) == 0
    # A lease from before the reset holds nothing now: releasing it frees no reused block.
    again = paged_entry(store, list(range(500, 596)), seed=9)
    store.insert(NS, "", again)
    lease.release()
    assert pool.counts().live == 3 and all(pool._blocks[b].ref_cnt == 1 for b in again.block_ids)
    assert make_store(enabled=False)[0].reset() == (False, 0, 0)


@pytest.mark.parametrize("algo", ["sha256", "sha1", "blake2b"])
def test_pool_dedupe_respects_namespace(algo: str) -> None:
    pool = BlockPool(block_size=32, hash_algo=algo, capacity_bytes=1 << 30)
    a = pool.store(b"ns-a", list(range(64)), kv(64))
    b = pool.store(b"ns-b", list(range(64)), kv(64))
    assert set(a).isdisjoint(b)
