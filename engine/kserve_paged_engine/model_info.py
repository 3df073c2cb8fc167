"""ModelInfo: what a front end may know of a loaded engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Static facts of a loaded engine, built once when it is ready.

    Why: the server reads these instead of reaching into engine attributes, so an engine (or a
    test's fake) promises exactly this and the front end depends on nothing else."""

    model_path: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int | None  # None: unknown (token ids are then checked by the engine alone)
    block_size: int
    num_kv_blocks: int
    has_chat_template: bool  # whether chat requests can be rendered to a prompt
    job: str = "generate"  # the model's one job (engine/kserve_paged_engine/model_executor/model_job.py): generate, embed, classify
    labels: tuple[str, ...] = ()  # a classifier's label names, by logit index
