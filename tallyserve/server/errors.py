"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from typing import Any, Optional

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """Raised anywhere in a handler; turned into an OpenAI error response by the app."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def unavailable(message: str, code: str = "engine_unavailable") -> APIError:
    return APIError(503, message, SERVER_ERROR, None, code)


def step_failed(message: str) -> APIError:
    return APIError(500, f"the engine failed while running this request: {message}", SERVER_ERROR,
                    None, "engine_step_failed")


def status_error_type(status: int) -> str:
    """The error type for a bare HTTP status (unknown routes, wrong methods, ...)."""
    if status == 401:
        return AUTHENTICATION
    if status == 404:
        return NOT_FOUND
    if status == 429:
        return RATE_LIMIT
    if status >= 500:
        return SERVER_ERROR
    return INVALID_REQUEST


def validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """One readable message (and the offending parameter) from pydantic / FastAPI errors."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Drop union-branch tags pydantic appends (e.g. prompt.str, prompt.list[int]).
    loc = [p for p in loc if not any(ch in p for ch in "[]") and p not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON: " + str(first.get("ctx", {}).get("error", first.get("msg"))), None
    if kind == "missing":
        if param is None:
            return "the request body is missing: send a JSON object", None
        return f"missing required parameter {param!r}", param
    msg = first.get("msg", "invalid value")
    extra = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + extra, param
