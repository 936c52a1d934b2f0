"""ferry's KV tier: content-addressed KV blocks shared by every replica.

`keys` (block identity) imports no torch, so the router can use it.
"""
