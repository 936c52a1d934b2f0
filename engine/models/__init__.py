"""Model architectures (``registry.py`` maps config.json ``architectures`` to a class) and loading."""
