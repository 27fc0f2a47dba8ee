"""The PromptCache facade with a tiny random Llama: adopt/donate, rejects at their sites, trace,
counters, gauges and the load-time cacheability check."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from shared.cache_stats import GAUGE_FIELDS, SETTING_FIELDS
from shared.config import PromptCacheConfig
from shared.reject import REJECT_REASONS, RejectReason
from worker.prompt_cache import CacheNamespace, PromptCache, check_model, resolve_storage_mode
from worker.prompt_cache.entries import DenseEntry

NS = CacheNamespace("tiny", "", "tpl")


def _build(**extra: object) -> llama.Model:
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
        **extra,
    )
    m = llama.Model(args)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def model() -> llama.Model:
    return _build()


@pytest.fixture(scope="module")
def swa_model() -> llama.Model:
    """A sliding-window layer: make_prompt_cache gives a RotatingKVCache beside a KVCache."""
    return _build(layer_types=["sliding_attention", "full_attention"], sliding_window=64)


def prefill(model: llama.Model, tokens: list[int]) -> tuple[list, mx.array]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(logits, [c.state[:2] for c in cache])
    return cache, logits


def make_cache(mode: str = "dense", worker: str = "w1", **cfg: object) -> PromptCache:
    cfg.setdefault("min_prefix_tokens", 32)
    return PromptCache(
        PromptCacheConfig(**cfg),
        model_id="tiny",
        storage_mode=mode,
        worker_id=worker,
        clock=lambda: 1700000000.0,
    )


def toks(n: int, start: int = 0) -> list[int]:
    return [(start + i * 7) % 256 for i in range(n)]


def rejects(pc: PromptCache) -> dict[str, int]:
    snap = pc.counters.snapshot()
    return {r.value: snap[r.stats_field] for r in REJECT_REASONS if snap[r.stats_field]}


# -- adopt --------------------------------------------------------------------------------------
def test_dense_adopt_leaves_store_and_matches_cold_prefill(model: llama.Model) -> None:
    pc = make_cache()
    seq = toks(80)
    cache, _ = prefill(model, seq)
    original = [mx.array(c.keys[..., :80, :]) for c in cache]
    pc.donate_finished_sequence_cache(NS, "", "s1", seq, cache)
    prompt = seq[:50] + [3, 4, 5]
    got = pc.try_adopt_cached_prefix(NS, "", prompt, "s2")
    assert got is not None and got.cached_tokens == 48 and not got.snapshot  # APC: 16-blocks
    assert len(pc.store.main) == 0  # dense: the entry left the store
    for c, o in zip(got.caches, original, strict=True):
        assert c.offset == 48 and mx.allclose(c.keys[..., :48, :], o[..., :48, :])
    # Continue from the adopted cache vs a cold prefill of the same prefix: same next logits.
    _, cold = prefill(model, prompt)
    warm = model(mx.array([prompt[48:]]), cache=got.caches)
    assert mx.allclose(cold[:, -1], warm[:, -1], atol=1e-4)
    c = pc.counters.take()
    assert (c["lookups"], c["hits"], c["misses"], c["prefix_tokens_reused"]) == (1, 1, 0, 48)
    assert c["inserts"] == 1 and pc.counters.take()["hits"] == 0  # take() drains


def test_whole_prompt_hit_leaves_one_token(model: llama.Model) -> None:
    for mode in ("dense", "paged"):
        pc = make_cache(mode, apc_enabled=False)
        seq = toks(96)
        pc.donate_finished_sequence_cache(NS, "", "s1", seq, prefill(model, seq)[0])
        got = pc.try_adopt_cached_prefix(NS, "", seq[:40], "s2")
        assert got is not None
        expected = 39 if mode == "dense" else 32  # paged floors 39 to a whole block
        assert got.cached_tokens == expected <= len(seq[:40]) - 1


def test_paged_adopt_keeps_entry_pins_and_matches_cold(model: llama.Model) -> None:
    pc = make_cache("paged")
    pool = pc.store.pool
    assert pool is not None
    turn1 = toks(70)
    pc.donate_finished_sequence_cache(NS, "", "s1", turn1, prefill(model, turn1)[0])
    turn2 = turn1 + toks(60, start=5)
    pc.donate_finished_sequence_cache(NS, "", "s2", turn2, prefill(model, turn2)[0])
    assert len(pc.store.main) == 2 and pool.counts().live == 4  # 2 + 4 blocks, 2 shared
    prompt = turn2 + [1, 2]
    got = pc.try_adopt_cached_prefix(NS, "", prompt, "s3")
    assert got is not None and got.cached_tokens == 128 and len(pc.store.main) == 2
    live = pool.counts().live
    assert got.lease is not None
    first = pool._blocks[got.lease.block_ids[0]]
    assert first.ref_cnt == 3  # two entries + the pin
    got.lease.release()
    assert first.ref_cnt == 2 and pool.counts().live == live
    got.lease.release()  # a second release gives nothing back twice
    assert first.ref_cnt == 2
    _, cold = prefill(model, prompt)
    warm = model(mx.array([prompt[128:]]), cache=got.caches)
    assert mx.allclose(cold[:, -1], warm[:, -1], atol=1e-4)
    g = pc.gauges()
    assert g["paged_blocks_live"] == 4 and g["entries"] == 2 and g["paged_block_size"] == 32


def test_snapshot_mode_restores_whole_prefix_only(swa_model: llama.Model) -> None:
    model = swa_model
    pc = make_cache("snapshot")
    seq = toks(40)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([seq]), cache=cache))
    pc.donate_finished_sequence_cache(NS, "", "s1", seq, cache)
    assert pc.try_adopt_cached_prefix(NS, "", seq, "s2") is None  # not shorter than the prompt
    assert pc.try_adopt_cached_prefix(NS, "", seq[:30] + [1] * 20, "s3") is None
    prompt = seq + [9, 8]
    got = pc.try_adopt_cached_prefix(NS, "", prompt, "s4")
    assert got is not None and got.snapshot and got.cached_tokens == 40
    assert isinstance(got.caches[0], RotatingKVCache)
    assert len(pc.store.snapshots) == 1  # the snapshot stays
    cold = make_prompt_cache(model)
    mx.eval(model(mx.array([seq]), cache=cold))
    a = model(mx.array([prompt[40:]]), cache=got.caches)
    b = model(mx.array([prompt[40:]]), cache=cold)
    assert mx.allclose(a[:, -1], b[:, -1], atol=1e-4)
    c = pc.counters.take()
    assert (c["snapshot_lookups"], c["snapshot_hits"], c["snapshot_misses"]) == (3, 1, 2)
    assert c["snapshot_inserts"] == 1 and c["snapshot_tokens_reused"] == 40


# -- rejects at their sites ---------------------------------------------------------------------
def trace_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mlxcel.prompt_cache"]


def test_donate_side_rejects(model: llama.Model, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mlxcel.prompt_cache")
    seq = toks(40)
    pc = make_cache(enabled=False, trace=True)
    pc.donate_finished_sequence_cache(NS, "", "s1", seq, prefill(model, seq)[0])
    assert pc.try_adopt_cached_prefix(NS, "", seq, "s2") is None  # no store: records nothing
    assert rejects(pc) == {"disabled": 1} and pc.counters.lookups == 0
    assert trace_lines(caplog) == [
        "prompt-cache reject apc_event=reject reason=disabled seq_id=s1 context_len=40 worker=w1"
    ]
    pc = make_cache("paged", trace=True)
    pc.donate_finished_sequence_cache(NS, "", "s3", seq[:20], prefill(model, seq[:20])[0])
    assert pc.store.pool is not None and pc.store.pool.counts().allocated == 0  # nothing detached
    pc.donate_finished_sequence_cache(NS, "", "s4", seq, [])
    pc.donate_finished_sequence_cache(NS, "", "s5", seq, None)
    assert rejects(pc) == {"prefix_too_short": 1, "empty_set": 2}
    assert pc.counters.last_reject == {
        "reason": "empty_set",
        "seq_id": "s5",
        "context_len": 40,
        "at_unix_ms": 1700000000000,
    }
    pc = make_cache(capacity_bytes=1000, trace=True)
    pc.donate_finished_sequence_cache(NS, "", "s6", seq, prefill(model, seq)[0])
    c = pc.counters.take()
    assert c["reject_oversized"] == 1 and c["rejections_oversized"] == 1 and c["inserts"] == 0
    assert trace_lines(caplog)[-1].endswith("reason=oversized seq_id=s6 context_len=40 worker=w1")


def test_adopt_side_rejects(model: llama.Model, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mlxcel.prompt_cache")
    seq = toks(64)
    # mode_mismatch: a dense entry offered to the paged backend.
    pc = make_cache("paged", trace=True)
    pc.store.insert_entry(NS, "", DenseEntry.detach(seq, prefill(model, seq)[0]))
    assert pc.try_adopt_cached_prefix(NS, "", seq + [1], "a1") is None
    assert trace_lines(caplog)[-1] == (
        "prompt-cache reject apc_event=reject reason=mode_mismatch seq_id=None context_len=64 "
        "worker=w1"
    )
    # block_boundary_floor: 40 matched tokens floor to 32 < min 40.
    pc = make_cache("paged", min_prefix_tokens=40, apc_enabled=False, trace=True)
    long_seq = toks(100)
    pc.donate_finished_sequence_cache(NS, "", "d", long_seq, prefill(model, long_seq)[0])
    assert pc.try_adopt_cached_prefix(NS, "", long_seq[:45] + [0], "a2") is None
    assert rejects(pc) == {"block_boundary_floor": 1}
    assert pc.counters.last_reject is not None
    assert pc.counters.last_reject["context_len"] == 45
    # empty_set on adopt: the entry taken holds no KV.
    pc = make_cache()
    pc.store.insert_entry(NS, "", DenseEntry(tuple(seq), []))
    assert pc.try_adopt_cached_prefix(NS, "", seq + [1], "a3") is None
    assert rejects(pc) == {"empty_set": 1}
    # layout_constraints: a corrupted dense entry cannot be cut back.
    pc = make_cache(trace=True)
    bad = DenseEntry.detach(seq, prefill(model, seq)[0])
    bad.layers[0].keys = bad.layers[0].keys[..., :10, :]  # fewer tokens than it claims
    pc.store.insert_entry(NS, "", bad)
    assert pc.try_adopt_cached_prefix(NS, "", seq + [1], "a4") is None
    assert rejects(pc) == {"layout_constraints": 1}
    assert "reason=layout_constraints seq_id=None context_len=64" in trace_lines(caplog)[-1]
    c = pc.counters.take()
    assert (c["lookups"], c["misses"], c["hits"]) == (1, 1, 0)


def test_snapshot_restore_failure_carries_seq_id(swa_model: llama.Model) -> None:
    model = swa_model
    pc = make_cache("snapshot")
    seq = toks(40)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([seq]), cache=cache))
    pc.donate_finished_sequence_cache(NS, "", "s1", seq, cache)
    pc.store.snapshots.slots()[0].entry.states[0] = ("corrupt",)  # type: ignore[attr-defined]
    assert pc.try_adopt_cached_prefix(NS, "", seq + [1], "s9") is None
    assert pc.counters.last_reject is not None
    assert pc.counters.last_reject["reason"] == "layout_constraints"
    assert pc.counters.last_reject["seq_id"] == "s9"


def test_miss_is_not_a_reject_and_store_trace(
    model: llama.Model, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlxcel.prompt_cache")
    pc = make_cache(trace=True, worker="w7")
    seq = toks(48)
    pc.donate_finished_sequence_cache(NS, "", "seq-7", seq, prefill(model, seq)[0])
    assert pc.try_adopt_cached_prefix(NS, "", toks(48, start=1), "x") is None
    assert pc.try_adopt_cached_prefix(NS, "", seq[:20] + [0] * 30, "y") is None  # below min
    got = pc.try_adopt_cached_prefix(CacheNamespace("tiny", "", "other"), "", seq + [1], "z")
    assert got is None and rejects(pc) == {}
    got = pc.try_adopt_cached_prefix(NS, "", seq + [1], "seq-9")
    assert got is not None
    assert trace_lines(caplog) == [
        "prompt-cache store apc_event=store seq_id=seq-7 matched_len=48 worker=w7",
        "prompt-cache adopt apc_event=adopt seq_id=seq-9 matched_len=48 total_tokens=49 worker=w7",
    ]


def test_no_trace_lines_when_trace_off(
    model: llama.Model, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mlxcel.prompt_cache")
    pc = make_cache(enabled=False)
    pc.donate_finished_sequence_cache(NS, "", "s1", toks(40), None)
    assert pc.counters.reject_disabled == 1 and trace_lines(caplog) == []


# -- reset, gauges, cacheability ----------------------------------------------------------------
def test_reset_and_gauges(model: llama.Model) -> None:
    pc = make_cache("paged")
    seq = toks(96)
    pc.donate_finished_sequence_cache(NS, "", "s1", seq, prefill(model, seq)[0])
    g = pc.gauges()
    engine_owned = {"batch_current_size", "batch_kv_bytes"}
    assert set(g) == (set(GAUGE_FIELDS) - engine_owned) | set(SETTING_FIELDS)
    assert g["enabled"] == "1" and g["storage_mode"] == "paged" and g["cacheability"] == "trimmable"
    assert g["total_blocks_stored"] == 6 and g["apc_active_entries"] == 1
    r = pc.reset()
    assert r.cleared and r.freed_entries == 1 and r.freed_bytes == g["bytes"] > 0
    g = pc.gauges()
    assert g["entries"] == 0 and g["paged_blocks_live"] == 0 and g["bytes"] == 0
    off = make_cache(enabled=False)
    assert off.reset().cleared is False and off.gauges()["enabled"] == "0"
    assert off.gauges()["capacity_bytes"] == 2 * 1024**3


def test_cacheability(model: llama.Model, swa_model: llama.Model) -> None:
    kv = check_model(model)
    assert kv.kind == "trimmable" and kv.storage_modes == ["dense", "paged"]
    rot = check_model(swa_model)
    assert rot.kind == "snapshot" and rot.storage_modes == ["snapshot"]
    assert resolve_storage_mode("auto", 8, kv) == "paged"
    assert resolve_storage_mode("auto", 1, kv) == "dense"
    assert resolve_storage_mode("paged", 8, rot) == "snapshot"


def test_reject_reason_order_is_the_contract() -> None:
    assert [r.value for r in REJECT_REASONS][:3] == ["oversized", "disabled", "prefix_too_short"]
    assert RejectReason.BLOCK_BOUNDARY_FLOOR.stats_field == "reject_block_boundary_floor"
