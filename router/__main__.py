"""`python -m router`: serve with settings from config/defaults.toml and the environment."""

from __future__ import annotations

import sys

from shared.config import ConfigError, load_settings


def run() -> None:
    try:
        settings = load_settings()
    except ConfigError as exc:
        sys.exit(f"mlxcel-pool router: {exc}")
    from router.serve import main

    main(settings)


if __name__ == "__main__":
    run()
