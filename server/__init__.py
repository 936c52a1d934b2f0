"""ferry's OpenAI API server for one replica (FastAPI over engine.AsyncEngine)."""
