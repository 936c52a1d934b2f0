"""The mixture-of-experts MLP shared by the MoE decoders (DeepSeek-V2/V3, Qwen2-MoE, Qwen3-MoE, Mixtral).

Weights: each layer's experts stacked as ``w13`` [E, 2I, hidden] (gate and up fused) and ``w2``
[E, hidden, I], read from one tensor per expert (checkpoints) or from transformers' fused
in-memory layout; the router's weight (and DeepSeek-V3's score-correction bias) in fp32; the
shared experts, if any, as one dense MLP.

Forward: route each token to ``experts_per_token`` experts (``MoEConfig`` says how), then one
matmul pair per expert over the tokens routed to it, weighted and summed per token in expert
order (transformers' order), plus the shared experts. With the Triton op set, the routed experts
run as two grouped matmuls instead (``engine/kernels/triton_moe.py``: one launch each per layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.config import MoEConfig

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
Weights = dict[str, torch.Tensor]


def load_dense_mlp(w: Weights, prefix: str) -> dict[str, torch.Tensor]:
    """``gate_up`` (fused; Phi-3 stores it so) and ``down`` of a SwiGLU MLP at ``prefix`` (``….mlp.``)."""
    if prefix + "gate_up_proj.weight" in w:
        gate_up = w.pop(prefix + "gate_up_proj.weight")
    else:
        gate_up = torch.cat([w.pop(prefix + "gate_proj.weight"), w.pop(prefix + "up_proj.weight")])
    return {"gate_up": gate_up, "down": w.pop(prefix + "down_proj.weight")}


def run_experts(
    x: torch.Tensor,  # [T, hidden]
    weights: torch.Tensor,  # [T, k] fp32
    experts: torch.Tensor,  # [T, k]
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],  # (e, its tokens' rows) -> its outputs
) -> torch.Tensor:
    """Each expert once over the tokens routed to it, outputs weighted and summed per token in
    expert order (transformers' order)."""
    out = torch.zeros_like(x)
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, token order kept
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    flat_weights = weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows, pairs = tokens[start : start + n], order[start : start + n]
        start += n
        h = expert(e, x.index_select(0, rows))
        out.index_add_(0, rows, (h * flat_weights.index_select(0, pairs)[:, None]).to(x.dtype))
    return out


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)`` whose every element does not depend on the tensor's size (deterministic mode).

    An elementwise op on CPU runs a flattened tensor through a vectorised body and a scalar tail
    (and splits big ones across threads), which round the last bit differently, so a token's router
    scores would depend on how many tokens share its batch. ``softmax([x, 0])[0]`` is a row-wise
    kernel: each element's pair is computed alike wherever it sits (within an ulp of ``sigmoid``).
    """
    return torch.stack([x, torch.zeros_like(x)], dim=-1).softmax(dim=-1)[..., 0]


class MoE:
    def __init__(
        self,
        cfg: MoEConfig,
        linear: Linear,
        silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
        fused: Callable[..., torch.Tensor] | None = None,
        *,
        deterministic: bool = False,
    ) -> None:
        self.cfg = cfg
        self.linear = linear
        self.sigmoid = invariant_sigmoid if deterministic else torch.sigmoid
        self.silu_and_mul = silu_and_mul
        self.fused = fused  # the Triton op set's grouped matmuls (engine/kernels/triton_moe.py)

    def load(self, w: Weights, prefix: str) -> dict[str, torch.Tensor]:
        """One MoE layer's weights at ``prefix`` (``model.layers.N.mlp.``), popped from ``w``."""
        e = self.cfg.num_experts
        router = prefix + "gate.weight"
        if prefix + "experts.gate_up_proj" in w:  # transformers' fused in-memory layout
            w13, w2 = w.pop(prefix + "experts.gate_up_proj"), w.pop(prefix + "experts.down_proj")
            if prefix + "router.weight" in w:  # Granite-MoE's in memory (--load-format dummy)
                router = prefix + "router.weight"
        elif prefix + "input_linear.weight" in w:  # Granite-MoE: the same, its own names
            w13, w2 = w.pop(prefix + "input_linear.weight"), w.pop(prefix + "output_linear.weight")
            router = prefix + "router.layer.weight"
        else:  # checkpoints: one tensor per expert (Mixtral names them w1, w3, w2)
            ex = prefix + "experts."
            mixtral = f"{ex}0.w1.weight" in w
            gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            pairs = [(w.pop(f"{ex}{j}.{gate}.weight"), w.pop(f"{ex}{j}.{up}.weight")) for j in range(e)]
            w13 = torch.stack([torch.cat(pair) for pair in pairs])
            w2 = torch.stack([w.pop(f"{ex}{j}.{down}.weight") for j in range(e)])
        layer = {"w13": w13, "w2": w2, "router": w.pop(router).float()}
        bias = w.pop(prefix + "gate.e_score_correction_bias", None)
        if bias is None:  # ERNIE 4.5 names it so, shaped [1, experts]
            bias = w.pop(prefix + "moe_statics.e_score_correction_bias", None)
        if bias is None:  # MiniMax-M2: beside the gate
            bias = w.pop(prefix + "e_score_correction_bias", None)
        layer["router_bias"] = (
            torch.zeros(e, dtype=torch.float32, device=w13.device) if bias is None else bias.float().view(e)
        )
        if prefix + "shared_expert_gate.weight" in w:  # Qwen2-MoE: one shared expert behind a sigmoid gate
            layer.update(load_dense_mlp(w, prefix + "shared_expert."))
            layer["shared_gate"] = w.pop(prefix + "shared_expert_gate.weight")
        elif self.cfg.num_shared_experts:
            layer.update(load_dense_mlp(w, prefix + "shared_experts."))
        return layer

    def forward(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        linear = self.linear
        weights, experts = self.route(x, layer)  # [T, k] fp32, [T, k]
        if self.fused is not None:
            out = self.fused(x, layer["w13"], layer["w2"], weights, experts, self.silu_and_mul)
        else:
            out = self._loop(x, layer, weights, experts)
        if "gate_up" in layer:  # shared experts
            shared = linear(self.silu_and_mul(linear(x, layer["gate_up"], None)), layer["down"], None)
            if "shared_gate" in layer:
                shared = self.sigmoid(linear(x, layer["shared_gate"], None)) * shared
            out = out + shared
        return out

    def _loop(
        self, x: torch.Tensor, layer: dict[str, torch.Tensor], weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        linear, w13, w2 = self.linear, layer["w13"], layer["w2"]

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            return linear(self.silu_and_mul(linear(xs, w13[e], None)), w2[e], None)

        return run_experts(x, weights, experts, self.cfg.num_experts, expert)

    def route(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their fp32 weights (see ``MoEConfig``)."""
        logits = self.linear(x.float(), layer["router"], None)
        if self.cfg.topk_method != "noaux_tc":
            return self._route_softmax(logits.softmax(dim=-1))
        scores = logits.softmax(dim=-1) if self.cfg.scoring == "softmax" else self.sigmoid(logits)
        return self._route_biased(scores, layer["router_bias"])

    def _route_softmax(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax scores (DeepSeek-V2, Qwen3-MoE); with ``group_limited_greedy`` only the
        ``topk_groups`` groups holding the best single scores compete."""
        cfg = self.cfg
        if cfg.topk_method == "group_limited_greedy":
            t = scores.shape[0]
            grouped = scores.view(t, cfg.num_groups, -1)
            keep = torch.zeros(t, cfg.num_groups, dtype=torch.bool, device=scores.device)
            keep.scatter_(1, grouped.amax(dim=-1).topk(cfg.topk_groups, dim=-1, sorted=False)[1], True)
            scores = grouped.masked_fill(~keep[:, :, None], 0.0).view(t, -1)
        weights, experts = scores.topk(cfg.experts_per_token, dim=-1, sorted=False)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts

    def _route_biased(self, scores: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid (DeepSeek-V3) or softmax (ERNIE 4.5) scores; the choice adds the correction bias
        and keeps only the ``topk_groups`` groups whose two best experts score highest; the raw
        scores weigh."""
        cfg = self.cfg
        t = scores.shape[0]
        choice = scores + bias
        if cfg.num_groups > 1:
            grouped = choice.view(t, cfg.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(cfg.topk_groups, dim=-1, sorted=False)[1], True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, -1)
        experts = choice.topk(cfg.experts_per_token, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts
