"""kserve-paged's serving engine: paged KV cache, token-budget scheduler, model runner."""
