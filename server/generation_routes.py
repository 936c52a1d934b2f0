"""POST /v1/completions, /v1/chat/completions and /v1/responses, served around FastAPI's request
machinery.

A generation request spends most of its event-loop time before the engine sees it, and while
an idle engine gathers a burst (``AsyncEngine._gather_burst``) that time is every request's
TTFT. FastAPI's part of it (routing, the dependency solver, its own JSON parse and validation
pass, the exception middleware) was a third of that time: 0.10-0.15 ms of the 0.35 ms a
streamed request costs the loop, measured by calling the app in process with 32 at once. Here
the body goes straight to pydantic's JSON validator (``model_validate_json``) and the request
to its serving function; errors take the same ``server.errors`` mapping the app's handlers use,
so a client cannot tell the two paths apart. FastAPI still declares both routes (the OpenAPI
schema, /docs) and serves every other path.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from server.chat_protocol import ChatCompletionRequest
from server.completion_protocol import CompletionRequest
from server.errors import APIError, client_closed, internal_error, validation_error
from server.middleware import ASGIApp, Receive, Scope, Send, route_path
from server.responses_protocol import ResponsesRequest
from server.serving_chat import create_chat_completion
from server.serving_completions import create_completion
from server.serving_responses import create_response
from server.state import ServerState
from server.streaming import ClientDisconnected

logger = logging.getLogger("ferry.server")

Handler = Callable[[ServerState, Any, str, Receive, Callable[[], None] | None], Awaitable[Response]]

ROUTES: dict[str, tuple[type[BaseModel], Handler]] = {
    "/v1/completions": (CompletionRequest, create_completion),
    "/v1/chat/completions": (ChatCompletionRequest, create_chat_completion),
    "/v1/responses": (ResponsesRequest, create_response),
}


class GenerationRoutes:
    """ASGI middleware: the two generation routes, straight to their serving functions.

    Sits inside ``EdgeMiddleware``, which has buffered the body and set ``scope["state"]``
    (request id, body, announce handle); ``receive`` still delivers disconnects to the handlers.
    """

    def __init__(self, app: ASGIApp, *, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            ROUTES.get(route_path(scope)) if scope["type"] == "http" and scope["method"] == "POST" else None
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        model, handler = route
        edge = scope["state"]  # what EdgeMiddleware set
        try:
            request = model.model_validate_json(edge["body"])
            response = await handler(self.state, request, edge["request_id"], receive, edge.get("submitted"))
        except APIError as e:
            response = e.to_response()
        except ValidationError as e:
            response = validation_error(e.errors(include_url=False)).to_response()
        except ClientDisconnected:
            response = client_closed().to_response()
        except Exception:
            logger.exception("internal error while serving POST %s", scope["path"])
            response = internal_error().to_response()
        await response(scope, receive, send)
