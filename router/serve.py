"""Run the router under uvicorn: `main(settings)`.

uvicorn starts `settings.router.processes` processes, each calling `router.app:create_app()`
(factory mode). Before anything imports prometheus_client, this sets PROMETHEUS_MULTIPROC_DIR so
every process writes its metric files where `/metrics` reads them; the validated settings travel
to the children as JSON in the environment, so CLI overrides reach them too.
"""

from __future__ import annotations

import copy
import os
from typing import Any

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


def log_config() -> dict[str, Any]:
    """uvicorn's logging, plus our `router.*` loggers at INFO on its stderr handler: without
    it their startup lines (the model served, whether API keys are on) reach no handler."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["router"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def main(settings: Settings) -> None:
    from router.edge.auth import load_access

    # Read the key files here too, so a missing one is a config error (exit 2) before uvicorn
    # starts processes that would each fail on it.
    load_access(settings.auth)
    prepare_environment(settings)
    import uvicorn  # imports nothing of ours; the app is imported by uvicorn in each process

    uvicorn.run(
        APP_FACTORY,
        factory=True,
        host=settings.router.host,
        port=settings.router.port,
        workers=settings.router.processes,
        log_level="info",
        log_config=log_config(),
        timeout_graceful_shutdown=5,
    )
