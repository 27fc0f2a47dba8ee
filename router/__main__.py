"""`python -m router`: serve with settings from config/defaults.toml and the environment."""

from __future__ import annotations

import sys

from shared.config import ConfigError, load_settings


def run() -> None:
    from router.serve import main

    try:
        main(load_settings())  # a key file it cannot read is a ConfigError too
    except ConfigError as exc:
        sys.exit(f"mlxcel-pool router: {exc}")


if __name__ == "__main__":
    run()
