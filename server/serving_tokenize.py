"""POST /tokenize and /detokenize (vLLM's shapes and defaults) and GET /v1/models."""

from __future__ import annotations

from server.images import check_images, with_image_runs
from server.lora import lora_model_cards
from server.params import check_token_ids
from server.prompts import chat_prompt
from server.protocol import ModelCard, ModelList
from server.state import ServerState
from server.tokenize_protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.tools import validated_tools


def tokenize(state: ServerState, req: TokenizeRequest) -> TokenizeResponse:
    state.check_model(req.model)
    tok = state.tokenizer
    if req.messages is not None:
        if req.tools:
            validated_tools(req.tools)  # the 400 a chat request with these tools gets (vLLM checks them too)
        # Image parts count as their placeholder runs (the images themselves are not read).
        num_images = len(check_images(state, req.messages))
        ids = with_image_runs(
            state,
            chat_prompt(req, tok, state.config.trust_request_chat_template, state.config.chat),
            num_images,
        )
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tok.encode(req.prompt or "", add_special_tokens=add_special)
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=state.limits.kv_capacity_tokens, tokens=ids, token_strs=strs
    )


def detokenize(state: ServerState, req: DetokenizeRequest) -> DetokenizeResponse:
    state.check_model(req.model)
    check_token_ids(req.tokens, state.limits, "tokens")
    # Special tokens kept, as vLLM's /detokenize (transformers' ``decode`` default): a rendered
    # chat prompt reads back with its turn markers and BOS, so it can be checked or re-tokenized.
    return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens, skip_special_tokens=False))


def list_models(state: ServerState) -> ModelList:
    root = getattr(getattr(state.engine, "model_info", None), "name", None)
    names = dict.fromkeys((state.model_name, *state.config.model_aliases))
    return ModelList(
        data=[
            ModelCard(id=name, root=root or state.model_name, max_model_len=state.limits.kv_capacity_tokens)
            for name in names
        ]
        + lora_model_cards(state)
    )
