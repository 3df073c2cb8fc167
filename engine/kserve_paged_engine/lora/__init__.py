"""Multi-LoRA serving: PEFT adapters over the engine's fused projections, many in one batch."""

from kserve_paged_engine.lora.adapter import LoRAAdapter, load_adapter
from kserve_paged_engine.lora.manager import LoRAManager
from kserve_paged_engine.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAManager", "LoRARequest", "load_adapter"]
