"""The activations of ferry's ungated MLPs (GPT-2, OPT, GPT-NeoX, Phi, GPT-J, Falcon, StarCoder2,
Nemotron…), by transformers' ``ACT2FN`` names, each computed in transformers' own order of operations
so fp32 results match it to the bit."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig

Activation = Callable[[torch.Tensor], torch.Tensor]


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_new`` (OpenAI GPT's tanh GELU), in its own order of operations."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


ACTIVATIONS: dict[str, Activation] = {
    "gelu": F.gelu,
    "gelu_new": gelu_new,
    "gelu_fast": gelu_fast,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "silu": F.silu,
}


def activation(cfg: ModelConfig) -> Activation:
    """The config's ``hidden_act``; a ValueError naming it and the served ones when ferry has none."""
    if cfg.hidden_act not in ACTIVATIONS:
        served = ", ".join(sorted(ACTIVATIONS))
        raise ValueError(f"{cfg.architecture} with hidden_act {cfg.hidden_act!r} is not supported ({served})")
    return ACTIVATIONS[cfg.hidden_act]
