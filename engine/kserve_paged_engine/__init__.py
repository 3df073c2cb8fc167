"""kserve-paged's serving engine: paged KV cache, token-budget scheduler, model runner.

The names below are imported on first use, so `import kserve_paged_engine.worker.cpu_memory` (which entry points
run before anything heavy, to re-execute with tcmalloc) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "AsyncLLM": "kserve_paged_engine.frontend.async_llm",
    "EngineConfig": "kserve_paged_engine.config.engine",
    "LLM": "kserve_paged_engine.frontend.llm",
    "LLMEngine": "kserve_paged_engine.frontend.llm_engine",
    "LoRARequest": "kserve_paged_engine.lora.request",
    "CompletionOutput": "kserve_paged_engine.outputs",
    "RequestOutput": "kserve_paged_engine.outputs",
    "SamplingParams": "kserve_paged_engine.sampling_params",
}

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "EngineConfig", "LLMEngine", "LoRARequest",
           "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from kserve_paged_engine.config.engine import EngineConfig
    from kserve_paged_engine.frontend.async_llm import AsyncLLM
    from kserve_paged_engine.frontend.llm import LLM
    from kserve_paged_engine.frontend.llm_engine import LLMEngine
    from kserve_paged_engine.lora.request import LoRARequest
    from kserve_paged_engine.outputs import CompletionOutput, RequestOutput
    from kserve_paged_engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'kserve_paged_engine' has no attribute {name!r}")
