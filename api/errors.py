"""Errors the API raises on purpose, and the handlers that turn every failure into a clean answer.

Two answer shapes: the jobs API speaks FastAPI's (`{"detail": ...}`, 422 for invalid input), the
OpenAI-compatible routes speak OpenAI's (`{"error": {message, type, param, code}}`, 400 for invalid
input), so each family of clients gets the errors its tools already parse.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from protocol.redis_errors import (
    REDIS_REFUSES_WRITES,
    RedisCannotPersistError,
    RedisReadOnlyError,
    why_writes_are_refused,
)

log = logging.getLogger(__name__)

_Model = TypeVar("_Model", bound=BaseModel)

# What a client is told when Redis refuses writes (REDIS_REFUSES_WRITES), each kind by its cause.
_WRITES_REFUSED: dict[type[Exception], str] = {
    # At its maxmemory with a policy that evicts nothing (as a queue's should): memory comes
    # back as finished jobs' keys expire.
    redis.exceptions.OutOfMemoryError: "Redis is out of memory (its maxmemory is reached)",
    # MISCONF: its last save to disk failed (a full disk, its directory gone).
    RedisCannotPersistError: "Redis cannot save to disk (its last save failed: see its log)",
    # READONLY: a failover demoted the server this process is connected to.
    RedisReadOnlyError: "Redis is a read-only replica now (a failover is under way)",
}

# Routes tagged with this answer errors in OpenAI's shape.
OPENAI_TAG = "openai"
# Routes tagged with this answer errors in Text Generation Inference's: {"error", "error_type"}.
TGI_TAG = "tgi"
# Routes tagged with this answer errors in Anthropic's: {"type": "error", "error": {type, message}}.
ANTHROPIC_TAG = "anthropic"


class ApiError(Exception):
    """An answer other than success, decided by the API (not a bug)."""

    status_code = 500
    error_type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class InvalidRequestError(ApiError):
    """Input that fails a check pydantic cannot make alone (model limits, unknown model)."""

    status_code = 422  # 400 on the OpenAI routes
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None,
                 code: str = "invalid_value", location: str = "body") -> None:
        super().__init__(message, param=param, code=code)
        self.location = location  # where the param is: body, header, query or path


class AuthenticationError(ApiError):
    status_code = 401
    error_type = "invalid_request_error"  # what OpenAI itself answers for a bad key

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class NotFoundError(ApiError):
    status_code = 404
    error_type = "invalid_request_error"


class ConflictError(ApiError):
    status_code = 409
    error_type = "invalid_request_error"


class PayloadTooLargeError(ApiError):
    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_too_large")


class QueueFullError(ApiError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, code="queue_full", headers={"Retry-After": str(retry_after_s)})


class KeyLimitError(ApiError):
    """One API key's own limit (queued jobs, tokens per minute: api/key_policies.py); `code`
    names the limit."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, code: str, retry_after_s: int) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})


class ServiceUnavailableError(ApiError):
    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, code="service_unavailable",
                         headers={"Retry-After": str(retry_after_s)})


class JobFailedError(ApiError):
    """A job the worker failed, answered to a client that waited for its result."""

    status_code = 500
    error_type = "server_error"


class ErrorJSONResponse(JSONResponse):
    """JSON that survives any echoed input: NaN/Infinity become strings, lone surrogates are
    escaped (ensure_ascii), so rendering an error can never become a second error."""

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode()


# How deep an echoed input is rendered: a body nested hundreds of levels deep (valid JSON) would
# otherwise overflow the stack while its error is rendered, and answer a 500 instead of the 422.
_MAX_ECHO_DEPTH = 16


def _finite(value: Any, depth: int = 0) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict | list | tuple) and depth >= _MAX_ECHO_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {str(k): _finite(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v, depth + 1) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)  # e.g. the exception pydantic puts in an error's ctx


def is_openai_route(request: Request) -> bool:
    return _has_tag(request, OPENAI_TAG)


