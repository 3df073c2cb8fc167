"""Embeddings, rerank and score against a real server serving all-MiniLM-L6-v2 with one flag
(`--model_id all-minilm-l6-v2`): the openai client's embeddings.create (float and base64)
equal to sentence-transformers, a rerank call, and the two cross-kind 400s (a generation
request to the embedding model, an embedding request to the generation model)."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from kserve_paged_engine.frontend.packaged_folders import FOLDER_MODELS, ensure_folder_model
from tests.helpers.e2e_server import MODEL, Server, running_server

SENTENCES = ["A man is eating food.", "Paged attention keeps the KV cache in blocks.",
             "The weather is lovely today " * 8]


@pytest.fixture(scope="module")
def embedder() -> Iterator[Server]:
    with running_server(["--model_id", "all-minilm-l6-v2"], engine_opts={}) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    folder = str(ensure_folder_model("all-minilm-l6-v2"))
    return SentenceTransformer(folder, device="cpu").encode(SENTENCES)


def test_openai_client_embeddings_float_and_base64(embedder, reference):
    assert "all-minilm-l6-v2" in FOLDER_MODELS
    client = openai.OpenAI(base_url=f"{embedder.url}/openai/v1", api_key="none")
    # Unset: the client asks for base64 and decodes it itself; "base64": the caller decodes.
    for fmt in ("float", "base64", openai.NOT_GIVEN):
        resp = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format=fmt)
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                        if fmt == "base64" else d.embedding for d in resp.data],
                       dtype=np.float32)
        assert got.shape == (3, 384) and [d.index for d in resp.data] == [0, 1, 2]
        cos = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(
            reference, axis=1)
        assert (cos >= 0.9999).all(), (fmt, cos)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens > 20
    vllm = openai.OpenAI(base_url=f"{embedder.url}/v1", api_key="none")
    short = vllm.embeddings.create(model=MODEL, input="hello", dimensions=32)
    assert len(short.data[0].embedding) == 32
    assert abs(np.linalg.norm(short.data[0].embedding) - 1) < 1e-5


def test_v2_infer_answers_an_fp32_embedding_tensor(embedder, reference):
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [3],
                        "data": SENTENCES}], "parameters": {"dimensions": 384}}
    r = httpx.post(f"{embedder.url}/v2/models/{MODEL}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert (out["name"], out["datatype"], out["shape"]) == ("embedding", "FP32", [3, 384])
    got = np.array(out["data"], dtype=np.float32).reshape(3, 384)
    assert ((got * reference).sum(1) >= 0.9999).all()


def test_rerank_and_score_order_by_relevance(embedder):
    docs = ["Paris is the capital of France.", "Bananas are yellow.",
            "France's capital city is Paris."]
    for path in ("/openai/v1/rerank", "/v1/rerank", "/rerank"):
        r = httpx.post(embedder.url + path, json={"query": "What is the capital of France?",
                                                  "documents": docs, "top_n": 2}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 2 and {x["index"] for x in results} == {0, 2}, results
        assert results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert results[0]["document"]["text"] == docs[results[0]["index"]]
    r = httpx.post(embedder.url + "/v1/score", json={"text_1": "capital of France",
                                                     "text_2": docs}, timeout=60)
    scores = [d["score"] for d in r.json()["data"]]
    assert r.status_code == 200 and scores[1] < min(scores[0], scores[2])


def test_a_generation_request_to_the_embedding_model_is_a_400(embedder):
    r = httpx.post(embedder.url + "/openai/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "'embed'" in r.json()["error"]["message"], r.text
    r = httpx.post(embedder.url + "/classify", json={"input": "hi"}, timeout=60)
    assert r.status_code == 400 and "'embed'" in r.json()["error"]["message"], r.text


def test_an_embedding_request_to_the_generation_model_is_a_400(server):
    client = openai.OpenAI(base_url=f"{server.url}/openai/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="'generate'"):
        client.embeddings.create(model=MODEL, input="hello")
