"""OpenAI-shaped errors: every failure the gateway answers is `{"error": {"message", "type", "code"}}`
with its HTTP status, never a traceback."""

from __future__ import annotations

import msgspec
from aiohttp import web

TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
    409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error",
}


class ApiError(Exception):
    """A request the gateway refuses or cannot serve; `response()` is what the client receives."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return TYPES.get(self.status, "server_error")

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}
        return web.Response(status=self.status, body=msgspec.json.encode(body), headers=self.headers,
                            content_type="application/json")
