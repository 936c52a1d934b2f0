"""OpenAI-shaped errors: one exception type for the serving code and the app's exception handlers.

Every error a client can cause leaves as a 4xx with ``{"error": {"message", "type", "param",
"code"}}``; FastAPI's own shapes (422 validation lists, ``{"detail": ...}``) never reach a
client. ``type`` names the error class as vLLM does (``BadRequestError``, ``NotFoundError``…);
``code`` is a short machine-readable string in OpenAI's style (``model_not_found``…).
Anything else that escapes a handler is a server bug: logged with its traceback, answered 500.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pydantic_core
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.error_types import error_type
from server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("ferry.server")

M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    """An error answered to the client as an OpenAI error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return error_type(self.status)

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def client_closed() -> APIError:
    """The client left before its answer was complete (nginx's 499; only logs and metrics see it)."""
    return APIError(499, "Client closed the request.", code="client_closed_request")


def internal_error() -> APIError:
    """A server bug: the handler that raised logs it; the client gets no detail."""
    return APIError(500, "Internal server error.", code="internal_error")


def timeout_error(seconds: float) -> APIError:
    # 408 as the OpenAI API answers a request it gave up on; the OpenAI SDKs retry it.
    return APIError(
        408, f"Request timed out after {seconds:g} s (server --request-timeout).", code="request_timeout"
    )


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def overloaded(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int = 5) -> APIError:
    return APIError(503, message, code="service_unavailable", headers={"Retry-After": str(retry_after_s)})


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param_from_loc(loc: Sequence[Any]) -> str | None:
    # pydantic adds union-member tags ("str", "list[int]", "function-after[...]") to locations;
    # they mean nothing to a client, nor does where FastAPI found a parameter (OpenAI names it alone).
    if loc and loc[0] in ("query", "path"):
        loc = loc[1:]
    parts = [
        str(p) for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))
    ]
    return ".".join(parts) or None


_FIELD_PREFIX = re.compile(r"^([a-z_][a-z_0-9]*): ")
# pydantic names types in Python's words when it validates a parsed dict (FastAPI's routes) and in
# JSON's when it parses the body itself (the generation fast path); clients sent JSON.
_JSON_WORDS = (("a valid list", "a valid array"), ("a valid dictionary", "an object"))


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """Map pydantic/FastAPI validation errors onto one 400 naming the first offending field."""
    if not errors:
        return bad_request("Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", first.get("msg", ""))
        return bad_request(f"Request body is not valid JSON: {detail}", code="invalid_json")
    param = _param_from_loc(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    for python_word, json_word in _JSON_WORDS:
        msg = msg.replace(python_word, json_word)
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    prefixed = _FIELD_PREFIX.match(msg)
    if param is None and prefixed:  # model-level validators name their field as "field: message"
        param, msg = prefixed.group(1), msg[prefixed.end() :]
    if param is None:
        return bad_request(f"Invalid request body: {msg}", code=code)
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return bad_request(f"Invalid value for '{param}': {msg}{more}", param=param, code=code)


def parse_json(body: bytes) -> Any:
    """A JSON body, parsed as the generation routes parse theirs (pydantic's parser): a string with
    a lone surrogate escape (``"\\ud800"``), which Python's ``json`` turns into a str no tokenizer
    can encode, is not valid JSON here either. Raises ``json.JSONDecodeError``, which FastAPI
    answers as a body that is not JSON."""
    try:
        return pydantic_core.from_json(body)
    except ValueError as e:
        raise json.JSONDecodeError(str(e), "", 0) from e


async def json_body(request: Request) -> Any:
    """A request's JSON body (for routes that validate it themselves), or a 400 saying why not."""
    try:
        return parse_json(await request.body())
    except ValueError as e:
        raise bad_request(f"Request body is not valid JSON: {e.msg}", code="invalid_json") from e


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """A FastAPI route whose JSON body is read with ``parse_json`` (FastAPI's own reads it with
    ``json.loads``, so a lone surrogate reached the tokenizer and was a 500)."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict


def validated(model: type[M], body: Any) -> M:
    """``body`` as a ``model``, or a 400 naming its first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from e


def _openai_shape(_: Request, error: APIError) -> Response:
    return error.to_response()


def install_error_handlers(
    app: FastAPI, respond: Callable[[Request, APIError], Response] = _openai_shape
) -> None:
    """The app's handlers: every error an ``APIError``, answered by ``respond`` (OpenAI's shape
    unless the app answers some paths in another API's shape, as Anthropic's Messages API)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> Response:
        return respond(request, validation_error(exc.errors()))

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(request: Request, exc: ValidationError) -> Response:
        return respond(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return respond(request, APIError(exc.status_code, message, code=code, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("internal error while serving %s %s", request.method, request.url.path)
        return respond(request, internal_error())
