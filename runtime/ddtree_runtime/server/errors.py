"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error a client should see, with its HTTP status. Raised anywhere in request handling."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": encodable(message),
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": None if param is None else encodable(param),
            "code": code,
        }
    }


def encodable(text: str) -> str:
    """`text` with any lone surrogate escaped: an error may quote client input, and a lone surrogate
    cannot be encoded as UTF-8 (the response itself would fail)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
