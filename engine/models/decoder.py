"""What ferry's decoders over the paged KV cache share: the batch-invariant linear, rotary and head
helpers, and ``DecoderBase``, the frame of a decoder whose layers are dicts of plain tensors.

A decoder class loads one layer's weights (``_layer``) and runs its forward over a flattened batch
(every new token of every scheduled sequence in one ``[T]`` dimension). ``DecoderBase`` holds the
rest they all repeated: picking the linear (fast or batch-invariant), the rotary tables and sliding
windows per layer, the embeddings and head, the fp8 cache scales, LoRA's layout and the attention call
through the output projection.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.lora import LoRABatch, ModuleSlot
from engine.models.config import ModelConfig
from engine.models.kv_scales import KVScales, layer_scales
from engine.models.rope import build_cos_sin_cache
from engine.ops import Ops

Layer = dict[str, Any]  # a layer's tensors (None where an optional one, a bias, is absent)
KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's paged (k, v) cache

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose row results do not depend on how many rows share the call.

    Inputs on a device in ``KERNEL_DEVICES`` (CUDA: cuBLAS picks kernels and split-K by M) go to the
    Triton matmul of ``engine/kernels/triton_matmul.py``. CPU inputs stay on MKL, whose summation
    order for a row depends on M twice over, measured: tiny M (< 12) takes another kernel, and with
    more than one thread a long input (M past ~128-256 at K >= 1024) is split across the threads
    another way. So every call has exactly ``MIN_INVARIANT_ROWS`` rows: short inputs are padded,
    long ones cut into tiles of that many rows (the last padded). Within one call shape a row's
    result does not depend on its place in the tile or on the other rows.
    """
    if x.device.type in KERNEL_DEVICES:
        return _kernel_linear(x.device.type)(x, weight, bias)
    m, tile = x.shape[0], MIN_INVARIANT_ROWS
    if m % tile:
        padded = x.new_zeros((m + tile - m % tile, x.shape[1]))
        padded[:m] = x
        x = padded
    outs = [F.linear(rows, weight, bias) for rows in x.split(tile)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[:m]


MIN_INVARIANT_ROWS = 16
# Devices whose deterministic linears run the Triton matmul. The tests add "cpu" (under Triton's
# interpreter) to run the kernel path through the engine; the MKL path stays CPU's serving path.
KERNEL_DEVICES = frozenset({"cuda"})


@cache
def _kernel_linear(device: str) -> Linear:
    """The Triton matmul where Triton can run on ``device``; else ``F.linear``, with one warning that
    rows then depend on their batch (Triton is an optional dependency)."""
    from engine.kernels import triton_usable

    if triton_usable(device):
        from engine.kernels.triton_matmul import linear

        return linear
    warnings.warn(
        f"deterministic mode on {device} without triton: linear layers use F.linear, whose results "
        "depend on the batch (pip install 'ferry-serve[triton]' for batch invariance)",
        stacklevel=2,
    )
    return F.linear


def invariant_per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x[t, h] @ w[h]`` for ``x`` [T, H, a] and ``w`` [H, a, b] -> [T, H, b] (DeepSeek's absorbed
    latent attention), each token's result independent of T: on ``KERNEL_DEVICES`` the Triton
    kernel (cuBLAS's batched matmul picks kernels by size too); on MKL, T padded to
    ``MIN_INVARIANT_ROWS`` as ``invariant_linear`` pads."""
    if x.device.type in KERNEL_DEVICES and _kernel_linear(x.device.type) is not F.linear:
        from engine.kernels.triton_matmul import per_head_matmul

        return per_head_matmul(x, w)
    t = x.shape[0]
    xt = x.transpose(0, 1)
    if t < MIN_INVARIANT_ROWS:
        padded = x.new_zeros((x.shape[1], MIN_INVARIANT_ROWS, x.shape[2]))
        padded[:, :t] = xt
        return torch.bmm(padded, w)[:, :t].transpose(0, 1)
    return torch.bmm(xt, w).transpose(0, 1)


def take_embeddings(
    w: dict[str, torch.Tensor], cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(token embeddings, final norm weight, lm_head) popped from ``w``; the lm_head is the
    embedding matrix when the model ties them or the checkpoint has none (a base model). The norm
    weight is None for a norm without one (OLMo 1's)."""
    embed, norm = w.pop("model.embed_tokens.weight"), w.pop("model.norm.weight", None)
    head = w.pop("lm_head.weight", None)
    return embed, norm, embed if cfg.tie_word_embeddings or head is None else head


def dense_lora_layout(
    layers: list[dict[str, Any]], q: int, kv: int, hidden: int
) -> list[dict[str, ModuleSlot]]:
    """Per layer, the projections a LoRA adapter may target, for a model whose layers hold fused
    ``qkv`` / ``o`` / ``gate_up`` / ``down`` weights: PEFT's module name -> (fused group, first output
    row in it, in features, out features). A layer without ``gate_up`` (experts) takes none there."""
    layouts = []
    for layer in layers:
        slots: dict[str, ModuleSlot] = {
            "q_proj": ("qkv", 0, hidden, q),
            "k_proj": ("qkv", q, hidden, kv),
            "v_proj": ("qkv", q + kv, hidden, kv),
            "qkv_proj": ("qkv", 0, hidden, q + 2 * kv),
            "o_proj": ("o", 0, q, hidden),
        }
        if "gate_up" in layer:
            inter = layer["down"].shape[1]
            slots["gate_proj"] = ("gate_up", 0, hidden, inter)
            slots["up_proj"] = ("gate_up", inter, hidden, inter)
            slots["gate_up_proj"] = ("gate_up", 0, hidden, 2 * inter)
            slots["down_proj"] = ("down", 0, inter, hidden)
        layouts.append(slots)
    return layouts


def layer_cos_sin(
    cfg: ModelConfig, rotary_dim: int, max_positions: int, device: torch.device
) -> list[torch.Tensor | None]:
    """Per layer, its rotary cos/sin table (one table per distinct rope), None for a NoPE layer."""
    ropes = cfg.layer_rope or ((cfg.rope_theta, cfg.rope_scaling),) * cfg.num_layers
    tables: dict[str, torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for rope in ropes:
        if rope is not None and repr(rope) not in tables:
            tables[repr(rope)] = build_cos_sin_cache(rotary_dim, max_positions, *rope, device)
        out.append(None if rope is None else tables[repr(rope)])
    return out


def apply_rope(
    ops: Ops,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    interleave: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` [T, Hq, D] and ``k`` [T, Hkv, D] with their first ``rotary_dim`` dims rotated. With
    ``interleave`` (GLM-4, ERNIE 4.5) the pairs are (x0, x1), (x2, x3)…: those dims are gathered into
    halves and rotated half-split, as transformers does. q and k move alike, so every q.k (all that
    attention reads of them; the cache holds k so permuted) is unchanged."""
    d = q.shape[-1]
    if rotary_dim == d and not interleave:
        q, k = q.contiguous(), k.contiguous()
        ops.rotary_embedding(positions, q, k, cos_sin)
        return q, k
    q_rot, k_rot = q[..., :rotary_dim], k[..., :rotary_dim]
    if interleave:
        q_rot = torch.cat([q_rot[..., 0::2], q_rot[..., 1::2]], dim=-1)
        k_rot = torch.cat([k_rot[..., 0::2], k_rot[..., 1::2]], dim=-1)
    q_rot, k_rot = q_rot.contiguous(), k_rot.contiguous()
    ops.rotary_embedding(positions, q_rot, k_rot, cos_sin)
    if rotary_dim == d:
        return q_rot, k_rot
    return torch.cat([q_rot, q[..., rotary_dim:]], dim=-1), torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)


def split_heads(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused q/k/v projection ``[T, (Hq + 2 Hkv) D]`` as q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``."""
    t, q_size, kv_size = qkv.shape[0], cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q = qkv[:, :q_size].reshape(t, cfg.num_heads, cfg.head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[:, q_size + kv_size :].reshape(t, cfg.num_kv_heads, cfg.head_dim)
    return q, k, v


def head_norm(ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` [T, H, D] in rows of the weight's width: one head (Qwen3, Hunyuan) or all of
    a token's heads at once (MiniMax-M2)."""
    return ops.rms_norm(x.reshape(-1, weight.shape[0]), weight, eps)[0].view(x.shape)


class DecoderBase(ABC):
    """The frame of a decoder over the paged KV cache. A subclass provides ``_layer`` (one layer's
    weights, popped from the checkpoint's) and ``forward``; it may override ``_attention_scale``,
    ``_rotary_tables`` and ``_setup`` (what ``_layer`` needs, built before the layers load).

    Attributes a subclass's forward reads: ``linear``, ``scale``, ``q_size`` / ``kv_size`` (a token's
    q and k widths over all heads), ``rotary_dim``, and per layer ``cos_sin`` (None: no rotary),
    ``windows`` (None: full attention) and ``kv_scales``; ``lora`` is the step's adapters, set by the
    model runner before each forward.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        ops: Ops,
        attention: AttentionBackend,
        deterministic: bool,
        max_positions: int,
        device: torch.device,
        kv_scales: KVScales | None = None,
    ) -> None:
        self.cfg = cfg
        self.ops = ops
        self.attention = attention
        self.deterministic = deterministic
        self.linear: Linear = invariant_linear if deterministic else F.linear
        self.scale = self._attention_scale()
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # Partial rotary (Phi-4-mini, GLM-4): only the first rotary_dim dims of each head rotate.
        self.rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.cos_sin = self._rotary_tables(max_positions, device)
        self.windows = cfg.layer_windows or (None,) * cfg.num_layers
        self.embed, self.norm, self.lm_head = take_embeddings(weights, cfg)
        self._setup(weights)
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        self.kv_scales = layer_scales(kv_scales, cfg.num_layers)  # the fp8 cache's (k, v) scales
        self.lora: LoRABatch | None = None

    # -- construction hooks --------------------------------------------------------------------------

    def _attention_scale(self) -> float:
        return self.cfg.head_dim**-0.5

    def _rotary_tables(self, max_positions: int, device: torch.device) -> list[torch.Tensor | None]:
        return layer_cos_sin(self.cfg, self.rotary_dim, max_positions, device)

    def _setup(self, w: dict[str, torch.Tensor]) -> None:  # noqa: B027 (an optional hook)
        """Check the config, take model-wide tensors beyond the embeddings, final norm and head from
        ``w`` and build what ``_layer`` needs (an MoE's runner); nothing by default."""

    @abstractmethod
    def _layer(self, w: dict[str, torch.Tensor], i: int) -> Layer:
        """Layer ``i``'s weights, popped from the checkpoint's ``w``."""

    # -- the model runner's interface ----------------------------------------------------------------

    def lora_layout(self) -> list[dict[str, ModuleSlot]]:
        """Per layer, the projections a LoRA adapter may target (``dense_lora_layout``)."""
        return dense_lora_layout(self.layers, self.q_size, self.kv_size, self.cfg.hidden_size)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' input embeddings ``[T, hidden]``, as transformers' ``get_input_embeddings()``
        gives them (what prompt embeddings and image features stand in for; a fresh tensor)."""
        return F.embedding(input_ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for the rows that need them (never the whole batch)."""
        return self.linear(hidden, self.lm_head, None).float()

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [T, hidden]: instead of ``embed_tokens(input_ids)``
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``."""

    # -- pieces of a forward -------------------------------------------------------------------------

    def _per_layer(
        self, kv_caches: list[KVCache]
    ) -> Iterator[tuple[int, Layer, int | None, torch.Tensor | None, KVCache, tuple[float, float]]]:
        """Per layer: its index, weights, window, rotary table, cache and the cache's (k, v) scales."""
        per_layer = zip(self.layers, self.windows, self.cos_sin, kv_caches, self.kv_scales, strict=True)
        for i, (layer, window, cos_sin, kv_cache, scales) in enumerate(per_layer):
            yield i, layer, window, cos_sin, kv_cache, scales

    def _project(
        self, i: int, group: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``linear(x, weight, bias)`` plus the LoRA updates of layer ``i``'s projection ``group``."""
        out = self.linear(x, weight, bias)
        return out if self.lora is None else self.lora.add(i, group, x, out)

    def _attend(
        self,
        i: int,
        layer: Layer,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: KVCache,
        scales: tuple[float, float],
        meta: AttentionMetadata,
        window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
        alibi: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer ``i``'s attention over its cache (storing k and v), through its output projection
        ``o`` (and ``o_bias``, and LoRA's update): ``[T, hidden]``. ``chunk``: Llama 4's chunked
        local attention (a query sees only the keys of its own ``chunk``-position chunk); ``alibi``:
        fp32 [Hq] ALiBi slopes (Bloom, MPT)."""
        attn = self.attention.forward(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            *kv_cache,
            meta,
            self.scale,
            window,
            softcap,
            sinks,
            k_scale=scales[0],
            v_scale=scales[1],
            chunk=chunk,
            alibi=alibi,
        )
        return self._project(i, "o", attn.reshape(q.shape[0], self.q_size), layer["o"], layer.get("o_bias"))

    def _ungated(
        self, layer: Layer, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """An ungated MLP with biases, ``proj(act(fc(x)))`` (GPT-2, Bloom, the LayerNorm families): no
        LoRA (``dense_lora_layout`` lists none of its modules)."""
        linear = self.linear
        return linear(act(linear(x, layer["fc"], layer["fc_bias"])), layer["proj"], layer["proj_bias"])

    def _swiglu(self, i: int, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s SwiGLU MLP ``down(silu(gate(x)) * up(x))`` of its normed input, with LoRA."""
        act = self.ops.silu_and_mul(self._project(i, "gate_up", x, layer["gate_up"]))
        return self._project(i, "down", act, layer["down"])
