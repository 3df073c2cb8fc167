"""The pooling routes: embeddings (OpenAI's shape), rerank (Jina/Cohere's), score and classify
(vLLM's), answered by a model whose job is to embed or classify (engine/kserve_paged_engine/model_executor/model_job.py).

A pair (query, document) is scored by the model's job: a classifier (cross-encoder) reads the
pair as one input, `[CLS] query [SEP] document [SEP]`, and scores it by its logit (sigmoid for
one label, else the softmax of the last label); an embedding model scores the cosine of the two
embeddings. Every input is tokenized and checked before any is queued; a request to a model of
another job is a 400 that names the model's job.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import torch
from fastapi.responses import JSONResponse

from kserve_paged.openai.errors import APIError
from kserve_paged.openai.pooling_schemas import ClassifyBody, EmbeddingBody, RerankBody, ScoreBody
from kserve_paged.request_options import OptionError
from kserve_paged.served import ServedModel
from kserve_paged_engine.frontend.async_llm import RequestStream
from kserve_paged_engine.pooling_params import PoolingParams
from kserve_paged_engine.sampling_params import SamplingParams

_PROMPT_ONLY = SamplingParams(max_tokens=0)


def require_job(model: ServedModel, jobs: tuple[str, ...], route: str) -> str:
    """The model's job, or a 400 naming it when `route` is not one of its routes."""
    job = model.info.job
    if job not in jobs:
        raise APIError(400, f"model {model.name!r} is a {job!r} model: {route} needs a "
                       f"{' or '.join(repr(j) for j in jobs)} model", param="model",
                       code="wrong_model_job")
    return job


async def _tokens(model: ServedModel, prompt: str | list[int], pair: str | None = None
                  ) -> list[int]:
    try:
        if pair is None:
            return await model.encode(prompt)
        model.check_prompt_chars(len(prompt) + len(pair))
        tok = model.info.tokenizer
        return list((await asyncio.to_thread(tok, prompt, pair))["input_ids"])
    except OptionError as exc:
        raise APIError(400, str(exc), param=exc.param or "input") from None


async def pool(model: ServedModel, prompts: list[list[int]], params: PoolingParams,
               deadline: float | None = None) -> list[torch.Tensor]:
    """Every prompt through the engine at once (all queued, then awaited), each aborted at the
    request's `deadline` (admission.py): their results. However this ends (a refused prompt, a
    failed one, a client gone: kserve_paged/middleware.py cancels it), no prompt of the
    request is left queued."""
    streams: list[RequestStream] = []
    try:
        for ids in prompts:
            try:
                streams.append(await model.submit(ids, _PROMPT_ONLY, kind="pool",
                                                  deadline=deadline, pooling_params=params))
            except ValueError as exc:
                raise APIError(400, str(exc), param="input") from None
        return [await _pooled(stream) for stream in streams]
    finally:
        for stream in streams:
            stream.close()  # a no-op for a finished one


async def _pooled(stream: RequestStream) -> torch.Tensor:
    last = None
    async for out in stream:
        last = out
    if last is None or last.error is not None or last.pooled is None:
        why = last.error if last is not None else "no output"
        raise APIError((last.error_status if last else None) or 500, str(why))
    return last.pooled


def _usage(prompts: list[list[int]]) -> dict[str, int]:
    n = sum(map(len, prompts))
    return {"prompt_tokens": n, "total_tokens": n}


def _encode_vector(vec: torch.Tensor, fmt: str) -> list[float] | str:
    if fmt == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(vec.float().numpy().astype("<f4").tobytes()).decode()
    return vec.float().tolist()


async def embeddings(model: ServedModel, body: EmbeddingBody, deadline: float | None = None
                     ) -> JSONResponse:
    require_job(model, ("embed",), "/embeddings")
    given = body.input
    if isinstance(given, str) or (isinstance(given, list) and given
                                  and isinstance(given[0], int)):
        given = [given]
    if not given:
        raise APIError(400, "input is empty", param="input")
    prompts = [await _tokens(model, p) for p in given]
    try:
        params = PoolingParams("embed", body.dimensions, body.normalize)
    except ValueError as exc:
        raise APIError(400, str(exc), param="dimensions") from None
    vectors = await pool(model, prompts, params, deadline)
    data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v,
                                                                            body.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": body.model or model.name,
                         "usage": _usage(prompts)})


async def score_pairs(model: ServedModel, pairs: list[tuple[str, str]], route: str,
                      deadline: float | None = None) -> tuple[list[float], list[list[int]]]:
    """A score per (query, document) pair, and the prompts it took (for usage)."""
    job = require_job(model, ("classify", "embed"), route)
    if job == "classify":
        prompts = [await _tokens(model, q, d) for q, d in pairs]
        logits = await pool(model, prompts, PoolingParams("classify"), deadline)
        return [float(torch.sigmoid(x[0]) if x.numel() == 1 else torch.softmax(x, 0)[-1])
                for x in logits], prompts
    texts = sorted({t for pair in pairs for t in pair})
    prompts = [await _tokens(model, t) for t in texts]
    vecs = dict(zip(texts, await pool(model, prompts, PoolingParams("embed"), deadline)))
    return [float(torch.nn.functional.cosine_similarity(vecs[q], vecs[d], dim=0))
            for q, d in pairs], prompts


async def rerank(model: ServedModel, body: RerankBody, deadline: float | None = None
                 ) -> JSONResponse:
    scores, prompts = await score_pairs(model, [(body.query, d) for d in body.documents],
                                        "/rerank", deadline)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or len(scores)]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": body.documents[i]}
        results.append(item)
    n = sum(map(len, prompts))
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or model.name,
                         "usage": {"total_tokens": n}, "results": results})


def _as_list(texts: str | list[str] | None) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts or [])


async def score(model: ServedModel, body: ScoreBody, deadline: float | None = None
                ) -> JSONResponse:
    new = body.queries is not None or body.documents is not None
    left = _as_list(body.queries if new else body.text_1)
    right = _as_list(body.documents if new else body.text_2)
    names = ("queries", "documents") if new else ("text_1", "text_2")
    if not left or not right:
        raise APIError(400, f"give {names[0]} and {names[1]}", param=names[0])
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise APIError(400, f"{names[0]} must be one text or as many as {names[1]} (got "
                       f"{len(left)} and {len(right)})", param=names[0])
    scores, prompts = await score_pairs(model, list(zip(left, right)), "/score", deadline)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list",
                         "created": int(time.time()), "model": body.model or model.name,
                         "data": data, "usage": _usage(prompts)})


async def classify(model: ServedModel, body: ClassifyBody, deadline: float | None = None
                   ) -> JSONResponse:
    require_job(model, ("classify",), "/classify")
    texts = _as_list(body.input)
    if not texts:
        raise APIError(400, "input is empty", param="input")
    prompts = [await _tokens(model, t) for t in texts]
    logits = await pool(model, prompts, PoolingParams("classify"), deadline)
    labels = model.info.labels
    data = []
    for i, x in enumerate(logits):
        probs = torch.softmax(x, 0)
        best = int(probs.argmax())
        data.append({"index": i, "label": labels[best] if best < len(labels) else str(best),
                     "probs": probs.tolist(), "num_classes": int(x.numel())})
    return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                         "created": int(time.time()), "model": body.model or model.name,
                         "data": data, "usage": _usage(prompts)})
