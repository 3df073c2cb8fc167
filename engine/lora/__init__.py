"""Multi-LoRA serving: PEFT adapters over the engine's fused projections, many in one batch."""

from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.manager import LoRAManager
from engine.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAManager", "LoRARequest", "load_adapter"]
