"""The v2 protocol for a pooling model: ``text_input`` BYTES [N] -> an FP32 tensor,
``embedding`` [N, dimensions] (an embedding model) or ``logits`` [N, num_labels] (a
classifier). Parameters: ``dimensions`` and ``normalize`` (embeddings); any other option is a
400 naming it, as is bad input, before anything is queued."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import torch
from kserve.errors import InferenceError, InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse

from kserve_paged.openai.errors import APIError
from kserve_paged.openai.pooling import pool
from kserve_paged.request_options import OptionError
from kserve_paged.served import ServedModel
from kserve_paged_engine.pooling_params import PoolingParams

OUTPUT_NAMES = {"embed": "embedding", "classify": "logits"}
_OPTIONS = frozenset({"dimensions", "normalize"})


def pooling_params(job: str, options: dict[str, Any], ignored: frozenset[str]
                   ) -> PoolingParams:
    """The request's PoolingParams; InvalidInput for an option a pooling model does not take."""
    unknown = sorted(set(options) - _OPTIONS - ignored)
    if unknown:
        raise InvalidInput(f"parameter(s) {unknown} do not apply to this {job!r} model "
                           f"(it takes {sorted(_OPTIONS)})")
    dims, normalize = options.get("dimensions"), options.get("normalize")
    try:
        if isinstance(dims, str) and dims.strip().isdigit():
            dims = int(dims)
        if isinstance(normalize, str) and normalize in ("true", "false"):
            normalize = normalize == "true"
        if job == "classify" and (dims is not None or normalize is not None):
            raise ValueError("dimensions and normalize apply to embeddings only")
        return PoolingParams(job, dims, normalize)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(str(exc)) from None


async def predict_pooled(model: ServedModel, payload: InferRequest, texts: list[str],
                         options: dict[str, Any], ignored: frozenset[str],
                         deadline: float | None = None) -> InferResponse:
    job = model.info.job
    params = pooling_params(job, options, ignored)
    try:
        prompts = [await model.encode(t) for t in texts]
        vectors = await pool(model, prompts, params, deadline) if prompts else []
    except OptionError as exc:
        raise InvalidInput(str(exc)) from None
    except APIError as exc:
        raise (InvalidInput if exc.status == 400 else InferenceError)(exc.message) from None
    data = (torch.stack(vectors).numpy() if vectors
            else np.zeros((0, 0), dtype=np.float32)).astype(np.float32)
    output = InferOutput(name=OUTPUT_NAMES[job], shape=list(data.shape), datatype="FP32")
    output.set_data_from_numpy(data, binary_data=False)
    return InferResponse(response_id=payload.id or str(uuid.uuid4()), model_name=model.name,
                         infer_outputs=[output], from_grpc=payload.from_grpc,
                         use_binary_outputs=payload.use_binary_outputs,
                         requested_outputs=payload.request_outputs)
