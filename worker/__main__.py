"""`python -m worker`: one MLX worker against REDIS_URL, as `mlxcel-pool worker` runs it (the same
flags and exit codes), without importing the CLI package: settings come from `shared.config`,
the default model is built here when missing (after the OpenBLAS preload), then `worker.main`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shared.config import EXIT_CONFIG, ConfigError, Settings, load_settings, positive_int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker", description="run one MLX worker against REDIS_URL"
    )
    parser.add_argument("--model", help="model directory (default: the built-in model)")
    parser.add_argument("--worker-id", help="worker id (worker.id)")
    parser.add_argument("--batch-size", type=positive_int, help="max sequences decoded together")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(
        overrides={
            "model": {"path": args.model},
            "worker": {"id": args.worker_id, "batch_size": args.batch_size},
        }
    )
    if not settings.redis.url:
        raise ConfigError(
            "REDIS_URL is not set: `python -m worker` joins an existing pool "
            "(e.g. REDIS_URL=redis://127.0.0.1:6379/0); `mlxcel-pool up` starts one"
        )
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"python -m worker: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if not settings.model.path:
        from worker.mlx_cpu import blas

        blas.preload_openblas()  # the builder imports mlx
        from devmodel.builder import ensure_model

        path = ensure_model(settings.cache_dir)
        settings = settings.model_copy(
            update={"model": settings.model.model_copy(update={"path": str(path)})}
        )
    from worker.main import run

    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
