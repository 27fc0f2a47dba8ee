"""GET routes that answer HEAD too (aiperf and load balancers probe with HEAD)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter

F = TypeVar("F", bound=Callable[..., Any])


def get_and_head(router: APIRouter, path: str) -> Callable[[F], F]:
    """Register `fn` for GET and, as its own route, HEAD (Starlette drops HEAD's body): one
    route per method, so each has its own OpenAPI operation id."""

    def register(fn: F) -> F:
        router.add_api_route(path, fn, methods=["GET"])
        router.add_api_route(path, fn, methods=["HEAD"], name=f"{fn.__name__}_head")
        return fn

    return register