# A request answered in TGI's shape on a route of another API's (/tokenize, sent TGI's body).
TGI_SHAPE_STATE = "carpool_tgi_shape"
# A route taking several APIs' bodies (/tokenize) tells them apart with these union tags (pydantic
# puts the tag in an error's location: not a field).
VLLM_BODY, TGI_BODY = "vllm_body", "tgi_body"
BODY_FORM_TAGS = frozenset({VLLM_BODY, TGI_BODY})


def is_tgi_route(request: Request) -> bool:
    return _has_tag(request, TGI_TAG) or getattr(request.state, TGI_SHAPE_STATE, False)


def answer_in_tgi_shape(request: Request) -> None:
    """This request's errors in TGI's shape, on a route shared with another API's body (/tokenize)."""
    setattr(request.state, TGI_SHAPE_STATE, True)


def is_anthropic_route(request: Request) -> bool:
    return _has_tag(request, ANTHROPIC_TAG)


def _has_tag(request: Request, tag: str) -> bool:
    route = request.scope.get("route")
    return tag in (getattr(route, "tags", None) or [])


# TGI's error types by status (huggingface_hub raises its own exception for each of the first four).
_TGI_ERROR_TYPES = {422: "validation", 424: "generation", 429: "overloaded", 500: "incomplete_generation",
                    401: "authentication", 404: "not_found", 503: "unavailable"}


def tgi_error_response(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    """TGI's error body; any other client error is a validation error there."""
    error_type = _TGI_ERROR_TYPES.get(status, "validation" if status < 500 else "internal")
    return ErrorJSONResponse({"error": message, "error_type": error_type}, status_code=status,
                             headers=headers)


def openai_error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# Anthropic's error types by status.
_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                          403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                          429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_response(message: str, status: int,
                             headers: dict[str, str] | None = None) -> JSONResponse:
    error_type = _ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                            else "api_error")
    return ErrorJSONResponse({"type": "error", "error": {"type": error_type, "message": message}},
                             status_code=status, headers=headers)


def _tgi_or_anthropic_error(request: Request, message: str, status: int,
                            headers: dict[str, str] | None = None, *, invalid: bool = False,
                            failed: bool = False) -> JSONResponse | None:
    """The error in TGI's or Anthropic's shape when the route is one of theirs (None otherwise):
    an `invalid` request is TGI's 422 and Anthropic's 400, a `failed` job TGI's 424."""
    if is_tgi_route(request):
        return tgi_error_response(message, 422 if invalid else 424 if failed else status, headers)
    if is_anthropic_route(request):
        return anthropic_error_response(message, 400 if invalid else status, headers)
    return None


def error_response(request: Request, error: ApiError) -> JSONResponse:
    shaped = _tgi_or_anthropic_error(request, error.message, error.status_code, error.headers,
                                     invalid=isinstance(error, InvalidRequestError),
                                     failed=isinstance(error, JobFailedError))
    if shaped is not None:
        return shaped
    if is_openai_route(request):
        status = 400 if isinstance(error, InvalidRequestError) else error.status_code
        body = openai_error_body(error.message, error.error_type, error.param, error.code)
        return ErrorJSONResponse(body, status_code=status, headers=error.headers)
    if isinstance(error, InvalidRequestError):
        # Same shape as FastAPI's own 422s, so clients parse one format for every invalid field.
        loc = [error.location, *error.param.split(".")] if error.param else [error.location]
        detail: Any = [{"loc": loc, "msg": error.message, "type": error.code or "value_error"}]
    else:
        detail = error.message
    return ErrorJSONResponse({"detail": detail}, status_code=error.status_code,
                             headers=error.headers)


