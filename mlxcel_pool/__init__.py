"""mlxcel-pool: the command line (`mlxcel-pool`) and the process supervisor (`Pool`).

The serving code lives in `router/`, `worker/` and `shared/`; this package only starts it.
"""

__version__ = "0.1.0"
