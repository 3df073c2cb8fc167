"""Model code for the paged engine, keyed by the `architectures` name in a HF config."""

from __future__ import annotations

from engine.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, architecture_of

# Every supported architecture shares the Llama code path (biases and windows come from config).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES
}

__all__ = ["MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "architecture_of"]
