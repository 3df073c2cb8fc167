"""Which one job a served model has (generate, embed, classify), from vLLM's `runner`/`convert`
options or, left on auto, from the checkpoint, and the pooling a pooling model gets."""

from __future__ import annotations

from pathlib import Path

from kserve_paged_engine.model_executor.models.architectures import (
    BERT_FAMILY as ENCODER_ARCHITECTURES,
)
from kserve_paged_engine.model_executor.pooler import PoolerConfig, read_pooler_config


def _classifies(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def resolve_job(runner: str, convert: str, architecture: str, folder: str | Path) -> str:
    """The model's job; ValueError when the options ask for what the checkpoint cannot do."""
    encoder, classifier = architecture in ENCODER_ARCHITECTURES, _classifies(architecture)
    if runner == "generate" or (runner == "auto" and convert in ("auto", "none")):
        if runner == "generate" and (encoder or classifier):
            raise ValueError(f"{architecture} cannot generate text: serve it with runner "
                             "'pooling'")
        if runner == "generate" or not (encoder or classifier
                                        or (Path(folder) / "modules.json").is_file()):
            if convert not in ("auto", "none"):
                raise ValueError(f"convert {convert!r} needs runner 'pooling'")
            return "generate"
        return "classify" if classifier else "embed"
    if convert == "classify" and not classifier:
        raise ValueError(f"convert 'classify' needs a checkpoint with a classification head "
                         f"(*ForSequenceClassification); {architecture} has none")
    if convert in ("auto", "none"):
        return "classify" if classifier else "embed"
    return convert


def pooler_config(job: str, architecture: str, folder: str | Path) -> PoolerConfig:
    """How a pooling model pools: the folder's sentence-transformers config if it has one,
    else CLS for encoders and the last token for decoders (vLLM's defaults), normalised for
    embeddings."""
    kind = "cls" if architecture in ENCODER_ARCHITECTURES else "last"
    return read_pooler_config(folder, PoolerConfig(kind, normalize=job == "embed"))
