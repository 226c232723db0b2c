"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"

QUOTE_LIMIT = 200  # characters of user input an error message quotes
MAX_MESSAGE_CHARS = 1000  # no error message is longer, whatever it quotes
MAX_PARAM_CHARS = 200
RETRY_AFTER_S = 1  # the Retry-After of every 429


def quote(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """User input for an error message, at most `limit` characters of it (with an ellipsis and the
    full length if cut); strings repr-quoted, so lone surrogates and control characters are escaped."""
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError:  # an int too long for str()
        return f"<{type(value).__name__} too long to show>"
    cut = len(text) > limit
    shown = text[:limit] + "…" if cut else text
    shown = repr(shown) if isinstance(value, str) else shown
    return f"{shown} ({len(text)} characters in all)" if cut else shown


def clip(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut to `limit` characters (noting the full length), encodable as UTF-8."""
    if len(message) > limit:
        message = f"{message[:limit]}… (truncated; {len(message)} characters in all)"
    if not message.isascii():
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return message


class APIError(Exception):
    """Raised anywhere in a handler; turned into an OpenAI error response by the app."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Mapping[str, str]] = None) -> None:
        message = clip(message)  # defensive: whatever a message quotes, it stays small
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = None if param is None else clip(param, MAX_PARAM_CHARS)
        self.code = code
        self.headers = dict(headers or {})
        if status == 429:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def rate_limited(message: str, code: str = "queue_full") -> APIError:
    """A 429 (with Retry-After, as every 429 has)."""
    return APIError(429, message, RATE_LIMIT, None, code, {"Retry-After": str(RETRY_AFTER_S)})


def too_large(limit: int, length: Optional[int] = None) -> APIError:
    """413 for a request body over the limit (`length`: its Content-Length, when it has one)."""
    size = f" of {length} bytes" if length is not None else ""
    return APIError(413, f"the request body{size} is larger than this server accepts ({limit} bytes); "
                    "send a smaller request", INVALID_REQUEST, None, "request_too_large")


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
    param = clip(".".join(loc), MAX_PARAM_CHARS) or None  # dict keys in `loc` are user input
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON: " + str(first.get("ctx", {}).get("error", first.get("msg"))), None
    if kind == "missing":
        if param is None:
            return "the request body is missing: send a JSON object", None
        return f"missing required parameter {quote(param)}", param
    msg = first.get("msg", "invalid value")
    extra = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + extra, param
