"""Code both the router and the worker use: wire types, Redis keys, config, stats schema.

Nothing here imports MLX or FastAPI.
"""
