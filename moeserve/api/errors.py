"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

The official `openai` client reads `error.message` and `error.param` from this body and picks its
exception class from the HTTP status, so every failure the server reports goes through `APIError`.
Nothing here knows about FastAPI: the app turns an `APIError` into a JSON response in one handler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

# OpenAI's `type` for each status; a status not listed falls back to "invalid_request_error" (4xx)
# or "internal_error" (5xx), so a caller only names the type when it wants a different one.
_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
}


def error_type_for(status_code: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    default = "internal_error" if status_code >= 500 else "invalid_request_error"
    return _TYPE_BY_STATUS.get(status_code, default)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """The JSON body of an error response, exactly the keys OpenAI sends (all present, maybe null)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ErrorInfo(BaseModel):
    """The fields of an error, as the docs describe them (`error_body` builds the same keys)."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx JSON body the server sends."""

    error: ErrorInfo


class APIError(Exception):
    """A request failure the client should see: an HTTP status plus OpenAI's error fields.

    `param` names the request field at fault (e.g. "temperature") so clients and users can find
    it without parsing `message`; `type` defaults from the status.
    """

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type or error_type_for(status_code)
        self.param = param
        self.code = code
        self.headers = headers or {}
        """Extra response headers, e.g. Retry-After on a 429 or 503."""

    def body(self) -> dict[str, Any]:
        """This error as OpenAI's JSON body."""
        return error_body(self.message, self.type, self.param, self.code)

    def __repr__(self) -> str:
        return f"APIError({self.status_code}, {self.message!r}, param={self.param!r})"


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first bad top-level field, as vLLM answers (FastAPI's default is 422)."""
    return from_error_list(exc.errors(include_url=False), str(exc))


def from_error_list(errors: Sequence[Any], fallback: str, loc_prefix: str | None = None) -> APIError:
    """A 400 from pydantic-style error dicts (ours, or FastAPI's `RequestValidationError`, whose
    locations start with `loc_prefix`, e.g. "body").

    Only the top-level field becomes `param`: deeper pydantic locations include union-member tags
    such as `list[int]` that mean nothing to a client; the full location stays in `message`.
    """
    if not errors:
        return APIError(fallback)
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc_prefix is not None and loc[:1] == (loc_prefix,):
        loc = loc[1:]
    param = loc[0] if loc and isinstance(loc[0], str) else None
    where = ".".join(str(part) for part in loc)
    message = f"{where}: {first['msg']}" if where else first["msg"]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(message, status_code=400, param=param)
