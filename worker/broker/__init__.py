"""The Redis side of a worker: rq registration and liveness, intake, the per-step publish."""
