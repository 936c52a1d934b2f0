"""Attention backends: one interface (``base.py``), chosen by name through ``registry.py``."""

from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.registry import get_attention_backend, resolve_backend_name

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend", "resolve_backend_name"]
