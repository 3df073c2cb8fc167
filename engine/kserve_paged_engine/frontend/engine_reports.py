"""What an `LLMEngine` reports and its adapters' loads: its facts for a server (`model_info`),
its stats (the metrics read them after every step), and LoRA adapters added and removed
between steps. Kept apart from llm_engine.py, whose job is the step: these read the engine's
parts, they never take part in a step.
"""

from __future__ import annotations

from typing import Any

from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.model_info import ModelInfo


class EngineReports:
    """Mixed into `LLMEngine` (engine/kserve_paged_engine/frontend/llm_engine.py), whose
    attributes it reads."""

    config: Any
    hf_config: Any
    job: str
    kv_tier: Any
    lora: Any
    max_model_len: int
    model: Any
    model_path: str
    num_kv_blocks: int
    prompt_tokens: int
    generation_tokens: int
    last_step_tokens: int
    scheduler: Any
    spec: Any
    tokenizer: Any

    def model_info(self) -> ModelInfo:
        """What a server may know of this engine (AsyncLLM.model_info hands it on)."""
        return ModelInfo(model_path=self.model_path, tokenizer=self.tokenizer,
                         max_model_len=self.max_model_len, vocab_size=self.model.vocab_size,
                         block_size=self.config.block_size, num_kv_blocks=self.num_kv_blocks,
                         has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
                         job=self.job, labels=self._labels())

    def _labels(self) -> tuple[str, ...]:
        if self.job != "classify":
            return ()
        names = getattr(self.hf_config, "id2label", None) or {}
        return tuple(str(names.get(i, f"LABEL_{i}")) for i in range(self.hf_config.num_labels))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (ValueError if it is bad or LoRA is off)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (enable_lora=True)")
        self.lora.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.lora.loaded_ids() if self.lora is not None else []

    def lora_stats(self) -> dict[str, Any]:
        """vLLM's lora_requests_info labels: adapters of running and waiting requests."""
        def names(requests) -> str:
            return ",".join(sorted({r.lora_request.lora_name for r in requests
                                    if r.lora_request is not None}))
        return {"running_lora_adapters": names(self.scheduler.running),
                "waiting_lora_adapters": names(self.scheduler.waiting),
                "max_lora": self.config.max_loras if self.lora is not None else 0}

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        s.update(prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
                 last_step_tokens=self.last_step_tokens,
                 block_size=self.config.block_size, num_kv_blocks=self.num_kv_blocks)
        if self.lora is not None:
            s.update(self.lora_stats())
        if self.spec is not None:
            s.update(self.spec.stats())
        if self.kv_tier is not None:
            s.update(self.kv_tier.stat_dict())
        return s
