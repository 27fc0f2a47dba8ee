"""MLX on the CPU: the OpenBLAS preload, faster attention/SwiGLU ops, last-row logits.

Nothing here runs at import: the process calls `blas.preload_openblas()` itself, first thing,
before anything imports mlx (`worker.main.run`, the tests' conftest, the benchmarks).
"""
