"""POST /tokenize and /detokenize (vLLM's shapes) and GET /v1/models."""

from __future__ import annotations

from server.images import check_images, with_image_runs
from server.lora import lora_model_cards
from server.params import check_token_ids
from server.prompts import chat_prompt
from server.protocol import ModelCard, ModelList
from server.state import ServerState
from server.tokenize_protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


def tokenize(state: ServerState, req: TokenizeRequest) -> TokenizeResponse:
    state.check_model(req.model)
    tok = state.tokenizer
    if req.messages is not None:
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
    return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens))


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
