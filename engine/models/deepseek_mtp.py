"""DeepSeek-V3's multi-token-prediction (MTP) layer: the checkpoint's ``model.layers.{N}`` (N =
``num_hidden_layers``), which predicts the token after next (engine/mtp.py drafts with it).

At position i it reads the target's hidden state there (after the final norm) and the embedding of
the token at i + 1: each RMS-normalised (``hnorm``, ``enorm``), concatenated embedding first and
projected back to the hidden size (``eh_proj``), then one decoder layer of the target's kind (MLA
with its own latent cache, MoE) and ``shared_head.norm`` with the head give the logits of the token
at i + 2. The layer's output before that norm stands in for the target's hidden state when it
drafts again from its own draft. The embedding at position 0 is zeroed, as vLLM feeds it.

``embed_tokens`` and ``shared_head.head`` may be absent from the layer: the target's are used then
(the caller passes them). No forward of the target's runs here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.deepseek import DeepseekForCausalLM, Weights
from engine.models.kv_scales import KVScales, layer_scales


class DeepseekMTP(DeepseekForCausalLM):
    """Built as its target (the same ``cfg`` and options): ``weights`` hold
    ``model.layers.{cfg.num_layers}.…``."""

    def _load(self, weights: Weights, kv_scales: KVScales | None) -> None:
        n = self.cfg.num_layers
        p = f"model.layers.{n}."
        self.enorm = weights.pop(p + "enorm.weight")
        self.hnorm = weights.pop(p + "hnorm.weight")
        self.eh_proj = weights.pop(p + "eh_proj.weight")  # [hidden, 2 * hidden]
        self.head_norm = weights.pop(p + "shared_head.norm.weight")
        self.embed: torch.Tensor | None = weights.pop(p + "embed_tokens.weight", None)
        self.lm_head: torch.Tensor | None = weights.pop(p + "shared_head.head.weight", None)
        self.layers = [self._layer(weights, n)]
        self.kv_scales = [k for k, _ in layer_scales(kv_scales, 1)]

    def forward_mtp(
        self,
        input_ids: torch.Tensor,  # [T]: the token at each position + 1
        positions: torch.Tensor,  # [T]
        previous: torch.Tensor,  # [T, hidden]: the target's hidden state at each position
        kv_cache: torch.Tensor,  # the layer's latent cache
        meta: AttentionMetadata,
        embed: torch.Tensor,  # the embedding matrix (the layer's own or the target's)
    ) -> torch.Tensor:
        """The layer's output ``[T, hidden]`` (before ``shared_head.norm``)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        tokens = F.embedding(input_ids, embed).masked_fill((positions == 0)[:, None], 0)
        x = torch.cat(
            [ops.rms_norm(tokens, self.enorm, eps)[0], ops.rms_norm(previous, self.hnorm, eps)[0]], -1
        )
        x = self.linear(x, self.eh_proj, None)
        layer, kv_scale = self.layers[0], self.kv_scales[0]
        out, residual = self._decoder_layer(x, None, positions, layer, kv_cache, kv_scale, meta)
        return out + residual

    def mtp_logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of the token after next, from ``forward_mtp``'s rows."""
        return self.linear(
            self.ops.rms_norm(hidden, self.head_norm, self.cfg.rms_norm_eps)[0], head, None
        ).float()
