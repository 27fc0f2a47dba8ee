"""The model-holding worker.

- `worker.engine`: the batch engine (continuous batching over mlx-lm's BatchGenerator, with the
  prompt cache at admission and finish); one `Request` object per request; no I/O, no threads.
- `worker.broker`: the Redis side (rq registration and liveness, intake, the step's publish).
- `worker.prompt_cache`: the prefix cache (store, policy, block pool).
- `worker.mlx_cpu`: MLX-on-CPU shims (OpenBLAS preload, CPU ops, last-row logits).
- `worker.loop`: the loop that joins them, read like rq's `work()`.

Importing this package has no side effects: `worker.main.run` preloads OpenBLAS explicitly.
"""
