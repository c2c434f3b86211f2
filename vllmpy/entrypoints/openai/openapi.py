"""The server's own OpenAPI document (``/openapi.json``), complete enough to test from.

The routes read their bodies themselves (so every failure answers in OpenAI's error
shape, never FastAPI's), which leaves FastAPI's generated document without request
bodies. ``document`` completes it: each body-taking operation gets its request model's
JSON Schema, and every operation the error responses it can give, in the OpenAI shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from vllmpy.entrypoints.openai.errors import error_type

_REF = "#/components/schemas/{model}"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every error this server answers: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# The errors any operation may answer; those with a body add 400 and 413.
COMMON_ERRORS = (401, 404, 405, 500, 503)
BODY_ERRORS = (400, 413)


def document(app: FastAPI, bodies: dict[str, list[type[BaseModel]]]) -> None:
    """Make ``app.openapi()`` return the completed document. ``bodies`` maps a POST path
    to the request models its body may be (one, or several as ``anyOf``)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI, bodies: dict[str, list[type[BaseModel]]]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models: list[type[BaseModel]] = [ErrorResponse,
                                     *{m for ms in bodies.values() for m in ms}]
    names, top = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(top.get("$defs", {}))
    refs = {m: names[(m, "validation")] for m in models}
    error_ref = refs[ErrorResponse]
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            errors: tuple[int, ...] = COMMON_ERRORS
            if method == "post" and path in bodies:
                choices = [refs[m] for m in bodies[path]]
                body_schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
                operation["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": body_schema}}}
                errors = (*BODY_ERRORS, *COMMON_ERRORS)
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's validation shape: never answered here
            for status in errors:
                responses[str(status)] = {
                    "description": error_type(status),
                    "content": {"application/json": {"schema": error_ref}}}
    return schema
