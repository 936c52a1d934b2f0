"""``prompt_embeds`` of ``/v1/completions`` (vLLM's ``--enable-prompt-embeds``): each item is the
base64 of a ``torch.save``d tensor ``[seq_len, hidden]`` (or ``[1, seq_len, hidden]``), a prompt
given as the model's input embeddings (``engine/prompt_embeds.py``).

Every way such a payload can be wrong is a 400 here, before anything is admitted: not base64, not a
torch file, a pickle ``torch.load(weights_only=True)`` refuses (nothing else ever unpickles it), an
object that is not a plain tensor, the wrong rank or hidden size, no rows, non-finite values. torch
is imported on the first such request, so API server processes stay torch-free without one.
"""

from __future__ import annotations

import base64
import binascii

from engine.multimodal import EMBEDS_PLACEHOLDER_ID
from server.completion_protocol import CompletionRequest
from server.errors import bad_request
from server.params import ModelLimits
from server.prompts import PreparedPrompt, kept_prompt_tokens, truncated

PARAM = "prompt_embeds"


def embeds_prompts(req: CompletionRequest, limits: ModelLimits) -> list[PreparedPrompt]:
    """The request's prompts given as embeddings, in order (none without ``prompt_embeds``); their
    token ids are ``seq_len`` placeholders, so lengths and usage count their rows."""
    raw = req.prompt_embeds
    if raw is None:
        return []
    if not limits.prompt_embeds_hidden:
        raise bad_request(
            "prompt_embeds is not enabled on this server (start it with --enable-prompt-embeds)", param=PARAM
        )
    items = [raw] if isinstance(raw, str) else list(raw)
    if not items:
        raise bad_request("prompt_embeds must not be empty", param=PARAM)
    from engine.prompt_embeds import check_prompt_embeds, load_prompt_embeds

    prompts = []
    for item in items:
        try:
            data = base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(
                "prompt_embeds must be base64 (of a torch.save'd tensor)", param=PARAM
            ) from None
        try:
            embeds = check_prompt_embeds(load_prompt_embeds(data), limits.prompt_embeds_hidden)
        except ValueError as e:
            raise bad_request(str(e), param=PARAM) from None
        keep = kept_prompt_tokens(req, limits)
        if keep is not None:
            embeds = truncated(embeds, keep, req)
        prompts.append(PreparedPrompt([EMBEDS_PLACEHOLDER_ID] * embeds.shape[0], None, embeds))
    return prompts


def check_embeds_features(req: CompletionRequest, role: str) -> None:
    """What a request with prompt embeddings cannot ask for: anything that needs the prompt's
    tokens or text (echo, prompt logprobs, beam search's prompt), or another role's hand-off."""
    if req.prompt_embeds is None:
        return
    if req.echo:
        raise bad_request("echo needs a prompt's text: prompt_embeds have none", param="echo")
    if req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs needs prompt tokens: prompt_embeds have none", param="prompt_logprobs"
        )
    if req.use_beam_search:
        raise bad_request("beam search is not available with prompt_embeds", param="use_beam_search")
    if role != "mixed" or req.kv_transfer is not None:
        raise bad_request(
            "prompt_embeds are served by mixed replicas only (no prefill/decode hand-off)", param=PARAM
        )
