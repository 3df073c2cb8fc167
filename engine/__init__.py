"""kserve-paged's serving engine: paged KV cache, token-budget scheduler, model runner.

The names below are imported on first use, so `import engine.worker.cpu_memory` (which entry points
run before anything heavy, to re-execute with tcmalloc) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "EngineConfig": "engine.config",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "LoRARequest": "engine.lora.request",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "LoRARequest",
           "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.lora.request import LoRARequest
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
