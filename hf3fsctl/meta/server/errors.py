"""How the service answers an error: one `ErrorResponse` per typed error, status by class.

`InvalidRequest` 400 (a malformed body is 422), `AuthError` 401, `NotFound` 404,
`NamespaceConflict` 409, body or batch too large 413 (`BatchTooLarge`),
`MetadataUnavailable` 503 (the store stayed busy). The kind travels as data: the body's
`error` names the class, which `HttpMetadataClient` maps back to the same typed error.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from hf3fsctl.errors import (
    AuthError,
    Hf3fsctlError,
    InvalidRequest,
    MetadataUnavailable,
    NamespaceConflict,
    NotFound,
)
from hf3fsctl.meta.models import ErrorResponse

JSON = "application/json"

STATUS_OF_ERROR: dict[type[Hf3fsctlError], int] = {
    InvalidRequest: 400,
    AuthError: 401,
    NotFound: 404,
    NamespaceConflict: 409,
    MetadataUnavailable: 503,
}
_NAME_OF_STATUS = {s: t.__name__ for t, s in STATUS_OF_ERROR.items()}
DESCRIPTIONS = {
    400: "InvalidRequest: the request is well-formed but not acceptable",
    401: "AuthError: missing or wrong bearer token",
    404: "NotFound: no such namespace, rank file or route",
    409: "NamespaceConflict: registered before with another manifest or rank file",
    413: "InvalidRequest: body larger than max_body_bytes, or a batch larger than max_batch",
    422: "InvalidRequest: the body or a parameter does not match the schema",
    503: "MetadataUnavailable: the store stayed busy or cannot be written",
}


class BatchTooLarge(InvalidRequest):
    """A request carries more keys or items than `max_batch` (413)."""


def error_body(error: str, detail: str) -> bytes:
    return ErrorResponse(error=error, detail=detail).model_dump_json().encode()


def error_response(exc: Exception) -> Response:
    """The `ErrorResponse` of a typed error, a validation error or an HTTP error."""
    headers: dict[str, str] = {}
    if isinstance(exc, (RequestValidationError, ValidationError)):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        detail = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        if first.get("type") == "json_invalid":
            detail = f"body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})"
        if len(errors) > 1:
            detail += f" (and {len(errors) - 1} more)"
        status, name = 422, "InvalidRequest"
    elif isinstance(exc, HTTPException):  # routing (404, 405) and body decoding (400)
        status, detail = exc.status_code, str(exc.detail)
        name = _NAME_OF_STATUS.get(status, "InvalidRequest")
        headers = dict(exc.headers or {})
    elif isinstance(exc, Hf3fsctlError):
        status = next((s for t, s in STATUS_OF_ERROR.items() if isinstance(exc, t)), 400)
        name, detail = type(exc).__name__, exc.message
        if isinstance(exc, BatchTooLarge):
            status, name = 413, "InvalidRequest"
    else:
        raise TypeError(f"no error response for {type(exc).__name__}")
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    return Response(error_body(name, detail), status, headers, media_type=JSON)
