"""Model code for the paged engine, keyed by the `architectures` name in a HF config."""

from __future__ import annotations

from kserve_paged_engine.model_executor.models.architectures import (
    BERT_FAMILY,
    DECODER_CLASSIFIERS,
    GEMMA_FAMILY,
    LLAMA_FAMILY,
    MOE_FAMILY,
    SUPPORTED_ARCHITECTURES,
    architecture_of,
)
from kserve_paged_engine.model_executor.models.bert import BertEncoder
from kserve_paged_engine.model_executor.models.gemma import GemmaForCausalLM
from kserve_paged_engine.model_executor.models.llama import LlamaForCausalLM
from kserve_paged_engine.model_executor.models.moe import MoEForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM] | type[BertEncoder]] = {
    **{arch: LlamaForCausalLM for arch in LLAMA_FAMILY + DECODER_CLASSIFIERS},
    **{arch: GemmaForCausalLM for arch in GEMMA_FAMILY},
    **{arch: MoEForCausalLM for arch in MOE_FAMILY},
    **{arch: BertEncoder for arch in BERT_FAMILY},
}

__all__ = ["MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES", "GemmaForCausalLM", "LlamaForCausalLM",
           "MoEForCausalLM", "architecture_of"]
