"""Model code for the paged engine, keyed by the `architectures` name in a HF config."""

from __future__ import annotations

from kserve_paged_engine.model_executor.models.architectures import (
    BERT_FAMILY,
    DECODER_CLASSIFIERS,
    DEEPSEEK_FAMILY,
    GEMMA_FAMILY,
    GPT_OSS_FAMILY,
    LLAMA_FAMILY,
    MOE_FAMILY,
    SUPPORTED_ARCHITECTURES,
    architecture_of,
)
from kserve_paged_engine.model_executor.models.bert import BertEncoder
from kserve_paged_engine.model_executor.models.deepseek import DeepseekV3ForCausalLM
from kserve_paged_engine.model_executor.models.gemma import GemmaForCausalLM
from kserve_paged_engine.model_executor.models.gpt_oss import GptOssForCausalLM
from kserve_paged_engine.model_executor.models.llama import LlamaForCausalLM
from kserve_paged_engine.model_executor.models.moe import MoEForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM] | type[BertEncoder]] = {
    **{arch: LlamaForCausalLM for arch in LLAMA_FAMILY + DECODER_CLASSIFIERS},
    **{arch: GemmaForCausalLM for arch in GEMMA_FAMILY},
    **{arch: MoEForCausalLM for arch in MOE_FAMILY},
    **{arch: BertEncoder for arch in BERT_FAMILY},
    **{arch: DeepseekV3ForCausalLM for arch in DEEPSEEK_FAMILY},
    **{arch: GptOssForCausalLM for arch in GPT_OSS_FAMILY},
}

__all__ = ["MODEL_REGISTRY", "SUPPORTED_ARCHITECTURES", "GemmaForCausalLM", "LlamaForCausalLM",
           "MoEForCausalLM", "architecture_of"]
