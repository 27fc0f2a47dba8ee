"""Run the router under uvicorn: `main(settings)`.

uvicorn starts `settings.router.processes` processes, each calling `router.app:create_app()`
(factory mode). Before anything imports prometheus_client, this sets PROMETHEUS_MULTIPROC_DIR so
every process writes its metric files where `/metrics` reads them; the validated settings travel
to the children as JSON in the environment, so CLI overrides reach them too.
"""

from __future__ import annotations

import os

from shared.config import Settings

APP_FACTORY = "router.app:create_app"
# The parent's validated settings as JSON, read by create_app() in uvicorn's worker processes.
SETTINGS_ENV = "MLXCEL_ROUTER_SETTINGS_JSON"


def prepare_environment(settings: Settings) -> None:
    """Everything a router process must find in its environment, set before it starts."""
    multiproc = settings.multiproc_dir
    multiproc.mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)
    os.environ[SETTINGS_ENV] = settings.model_dump_json()


def main(settings: Settings) -> None:
    prepare_environment(settings)
    import uvicorn  # imports nothing of ours; the app is imported by uvicorn in each process

    uvicorn.run(
        APP_FACTORY,
        factory=True,
        host=settings.router.host,
        port=settings.router.port,
        workers=settings.router.processes,
        log_level="info",
        timeout_graceful_shutdown=5,
    )
