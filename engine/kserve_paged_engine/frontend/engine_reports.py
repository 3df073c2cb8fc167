"""What an `LLMEngine` tells a server once and its adapters' loads: its facts (`model_info`),
and LoRA adapters added, removed and listed between steps. Kept apart from llm_engine.py, whose
job is the step (and the stats the metrics read after each one): these read the engine's parts,
they never take part in a step.
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
    lora: Any
    max_model_len: int
    model: Any
    model_path: str
    num_kv_blocks: int
    scheduler: Any
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
