"""Prompt embeddings (vLLM's ``--enable-prompt-embeds``): a prompt given as the model's input
embeddings ``[seq_len, hidden]`` (what transformers' ``model.get_input_embeddings()(ids)`` returns)
instead of token ids.

Such a prompt is one span of given features over the whole prompt (``engine/multimodal.py``
``ImageInput`` with ``features``): its positions hold ``EMBEDS_PLACEHOLDER_ID`` and the model runner
writes the features into the step's input embeddings there, as it does image features. Its digest
(a content hash of the features as the model reads them) keys every prompt block, so identical
embeddings share prefix-cache blocks and different ones never do.

The checks here are the whole contract for untrusted input: a payload is read with
``torch.load(weights_only=True)`` (never a full unpickle), and only a plain, dense, finite floating
tensor of the model's hidden size passes.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import torch

from engine.multimodal import EMBEDS_PLACEHOLDER_ID, ImageInput
from kvcache.keys import DIGEST_SIZE

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def load_prompt_embeds(data: bytes) -> torch.Tensor:
    """A ``torch.save``d tensor from its bytes (ValueError for anything else: another object, a
    pickle that ``weights_only`` refuses, bytes that are not a torch file)."""
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - zip, pickle and torch errors of all kinds: bad input
        raise ValueError(f"prompt_embeds is not a torch.save'd tensor ({type(e).__name__})") from None
    if type(value) is not torch.Tensor:
        raise ValueError(f"prompt_embeds must hold a tensor, not a {type(value).__name__}")
    return value


def check_prompt_embeds(value: object, hidden_size: int) -> torch.Tensor:
    """``value`` as a 2-D ``[seq_len, hidden]`` tensor (a 3-D one of batch 1 is squeezed); ValueError
    unless it is a dense floating tensor of the model's hidden size, non-empty and finite."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a tensor, not a {type(value).__name__}")
    t = value.detach()
    if t.layout is not torch.strided or t.is_quantized or t.is_nested:
        raise ValueError("prompt_embeds must be a dense tensor")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"prompt_embeds must be a floating tensor, not {t.dtype}")
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise ValueError(
            f"prompt_embeds must have shape [seq_len, hidden_size] (or [1, seq_len, hidden_size]), "
            f"got {list(t.shape)}"
        )
    if t.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds has hidden size {t.shape[1]}, the model's is {hidden_size}")
    if t.shape[0] == 0:
        raise ValueError("prompt_embeds is empty (no positions)")
    if not bool(torch.isfinite(t).all()):
        raise ValueError("prompt_embeds holds non-finite values (NaN or infinity)")
    return t


def embeds_digest(features: torch.Tensor) -> bytes:
    """A stable content hash of features as the model reads them (shape, dtype, bytes), apart from
    image digests."""
    t = features.detach().cpu().contiguous()
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(f"prompt_embeds:{tuple(t.shape)}:{t.dtype}".encode())
    h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


@dataclass(frozen=True)
class PreparedEmbeds:
    """A prompt given as embeddings, ready for ``LLMEngine.make_request``: its placeholder ids and
    its one span of features (checked, cast to the model's dtype, hashed, on the model's device).
    The async engine prepares it in a worker thread: checking and hashing a long prompt's rows
    takes milliseconds that no event loop should wait on."""

    token_ids: list[int]
    span: ImageInput


def prepare_prompt_embeds(
    value: object, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> PreparedEmbeds:
    t = check_prompt_embeds(value, hidden_size).to(dtype=dtype)
    if not bool(torch.isfinite(t).all()):  # fp32 values past the model dtype's range
        raise ValueError(f"prompt_embeds holds values out of the range of the model's dtype ({dtype})")
    digest = embeds_digest(t)
    n = t.shape[0]
    return PreparedEmbeds(
        [EMBEDS_PLACEHOLDER_ID] * n, ImageInput(0, n, None, digest, t.to(device).contiguous())
    )
