"""The FastAPI app of one replica: ``build_app(engine, config)``.

Routes are thin: parse (pydantic, at the edge), hand to a serving module, return. Edge checks
(request id, API key, body size) run in ``EdgeMiddleware`` before routing; the two generation
routes are then served by ``GenerationRoutes`` without FastAPI's per-request machinery (FastAPI
still declares them for the OpenAPI schema); every error leaves in OpenAI's shape
(``server.errors``), or in Anthropic's under ``/v1/messages``.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ferry import __version__
from server.admin_routes import add_admin_routes
from server.anthropic_protocol import CountTokensRequest, MessagesRequest
from server.anthropic_protocol import error_response as anthropic_error
from server.batch_api import add_batch_routes
from server.batch_lines import AppCaller
from server.chat_protocol import ChatCompletionRequest
from server.completion_protocol import CompletionRequest
from server.config import ServerConfig
from server.embedding_protocol import EmbeddingRequest
from server.errors import (
    APIError,
    StrictJSONRoute,
    client_closed,
    install_error_handlers,
    json_body,
    model_not_found,
    unavailable,
    validated,
)
from server.generation import Generation
from server.generation_routes import GenerationRoutes
from server.lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    load_lora_adapter,
    unload_lora_adapter,
)
from server.metrics import ServerMetrics
from server.middleware import EdgeMiddleware, is_messages
from server.params import ModelLimits
from server.pooling_protocol import PoolingRequest
from server.protocol import MAX_LOGPROBS, ErrorResponse, ModelCard, ModelList
from server.responses_protocol import ResponsesRequest
from server.responses_records import item_page, load_record
from server.responses_store import RUNNING, StoreUnavailable, open_response_store
from server.sagemaker import invocation
from server.score_protocol import ClassificationRequest, RerankRequest, ScoreRequest
from server.serving_chat import create_chat_completion
from server.serving_classify import create_classification, served_classifier
from server.serving_common import plan_off_loop, prompt_chars
from server.serving_completions import create_completion
from server.serving_embeddings import create_embedding
from server.serving_messages import count_tokens, create_message
from server.serving_pooling import create_pooling
from server.serving_responses import create_response
from server.serving_score import create_rerank, create_score
from server.serving_tokenize import detokenize, list_models, tokenize
from server.state import ServerState
from server.streaming import ClientDisconnected
from server.token_routes import add_token_routes
from server.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from server.tracing import open_tracing

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 409, 413, 429, 503)
}


def build_state(engine: Any, config: ServerConfig) -> ServerState:
    info = engine.model_info
    engine_config = getattr(engine, "config", None)
    max_logprobs = min(MAX_LOGPROBS, int(getattr(engine_config, "max_logprobs", MAX_LOGPROBS)))
    limits = ModelLimits(
        # Prompt ids must be tokens: a checkpoint may pad its embedding rows past the tokenizer's
        # vocabulary (the engine refuses those ids; here the refusal is a 400 before any stream).
        vocab_size=min(int(info.vocab_size), int(getattr(engine.tokenizer, "vocab_size", info.vocab_size))),
        max_model_len=int(info.max_model_len),
        max_logprobs=max_logprobs,
        max_n=config.max_n,
        block_size=int(info.block_size),
        num_kv_blocks=int(getattr(info, "num_kv_blocks", 0) or 0),
        seq_capacity=int(getattr(info, "kv_capacity_tokens", 0) or 0),
        generation_defaults=dict(getattr(info, "generation_defaults", None) or {}),
        priority_scheduling=getattr(engine_config, "scheduling_policy", "fcfs") == "priority",
        eos_token_ids=tuple(getattr(info, "eos_token_ids", ()) or ()),
        engine_max_logprobs=int(getattr(engine_config, "max_logprobs", MAX_LOGPROBS)),
        image=getattr(info, "image", None),
        stream_interval=config.http.stream_interval,
        prompt_embeds_hidden=int(info.hidden_size)
        if getattr(engine_config, "enable_prompt_embeds", False)
        else 0,
    )
    max_loras = engine_config.max_loras if getattr(engine_config, "enable_lora", False) else None
    cache_info = {
        "block_size": str(info.block_size),
        "cache_dtype": str(getattr(engine_config, "kv_cache_dtype", "auto")),
        "enable_prefix_caching": str(bool(getattr(engine_config, "enable_prefix_caching", True))),
        "gpu_memory_utilization": str(getattr(engine_config, "gpu_memory_utilization", "")),
        "num_gpu_blocks": str(getattr(info, "num_kv_blocks", 0)),
    }
    metrics = ServerMetrics(config.served_model_name, engine.stats, max_loras, cache_info)
    return ServerState(
        engine=engine,
        config=config,
        tokenizer=engine.tokenizer,
        limits=limits,
        block_size=int(info.block_size),
        generation=Generation(
            engine, config, metrics, open_tracing(config.otlp_traces_endpoint, "ferry-serve", "ferry.server")
        ),
        metrics=metrics,
        responses=open_response_store(
            config.responses_store, config.responses_store_max_bytes, config.responses_store_ttl, engine
        ),
    )


# FastAPI (0.165 on) traces and meters every request through OpenTelemetry when a provider is
# set process-wide, and asks the providers on each request whether one is (~4 % of a streamed
# request's event-loop time in a profile of an API server). ferry's own spans (``--otlp-traces-endpoint``,
# server/tracing.py) come from a provider of its own, never the process-wide one, so it stays off.
_NO_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def _shaped(request: Request, error: APIError) -> Response:
    """An error in Anthropic's shape under ``/v1/messages`` (an unknown path there too), else OpenAI's."""
    if is_messages(request.scope):
        return anthropic_error(error, getattr(request.state, "request_id", None))
    return error.to_response()


def build_app(engine: Any, config: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (an ``engine.AsyncEngine``)."""
    state = build_state(engine, config)
    app = FastAPI(
        title="ferry",
        version=__version__,
        description="OpenAI-compatible API of one ferry replica.",
        **config.http.fastapi_kwargs(),  # docs
        **_NO_TELEMETRY,
    )
    # vLLM's --root-path, as FastAPI's ``root_path`` (every request's scope names it, so routes match
    # with or without the prefix), set here: passed to ``FastAPI(...)`` it warns at every start that
    # it is deprecated (uvicorn's own would prefix every path, so a prefixed request would not match).
    app.root_path = config.http.root_path
    app.router.route_class = StrictJSONRoute  # every route declared below parses its body strictly
    app.state.ferry = state
    install_error_handlers(app, _shaped)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return client_closed().to_response()

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(
            state, body, request.state.request_id, request.receive, getattr(request.state, "submitted", None)
        )

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(
            state, body, request.state.request_id, request.receive, getattr(request.state, "submitted", None)
        )

    @app.post("/v1/responses", responses=_ERRORS)
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        return await create_response(
            state, body, request.state.request_id, request.receive, getattr(request.state, "submitted", None)
        )

    @app.post("/v1/messages", responses=_ERRORS)
    async def messages(request: Request) -> Any:
        try:
            body = validated(MessagesRequest, await json_body(request))
            return await create_message(
                state,
                body,
                request.state.request_id,
                request.receive,
                getattr(request.state, "submitted", None),
            )
        except APIError as e:
            return anthropic_error(e, request.state.request_id)

    @app.post("/v1/messages/count_tokens", responses=_ERRORS)
    async def messages_count_tokens(request: Request) -> Any:
        try:
            req = validated(CountTokensRequest, await json_body(request))
            return await count_tokens(state, req)
        except APIError as e:
            return anthropic_error(e, request.state.request_id)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(
        response_id: str, stream: bool = False, starting_after: int | None = Query(None, ge=0)
    ) -> Any:
        record = await load_record(state, response_id)
        if stream:  # a background stream's events again (server/responses_background.py)
            return await state.background.stream(record, starting_after)
        return JSONResponse(record["response"])

    @app.post("/v1/responses/{response_id}/cancel", responses=_ERRORS)
    async def cancel_response(response_id: str) -> Any:
        return JSONResponse(await state.background.cancel(await load_record(state, response_id)))

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete_response(response_id: str) -> Any:
        record = await load_record(state, response_id)
        if record["response"].get("background") and record["response"].get("status") in RUNNING:
            await state.background.cancel(record)  # else it would store itself again when it ends
        try:
            deleted = state.responses is not None and await state.responses.delete(response_id)
        except StoreUnavailable as e:
            raise unavailable(str(e)) from e
        if not deleted:
            raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items", responses=_ERRORS)
    async def response_input_items(
        response_id: str,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
        before: str | None = None,
    ) -> Any:
        items = (await load_record(state, response_id))["input"]
        return JSONResponse(item_page(items, limit, order, after, before))

    @app.post("/v1/embeddings", responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await create_embedding(
            state, body, request.state.request_id, request.receive, getattr(request.state, "submitted", None)
        )

    # vLLM's scoring routes, by its paths (``/v1/…`` kept as vLLM keeps them; ``/v2/rerank``: Cohere's).
    @app.post("/score", responses=_ERRORS)
    @app.post("/v1/score", responses=_ERRORS)
    async def score(body: ScoreRequest, request: Request) -> Any:
        return await create_score(
            state, body, request.state.request_id, request.receive, getattr(request.state, "submitted", None)
        )

    @app.post("/rerank", responses=_ERRORS)
    @app.post("/v1/rerank", responses=_ERRORS)
    @app.post("/v2/rerank", responses=_ERRORS)
    async def rerank(body: RerankRequest, request: Request) -> Any:
        return await create_rerank(
            state, body, request.state.request_id, request.receive, getattr(request.state, "submitted", None)
        )

    @app.post("/classify", responses=_ERRORS)
    @app.post("/v1/classify", responses=_ERRORS)
    async def classify(body: ClassificationRequest, request: Request) -> Any:
        return await create_classification(
            state, body, request.state.request_id, request.receive, getattr(request.state, "submitted", None)
        )

    # vLLM's raw pooling route: each input's embedding or class probabilities as a plain vector.
    @app.post("/pooling", responses=_ERRORS)
    async def pooling(body: PoolingRequest, request: Request) -> Any:
        return await create_pooling(
            state, body, request.state.request_id, request.receive, getattr(request.state, "submitted", None)
        )

    # SageMaker's contract (vLLM serves it too): every request on one path; /ping is the health check.
    @app.post("/invocations", responses=_ERRORS)
    async def invocations(request: Request) -> Any:
        kind, body = invocation(await json_body(request), served_classifier(state) is not None)
        handler = {
            "chat": create_chat_completion,
            "completion": create_completion,
            "embedding": create_embedding,
            "classification": create_classification,
            "score": create_score,
            "rerank": create_rerank,
            "pooling": create_pooling,
        }[kind]
        return await handler(
            state, body, request.state.request_id, request.receive, getattr(request.state, "submitted", None)
        )

    @app.post("/v1/load_lora_adapter", responses=_ERRORS)
    async def load_lora_route(body: LoadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await load_lora_adapter(state, body))

    @app.post("/v1/unload_lora_adapter", responses=_ERRORS)
    async def unload_lora_route(body: UnloadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await unload_lora_adapter(state, body))

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> Any:
        return list_models(state)

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def model_card(model: str) -> Any:
        """OpenAI's retrieve model (``client.models.retrieve``): one card of ``/v1/models``."""
        for card in list_models(state).data:
            if card.id == model:
                return card
        raise model_not_found(model)

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize_route(body: TokenizeRequest) -> Any:
        await state.resolve_model(body.model)
        return await plan_off_loop(prompt_chars(body), tokenize, state, body)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize_route(body: DetokenizeRequest) -> Any:
        await state.resolve_model(body.model)
        return detokenize(state, body)

    if config.tokenizer_info_endpoint:  # vLLM's --enable-tokenizer-info-endpoint

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> Any:
            return JSONResponse(state.tokenizer.info())

    add_token_routes(app, state)  # render and tokens-in/tokens-out generate (server/token_routes.py)
    add_batch_routes(app, state.batches)  # OpenAI's Files and Batches API (server/batch_api.py)

    # /health, /load, /metrics, /version, sleep mode, /reset_prefix_cache, dev-mode routes.
    load = add_admin_routes(app, engine, state)

    # Added first, so it runs inside EdgeMiddleware (Starlette wraps later additions around it).
    app.add_middleware(GenerationRoutes, state=state)
    app.add_middleware(
        EdgeMiddleware,
        api_key=config.api_key,
        max_request_bytes=config.max_request_bytes,
        max_file_bytes=config.max_file_bytes,
        announce=getattr(engine, "announce", None),
        load=load,
    )
    # Outermost (as vLLM's): a browser's preflight is answered before the API key is asked for.
    http = config.http
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(http.allowed_origins),
        allow_methods=list(http.allowed_methods),
        allow_headers=list(http.allowed_headers),
        allow_credentials=http.allow_credentials,
    )
    # A batch's requests go through this whole app, edge checks included (server/batch_lines.py).
    state.batches.caller = AppCaller(app, config.api_key)
    return app
