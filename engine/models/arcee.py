"""Llama decoders with an ungated MLP ``down(act(up(x)))``, whose ``up_proj`` / ``down_proj`` replace
SwiGLU's three projections: Arcee (AFM; ``hidden_act`` relu2, ``relu(x) ** 2``) and Apertus (xIELU,
with each layer's two trained parameters; Qwen3's per-head q/k RMSNorm; its norms named
``attention_layernorm`` / ``feedforward_layernorm``). Attention, rotary and the head are Llama's."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM


class ArceeForCausalLM(LlamaForCausalLM):
    ACTIVATION = "relu2"  # the only hidden_act served

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], **options: Any) -> None:
        if cfg.hidden_act != self.ACTIVATION:
            act, arch = cfg.hidden_act, cfg.architecture
            raise ValueError(f"{arch} with hidden_act {act!r} is not supported (only {self.ACTIVATION})")
        super().__init__(cfg, weights, **options)

    @staticmethod
    def _load_mlp(w: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        return {"up": w.pop(prefix + "up_proj.weight"), "down": w.pop(prefix + "down_proj.weight")}

    def _mlp(self, i: int, layer: dict[str, torch.Tensor | None], x: torch.Tensor) -> torch.Tensor:
        """``down(relu(up(x))^2)``; a LoRA adapter reaches attention only (``lora_layout`` lists no MLP
        projection of a layer without ``gate_up``)."""
        up = self.linear(x, layer["up"], None)  # type: ignore[arg-type]
        return self.linear(torch.relu(up).square(), layer["down"], None)  # type: ignore[arg-type]


class ApertusForCausalLM(ArceeForCausalLM):
    ACTIVATION = "xielu"

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor | None]:
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = w.pop(p + "attention_layernorm.weight")
        w[p + "post_attention_layernorm.weight"] = w.pop(p + "feedforward_layernorm.weight")
        return super()._layer(w, i)

    @staticmethod
    def _load_mlp(w: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        """The projections and xIELU's parameters: ``alpha_p`` / ``alpha_n`` (before softplus), and the
        ``beta`` / ``eps`` buffers as saved (XIELUActivation's defaults when a checkpoint has none)."""
        act = prefix + "act_fn."
        out = ArceeForCausalLM._load_mlp(w, prefix)
        out["alpha_p"] = F.softplus(w.pop(act + "alpha_p"))
        beta = w.pop(act + "beta", None)
        out["beta"] = torch.tensor(0.5, dtype=out["alpha_p"].dtype) if beta is None else beta
        out["alpha_n"] = out["beta"] + F.softplus(w.pop(act + "alpha_n"))
        eps = w.pop(act + "eps", None)
        out["eps"] = torch.tensor(-1e-6, dtype=out["alpha_p"].dtype) if eps is None else eps
        return {k: v.to(out["up"].device) for k, v in out.items()}

    def _mlp(self, i: int, layer: dict[str, torch.Tensor | None], x: torch.Tensor) -> torch.Tensor:
        """``down(xielu(up(x)))``: ``alpha_p x^2 + beta x`` above 0, else
        ``alpha_n (expm1(min(x, eps)) - x) + beta x``, as transformers' python xIELU computes it."""
        up = self.linear(x, layer["up"], None)  # type: ignore[arg-type]
        alpha_p, alpha_n, beta, eps = (layer[k] for k in ("alpha_p", "alpha_n", "beta", "eps"))
        act = torch.where(
            up > 0,
            alpha_p * up * up + beta * up,  # type: ignore[operator]
            (torch.expm1(torch.min(up, eps)) - up) * alpha_n + beta * up,  # type: ignore[arg-type, operator]
        )
        return self.linear(act, layer["down"], None)  # type: ignore[arg-type]
