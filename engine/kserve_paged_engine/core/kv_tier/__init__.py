"""The second KV tier: prefix blocks evicted from the pool kept on local disk (disk.py) or in
host memory (host.py), their eviction policy, and swap. The KV-cache manager sees one
interface, `TierLink` (link.py)."""
