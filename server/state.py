"""What every endpoint of one replica shares: the engine, its tokenizer and limits, admission, metrics,
stored responses and the background ones running here, the Batch API's store and runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.tokenizer import Tokenizer
from server.batch_jobs import BatchJobs
from server.batch_store import BatchStore
from server.config import ServerConfig
from server.errors import model_not_found
from server.generation import Generation
from server.lora_resolver import LoRAResolver
from server.metrics import ServerMetrics
from server.params import ModelLimits
from server.reasoning_parsers import REASONING_PARSERS, ReasoningSplitter
from server.responses_background import BackgroundResponses
from server.responses_store import ResponseStore
from server.tool_parser_base import ToolParser
from server.tool_parsers import get_tool_parser


@dataclass
class ServerState:
    engine: Any  # engine.AsyncEngine (typed loosely: this module must not import torch)
    config: ServerConfig
    tokenizer: Tokenizer
    limits: ModelLimits
    block_size: int
    generation: Generation
    metrics: ServerMetrics
    tool_parser: ToolParser | None = None  # tool_choice "auto" (--enable-auto-tool-choice)

    reasoning: type[ReasoningSplitter] | None = None  # --reasoning-parser
    responses: ResponseStore | None = None  # stored /v1/responses (--responses-store)
    background: BackgroundResponses = field(init=False)  # background responses running here
    batches: BatchJobs = field(init=False)  # the Batch API's files and the batches running here
    # Adapters loaded on first use from --lora-resolver-dir (server/lora_resolver.py), None without it
    lora_resolver: LoRAResolver | None = field(init=False)

    def __post_init__(self) -> None:
        self.background = BackgroundResponses(
            self.responses, self.generation, self.metrics, self.config.responses_lease_ttl
        )
        directory = self.config.lora_resolver_dir
        self.lora_resolver = LoRAResolver(directory) if directory else None
        self.batches = BatchJobs(BatchStore(self.config.batch_dir), self.config.max_batch_concurrency)
        if self.tool_parser is None and self.config.enable_auto_tool_choice and self.config.tool_call_parser:
            self.tool_parser = get_tool_parser(self.config.tool_call_parser)
        if self.reasoning is None and self.config.reasoning_parser:
            self.reasoning = REASONING_PARSERS[self.config.reasoning_parser]
        # Structured outputs wait for the end of thinking when it is one token (as vLLM's do).
        reasoning = self.reasoning
        end = (
            self.tokenizer.encode(reasoning.ENDS[0], add_special_tokens=False)
            if reasoning is not None
            else []
        )
        self.reasoning_end_id: int | None = end[0] if len(end) == 1 else None

    def new_reasoning_splitter(self, requires_start: bool | None = None) -> ReasoningSplitter | None:
        return self.reasoning(requires_start) if self.reasoning is not None else None

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    def check_model(self, model: str | None) -> Any:
        """Requests may omit ``model``; a named model must be the one served here or one of its
        LoRA adapters (else 404). Returns the adapter (``ServedLoRA``), or None for the base model."""
        if model is None or model == self.config.served_model_name or model in self.config.model_aliases:
            return None
        served = self.served_loras.get(model)
        if served is None:
            raise model_not_found(model)
        return served

    async def resolve_model(self, model: str | None) -> None:
        """Before ``check_model``: a name not served here is loaded from the LoRA resolver's
        directory when it holds that adapter (``server/lora_resolver.py``; APIError 400 for an entry
        that cannot run or a name that leaves the directory). Without a resolver, or for a name it
        does not find, nothing changes: ``check_model`` answers it."""
        if (
            self.lora_resolver is None
            or model is None
            or model == self.config.served_model_name
            or model in self.config.model_aliases
            or model in self.served_loras
        ):
            return
        await self.lora_resolver.resolve(self.engine, model, lambda: self.served_loras)

    @property
    def served_loras(self) -> dict[str, Any]:
        """The LoRA adapters served by name (``AsyncEngine.served_loras``; none without ``--enable-lora``)."""
        return getattr(self.engine, "served_loras", None) or {}

    def answer_model(self, lora: Any) -> str:
        """The ``model`` an answer carries: the adapter's name, or the served model name."""
        return lora.name if lora is not None else self.config.served_model_name
