"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Every request failure the server answers goes through ``OpenAIError``: the serving code
raises it (or a pydantic ``ValidationError`` that ``validation_error_to_openai`` turns
into one) and the HTTP layer writes ``exc.body()`` with ``exc.status_code``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

# The "type" string for each status, as vLLM and the OpenAI SDK's exception classes name them.
_ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    """The OpenAI error "type" for an HTTP status (the status phrase, CamelCase, otherwise)."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"


def error_body(status: int, message: str, param: str | None = None, *,
               err_type: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response; ``code`` is the HTTP status, as vLLM sends it."""
    return {"error": {"message": message, "type": err_type or error_type(status),
                      "param": param, "code": status}}


class OpenAIError(Exception):
    """A request failure with its HTTP status, answered in the OpenAI error shape.

    ``param`` names the request field at fault (dotted path such as ``messages.0.role``)
    when there is one. Raise it as ``OpenAIError(404, "...", param="model")``.
    """

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = err_type or error_type(status_code)

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, self.param, err_type=self.type)

    def __repr__(self) -> str:
        return (f"OpenAIError(status_code={self.status_code}, type={self.type!r}, "
                f"param={self.param!r}, message={self.message!r})")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


class FieldError(ValueError):
    """A ``ValueError`` raised inside a validator that knows which field it is about.

    Pydantic keeps the exception in the error's context, so ``validation_error_to_openai``
    can report ``param`` even for a check that spans fields (a model validator has no
    location of its own).
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def _describe(err: Any) -> tuple[str | None, str]:
    """(param, "path: what was wrong") for one pydantic error entry."""
    loc = ".".join(str(part) for part in err.get("loc", ()))
    msg = str(err.get("msg", "invalid value"))
    for prefix in _PYDANTIC_PREFIXES:
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    cause = (err.get("ctx") or {}).get("error")
    param = getattr(cause, "param", None) or loc or None
    if loc and not msg.startswith(f"{loc} ") and not msg.startswith(f"{loc}:"):
        msg = f"{loc}: {msg}"
    return param, msg


def validation_error_to_openai(exc: ValidationError) -> OpenAIError:
    """A 400 whose message names every field path at fault and what was wrong with it,
    e.g. ``temperature: Input should be less than or equal to 2``; ``param`` is the
    first such path."""
    described = [_describe(err) for err in exc.errors()]
    if not described:
        return bad_request(str(exc))
    messages = list(dict.fromkeys(msg for _, msg in described))
    return bad_request("; ".join(messages), described[0][0])
