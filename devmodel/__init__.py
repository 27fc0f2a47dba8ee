"""The development-model factory: small random-weight Llama models built offline (no hub).

`devmodel.paths` (no mlx) says where a model lives and whether it is built; `devmodel.builder`
builds one (imports mlx: call `worker.mlx_cpu.blas.preload_openblas()` first). The worker, the
supervisor, the router, the tests and the benchmarks all go through these two modules.
"""

from devmodel.paths import DEFAULT_SEED, DEFAULT_SIZE, built_model_dir, is_built, model_dir_name

__all__ = ["DEFAULT_SEED", "DEFAULT_SIZE", "built_model_dir", "is_built", "model_dir_name"]
