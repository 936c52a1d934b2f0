"""``LayerNormDecoder``: the frame of the classic LayerNorm decoders (GPT-NeoX / Pythia, Phi 1-2,
StableLM, GPT-J, OLMo 1; engine/models/classic.py; Falcon, engine/models/falcon.py), which differ only
in their weights' names and in how a layer's attention and MLP meet the residual stream.

Every layer LayerNorms (mean subtracted, optional weight and bias) its input ``h`` into ``x`` and runs
attention on it (a fused q/k/v projection, optionally clamped (OLMo 1's ``clip_qkv``), optional
per-head q/k LayerNorm, rotary over the first ``rotary_dim`` dims of each head). Then, by the
family's ``_residual_style()``:

* ``"shared"``: ``h + attn(x) + mlp(x)``, one norm for both (Phi, GPT-J, StableLM's parallel layers,
  Falcon 7B);
* ``"two_norms"``: ``h + attn(x) + mlp(norm2(h))``, both on the layer's input (GPT-NeoX parallel,
  Falcon 40B/180B);
* ``"sequential"``: ``h' = h + attn(x)``, then ``h' + mlp(norm2(h'))`` (the others' non-parallel
  layers, OLMo 1).

The MLP is SwiGLU (StableLM, OLMo 1) or ungated ``fc2(act(fc1(x)))`` with optional biases. The
final LayerNorm and the LM head may carry biases. Sums run in transformers' order up to the association of three terms:
fp32 results agree to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.models.activations import ACTIVATIONS
from engine.models.decoder import DecoderBase, KVCache, Layer, apply_rope, split_heads


def head_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm of ``x`` [T, H, D] over each head's D dims, scaled by ``weight`` (one [D] shared by
    the heads, Phi's; or [H, D], a weight per head, StableLM's) plus ``bias``, in fp32."""
    out = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps) * weight.float()
    return (out if bias is None else out + bias.float()).to(x.dtype)


class LayerNormDecoder(DecoderBase):
    """A subclass picks ``_residual_style()`` (default ``"shared"``), sets ``ROPE_INTERLEAVE`` and
    ``WEIGHT_RENAMES`` (its names -> ``model.embed_tokens``, ``model.norm``, ``model.layers.N``,
    ``lm_head``) and loads a layer into the keys ``forward`` reads: ``in_norm`` (+ ``_bias``),
    ``qkv`` / ``qkv_bias`` (q, k, v rows in that order), ``o`` / ``o_bias``, optional ``q_norm`` /
    ``k_norm`` (+ ``_bias``), ``post_norm`` (+ ``_bias``) where a second norm runs, and either
    ``gate_up`` / ``down`` (SwiGLU) or ``fc`` / ``fc_bias`` / ``proj`` / ``proj_bias``."""

    ROPE_INTERLEAVE = False  # GPT-J rotates pairs (x0, x1), (x2, x3)… of the rotary dims
    GATED = False  # SwiGLU MLP (StableLM); else ungated with the config's hidden_act

    def _residual_style(self) -> str:
        return "shared"

    def _setup(self, w: dict[str, torch.Tensor]) -> None:
        act = self.cfg.hidden_act
        if self.GATED and act != "silu":
            raise ValueError(f"{self.cfg.architecture} with hidden_act {act!r} is not supported (only silu)")
        if not self.GATED and act not in ACTIVATIONS:
            raise ValueError(
                f"{self.cfg.architecture} with hidden_act {act!r} is not supported "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.cfg.head_dim:
            raise ValueError(
                f"{self.cfg.architecture}: a rotary share of {self.cfg.partial_rotary_factor} rotates "
                f"{self.rotary_dim} of {self.cfg.head_dim} dims per head (rotary_pct / partial_rotary_factor "
                "/ rotary_dim must give an even count, at most the head)"
            )
        self.act = ACTIVATIONS.get(act, F.silu)
        self.norm_bias = w.pop("model.norm.bias", None)
        self.lm_head_bias = w.pop("lm_head.bias", None)
        self._mlp = self._swiglu if self.GATED else self._ungated_mlp
        blocks = {"shared": self._shared, "two_norms": self._two_norms, "sequential": self._sequential}
        self._block = blocks[self._residual_style()]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]``, the head's bias added (Phi's, GPT-J's)."""
        return self.linear(hidden, self.lm_head, self.lm_head_bias).float()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of the ids' embeddings
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed) if inputs_embeds is None else inputs_embeds
        for i, layer, window, cos_sin, kv_cache, scales in self._per_layer(kv_caches):
            x = ops.layer_norm(hidden, layer["in_norm"], layer["in_norm_bias"], eps)[0]
            qkv = self._project(i, "qkv", x, layer["qkv"], layer["qkv_bias"])
            if cfg.clip_qkv is not None:  # OLMo 1: q, k and v clamped as projected
                qkv = qkv.clamp(-cfg.clip_qkv, cfg.clip_qkv)
            q, k, v = split_heads(qkv, cfg)
            if "q_norm" in layer:
                q = head_layer_norm(q, layer["q_norm"], layer["q_norm_bias"], eps)
                k = head_layer_norm(k, layer["k_norm"], layer["k_norm_bias"], eps)
            rotary = (self.rotary_dim, self.ROPE_INTERLEAVE)  # every layer of these families rotates
            q, k = apply_rope(ops, positions, q, k, cos_sin, *rotary)  # type: ignore[arg-type]
            attn = self._attend(i, layer, q, k, v, kv_cache, scales, meta, window)
            hidden = self._block(i, layer, hidden, x, attn)
        return ops.layer_norm(hidden, self.norm, self.norm_bias, eps)[0]

    # -- how attention and the MLP meet the residual stream (one picked in _setup) ---------------------

    def _shared(
        self, i: int, layer: Layer, h: torch.Tensor, x: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        return h + attn + self._mlp(i, layer, x)

    def _two_norms(
        self, i: int, layer: Layer, h: torch.Tensor, x: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        x2 = self.ops.layer_norm(h, layer["post_norm"], layer["post_norm_bias"], self.cfg.rms_norm_eps)[0]
        return h + attn + self._mlp(i, layer, x2)

    def _sequential(
        self, i: int, layer: Layer, h: torch.Tensor, x: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        h = h + attn
        x2 = self.ops.layer_norm(h, layer["post_norm"], layer["post_norm_bias"], self.cfg.rms_norm_eps)[0]
        return h + self._mlp(i, layer, x2)

    def _ungated_mlp(self, i: int, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        return self._ungated(layer, x, self.act)
