"""The engine's core: the scheduler and its waiting queue, requests, the KV-cache manager and
block pool, prefix-cache keys, KV groups, KV sizing and KV-cache events. It imports nothing of
the worker, the front or speculation (tests/test_import_layers.py)."""
