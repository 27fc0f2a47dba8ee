"""Fixes for mlx-lm model classes that compute wrong results in a batch, applied at load time.

`install(model)` applies every fix that matches the model (each is a no-op for other models) and
returns the names of those applied; the worker calls it on every model it loads, before
`worker.mlx_cpu.cpu_ops.install`, and the two compose in either order.
"""

from __future__ import annotations

from typing import Any

from worker.model_fixes import gemma2


def install(model: Any) -> list[str]:
    """Apply the fixes that match `model`; the names of those applied."""
    return ["gemma2_batch_mask"] if gemma2.install(model) else []
