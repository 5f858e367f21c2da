"""Errors in OpenAI's shape, with vLLM's values: {"error": {"message", "type", "param", "code"}}, the code
being the HTTP status (vLLM's every error has it so)."""
from __future__ import annotations

from aiohttp import web

TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
         408: "BadRequestError", 409: "ConflictError", 413: "BadRequestError", 414: "BadRequestError",
         431: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError",
         503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after
        self.headers = headers or {}  # more of the answer's headers (a 429's x-ratelimit-*)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "APIError"), "param": self.param,
                          "code": self.status}}

    def response(self) -> web.Response:
        headers = {**self.headers, **({"Retry-After": str(self.retry_after)} if self.retry_after else {})}
        return web.json_response(self.body(), status=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
