"""Which checkpoints the engine serves, named as transformers names them (no torch import, so
a config can be checked before anything heavy loads)."""

from __future__ import annotations

from typing import Any

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                "Phi3ForCausalLM")
GEMMA_FAMILY = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_FAMILY = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
# Multi-head latent attention over a paged latent cache (models/deepseek.py).
DEEPSEEK_FAMILY = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
# Attention sinks, alternating windows, biased clamped-SwiGLU experts (models/gpt_oss.py).
GPT_OSS_FAMILY = ("GptOssForCausalLM",)
# Llama-family decoders with a `score` head over the last token (sequence classifiers and
# rerankers): pooling models only, the decoder of their `...ForCausalLM`.
DECODER_CLASSIFIERS = ("LlamaForSequenceClassification", "MistralForSequenceClassification",
                       "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")
# Encoders: pooling models only (embeddings, cross-encoder classification).
BERT_FAMILY = ("BertModel", "BertForSequenceClassification")
SUPPORTED_ARCHITECTURES = (LLAMA_FAMILY + DECODER_CLASSIFIERS + GEMMA_FAMILY + MOE_FAMILY
                           + BERT_FAMILY + DEEPSEEK_FAMILY + GPT_OSS_FAMILY)

# config.json without `architectures` (GGUF-derived configs): model_type -> architecture.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "bert": "BertModel",
                  "deepseek_v3": "DeepseekV3ForCausalLM",
                  "deepseek_v2": "DeepseekV2ForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def architecture_of(config: Any) -> str:
    """The config's supported architecture name, or ValueError naming the supported ones."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        model_type = getattr(config, "model_type", None)
        archs = [_BY_MODEL_TYPE[model_type]] if model_type in _BY_MODEL_TYPE else []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported model architecture {archs or getattr(config, 'model_type', None)}"
                     f"; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def decoder_of(architecture: str) -> str:
    """The causal LM whose decoder a sequence classifier has (`Qwen3ForSequenceClassification`
    -> `Qwen3ForCausalLM`); any other name unchanged."""
    if architecture in DECODER_CLASSIFIERS:
        return architecture.removesuffix("ForSequenceClassification") + "ForCausalLM"
    return architecture
