"""`python -m mlxcel_pool ...`: how the supervisor starts its children (same interpreter)."""

from mlxcel_pool.cli import main

raise SystemExit(main())
