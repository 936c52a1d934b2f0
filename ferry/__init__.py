"""ferry: OpenAI-compatible LLM serving. This package holds only the `ferry` command and the version."""

__version__ = "0.1.0"
