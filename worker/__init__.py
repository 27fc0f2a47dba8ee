"""The model-holding worker: rq intake, continuous-batching scheduler, prompt cache, publisher.

OpenBLAS must be loaded before the first `import mlx.core` (the mlx CPU wheel links a reference
BLAS ~50x slower for float32 matmul), so the package does it before anything else can import mlx.
"""

from worker import blas as _blas

_blas.preload_openblas()