def describe_validation_error(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One readable sentence (naming the field and the limit) and the field, from pydantic's list."""
    first = errors[0] if errors else {}
    loc = [part for part in first.get("loc", ()) if part != "body"]
    # A union adds the member that failed to the location ("tool_choice", "str"): not a field.
    loc = [part for part in loc if not (isinstance(part, str) and (_is_type_name(part) or part in BODY_FORM_TAGS))]
    param = ".".join(str(part) for part in loc) or None
    kind = first.get("type", "")
    message = clean_message(first.get("msg", "invalid"))
    if kind in (JSON_INVALID, CONTENT_TYPE):
        return message, None  # written whole by readable_body_errors
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        if param is None:
            return "The request body is missing: send a JSON object", None
        return f"Missing required parameter: '{param}'", param
    if param is None:
        return f"Invalid request body: {message}", None
    got = first.get("input")
    shown = ""
    if kind != "value_error" and isinstance(got, str | int | float | bool):
        shown = f" (got {json.dumps(got)[:80]})"
    return f"Invalid value for '{param}': {message}{shown}", param


def validated(model: type[_Model], body: dict[str, Any]) -> _Model:
    """`body` as a request `model` checked outside FastAPI's own validation (a batch line, a
    request read as another); a 400 naming the field, as a route answers its own body's."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = describe_validation_error(exc.errors())
        raise InvalidRequestError(message, param=param) from exc


# Error types of a body that is not a JSON document at all (no field to name).
JSON_INVALID = "json_invalid"
CONTENT_TYPE = "content_type"


def readable_body_errors(request: Request, errors: Sequence[Any]) -> list[dict[str, Any]]:
    """FastAPI's errors, with the two that concern the whole body rewritten to say what to fix:
    JSON that does not parse ("JSON decode error" alone names neither the problem nor where), and
    a body that was not sent as JSON (pydantic then complains it got bytes, not an object)."""
    readable = []
    for error in errors:
        error = dict(error)
        if error.get("type") == JSON_INVALID and error.get("msg") == "JSON decode error":
            reason = error.get("ctx", {}).get("error", "")
            at = error.get("loc", ())[1:]
            where = f" at character {at[0]}" if at else ""
            error["msg"] = f"The request body is not valid JSON ({reason}{where})"
        elif tuple(error.get("loc", ())) == ("body",) and error.get("type") == "missing":
            error["msg"] = "The request body is missing: send a JSON object"
        elif tuple(error.get("loc", ())) == ("body",) and isinstance(error.get("input"), bytes):
            content_type = request.headers.get("content-type")
            got = f"'{content_type}'" if content_type else "none"
            error = {"type": CONTENT_TYPE, "loc": ("body",), "input": None,
                     "msg": "The request body must be a JSON object sent with 'Content-Type: "
                            f"application/json' (got Content-Type {got})"}
        readable.append(error)
    return readable


def unreadable_body_error(cause: BaseException | None) -> RequestValidationError | None:
    """The 400 'There was an error parsing the body' FastAPI answers when json.loads fails other
    than on syntax, as the invalid-JSON error it is, saying why; None for any other cause."""
    if isinstance(cause, UnicodeDecodeError):
        reason = (f"byte 0x{cause.object[cause.start]:02x} at position {cause.start} is not "
                  "UTF-8; encode the JSON as UTF-8")
    elif isinstance(cause, RecursionError):
        reason = "it is nested too deeply"
    elif isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        # CPython refuses to parse an integer literal this long (a denial-of-service guard).
        reason = f"a number has more than {sys.get_int_max_str_digits()} digits"
    else:
        return None
    return RequestValidationError([{
        "type": JSON_INVALID, "loc": ("body",), "input": None,
        "msg": f"The request body is not valid JSON ({reason})", "ctx": {"error": reason}}])


def routing_detail(request: Request, status_code: int, headers: dict[str, str]) -> str | None:
    """What the router's bare "Not Found" / "Method Not Allowed" should have said."""
    if status_code == 404 and request.scope.get("route") is None:
        return (f"No route {request.method} {request.url.path}: the routes are listed at /docs "
                "(job ids go in /v1/jobs/{job_id}, so they cannot contain '/')")
    if status_code == 405:
        allowed = headers.get("allow", headers.get("Allow", ""))
        return f"{request.method} is not allowed on {request.url.path}; use {allowed}"
    return None


def allowed_methods(request: Request) -> str:
    """Every method a route of this path takes, for a 405's Allow header: Starlette's names only
    the methods of the first route whose path matched (GET of a GET / POST / DELETE resource)."""
    allowed = []
    for method in _METHODS:
        scope = {**request.scope, "method": method}
        if any(route.matches(scope)[0] is Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return ", ".join(allowed)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def clean_message(message: str) -> str:
    # pydantic prefixes the text of a ValueError raised by a validator; the text says it all.
    return message.removeprefix("Value error, ")


def _is_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "dict", "list", "none"} or "[" in part


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(request, exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = readable_body_errors(request, exc.errors())
        shaped = _tgi_or_anthropic_error(request, describe_validation_error(errors)[0], 422,
                                         invalid=True)
        if shaped is not None:
            return shaped
        if is_openai_route(request):
            message, param = describe_validation_error(errors)
            body = openai_error_body(message, "invalid_request_error", param, "invalid_value")
            return ErrorJSONResponse(body, status_code=400)
        return ErrorJSONResponse({"detail": _jsonable_errors(errors)}, status_code=422)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        unreadable = unreadable_body_error(exc.__cause__)
        if unreadable is not None:
            return await on_validation_error(request, unreadable)
        headers = dict(exc.headers or {})
        if exc.status_code == 405 and (allowed := allowed_methods(request)):
            headers = {name: value for name, value in headers.items() if name.lower() != "allow"}
            headers["Allow"] = allowed
        detail = routing_detail(request, exc.status_code, headers) or exc.detail
        shaped = _tgi_or_anthropic_error(request, str(detail), exc.status_code, headers)
        if shaped is not None:
            return shaped
        # No route under /v1: an OpenAI client (a route Carpool does not serve, such as
        # /v1/embeddings) shows only an `error` object's message (the Node client says "no body"
        # without one), a job API client reads `detail`: both get theirs.
        unserved_v1 = request.scope.get("route") is None and request.url.path.startswith("/v1/")
        if is_openai_route(request) or unserved_v1:
            body = openai_error_body(str(detail), "invalid_request_error", None, None)
            if unserved_v1:
                body["detail"] = detail
            return ErrorJSONResponse(body, status_code=exc.status_code, headers=headers)
        return ErrorJSONResponse({"detail": detail}, status_code=exc.status_code,
                                 headers=headers)

    async def on_redis_down(request: Request, exc: Exception) -> JSONResponse:
        log.warning("Redis unreachable: %s", exc)
        return error_response(request, ServiceUnavailableError(
            "Redis is unreachable; the job queue is unavailable, try again shortly", retry_after_s))

    async def on_redis_refusing_writes(request: Request, exc: Exception) -> JSONResponse:
        # Redis refuses writes for now (protocol/redis_errors.py); reads still work.
        log.warning("Redis refused a write: %s (%s)", why_writes_are_refused(exc), exc)
        context = getattr(request.app.state, "context", None)
        if isinstance(exc, RedisReadOnlyError) and context is not None:
            await context.drop_idle_connections()
        what = next(text for kind, text in _WRITES_REFUSED.items() if isinstance(exc, kind))
        return error_response(request, ServiceUnavailableError(
            f"{what} and takes no new jobs; try again shortly", retry_after_s))

    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        error = ApiError("Internal server error (logged on the server)", code="internal_error")
        return error_response(request, error)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(redis.exceptions.ConnectionError, on_redis_down)
    app.add_exception_handler(redis.exceptions.TimeoutError, on_redis_down)
    for refusal in REDIS_REFUSES_WRITES:
        app.add_exception_handler(refusal, on_redis_refusing_writes)
    app.add_exception_handler(Exception, on_bug)


def _jsonable_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for error in errors:
        item = {k: v for k, v in error.items() if k != "url"}
        item["msg"] = clean_message(str(item.get("msg", "")))
        out.append(item)
    return out
