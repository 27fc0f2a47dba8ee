"""Every HTTP response counted by route and status class (`mlxcel_http_responses_total`), the
door's own refusals (401, 413, 429) included: the outermost middleware."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.metrics import HTTP_RESPONSES

STATUS_CLASSES = ("2xx", "4xx", "5xx")
OTHER = "other"  # a path no route serves: one label for all, so a scan cannot grow the series


class HttpMetrics:
    def __init__(self, app: ASGIApp, paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.paths = paths  # the app's routes' paths, for a request refused before routing
        for path in (*paths, OTHER):  # every route's series at 0 from the first scrape on
            for status_class in STATUS_CLASSES:
                HTTP_RESPONSES.labels(path, status_class).inc(0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets when the app fails before answering

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            HTTP_RESPONSES.labels(self._route(scope), f"{status // 100}xx").inc()

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        path = getattr(route, "path", None)
        if isinstance(path, str):
            return path
        return scope["path"] if scope["path"] in self.paths else OTHER
