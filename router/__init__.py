"""ferry's router: one OpenAI endpoint over many replicas. Never imports torch."""
