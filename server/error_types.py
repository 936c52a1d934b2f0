"""The ``type`` of an OpenAI-shaped error body, by HTTP status: vLLM's class-style names
(``BadRequestError``, ``NotFoundError`` ...), shared by the replica's server and the router so a
client behind the router reads the same ``type`` whichever of them answered. No dependencies: the
router imports it without FastAPI."""

from __future__ import annotations

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """The error body's ``type`` for ``status``; unlisted ones by class (4xx or 5xx)."""
    return ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
