"""ferry's KV tier: content-addressed KV blocks shared by every replica.

* ``keys`` — block identity: chained block hashes, tier keys, the model fingerprint.
* ``tier`` — the ``Tier`` interface and ``open_tier(url)``; backends by URL scheme:
  ``memory_tier`` (``memory://``), ``redis_tier`` (``redis://``, ``rediss://``, with an optional
  memory L1 via ``composite_tier``); ``breaker`` isolates failures; ``metrics`` holds the
  ``ferry:kv_tier_*`` Prometheus series.
* ``events`` — block stored/removed events on a Redis stream, and a reader for routers.
* ``codec`` — the byte format of a stored block; ``connector`` / ``writer`` — the engine-side
  ``KVConnector`` (torch); ``engine_adapter`` — its binding to the engine's hooks.

This package's ``__init__`` and every module except ``codec``, ``connector``, ``writer`` and
``engine_adapter`` are torch-free, so the router can use keys, tiers and events.
"""
