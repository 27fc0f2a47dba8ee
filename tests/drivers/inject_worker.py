"""A real worker whose prompt cache is handed one entry before it starts serving.

Two reject reasons cannot be provoked by any request: `mode_mismatch` (a dense entry under the
paged backend; a worker's storage mode is fixed at start) and `layout_constraints` (an entry whose
KV cannot be cut to the match). This driver builds the worker exactly as `mlxcel-pool worker`
does, injects such an entry built from a real prefill, then runs the normal loop: a real request
then meets the entry in the scheduler's adopt path.

usage: python -m tests.drivers.inject_worker {dense_in_paged|corrupt_dense} TOKENS_JSON
"""

from __future__ import annotations

import json
import sys

from worker.mlx_cpu import blas

blas.preload_openblas()  # before anything imports mlx


def main(argv: list[str]) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from shared.config import load_settings
    from worker.main import build_worker
    from worker.prompt_cache.entries import DenseEntry
    from worker.prompt_cache.keys import CacheNamespace

    scenario, tokens = argv[0], json.loads(argv[1])
    loop = build_worker(load_settings())
    assert loop is not None and loop.engine.prompt_cache is not None
    model = loop.engine.model
    caches = make_prompt_cache(model)
    model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    entry = DenseEntry.detach(tokens, caches)
    if scenario == "corrupt_dense":
        entry.layers[0].keys = entry.layers[0].keys[..., :4, :]  # fewer tokens than it claims
    elif scenario != "dense_in_paged":
        raise SystemExit(f"unknown scenario {scenario!r}")
    # Completions carry no chat template: the router sends an empty signature.
    prompt_cache = loop.engine.prompt_cache
    prompt_cache.store.insert_entry(CacheNamespace(loop.engine.model_id), "", entry)
    loop.install_signal_handlers()
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
