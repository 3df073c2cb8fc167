"""The engine's options, at the bottom: EngineConfig and the option groups it holds (scheduler,
speculative decoding, KV tier, KV-cache events, quantization methods). Plain values and their
checks only, so every layer may read them and the server's flags take them before torch loads."""

from kserve_paged_engine.config.engine import EngineConfig

__all__ = ["EngineConfig"]
