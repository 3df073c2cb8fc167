"""The pooling routes on the server in process, with a real engine on a tiny random
cross-encoder: rerank, score (both body spellings) and classify against transformers' logits,
the 400s for bad bodies and for routes of another job; and the flags that pick the job."""

from __future__ import annotations

import pytest
import torch

from kserve_paged.args import engine_kwargs, parse_args
from kserve_paged_engine.frontend.llm_engine import LLMEngine
from tests.helpers.server import NAME, build, client, run
from tests.helpers.tiny_models import save_cross_encoder

DOCS = ["the cat sat on the mat", "a dog ran fast", "the blue cats"]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("xenc")
    return path, save_cross_encoder(path)


def reference_scores(path, model, query: str) -> list[float]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with torch.inference_mode():
        return [float(torch.softmax(model(**tok(query, d, return_tensors="pt")).logits[0],
                                    0)[-1]) for d in DOCS]


def test_rerank_score_and_classify_equal_transformers(cross_encoder):
    path, ref = cross_encoder
    want = reference_scores(path, ref, "what is the cat")

    async def main() -> None:
        app, model = build(engine=LLMEngine(model=str(path), dtype="float32", device="cpu",
                                            max_num_batched_tokens=32))
        await model.start_engine()
        async with client(app) as c:
            for route in ("/openai/v1/rerank", "/v1/rerank", "/rerank"):
                r = await c.post(route, json={"query": "what is the cat", "documents": DOCS,
                                              "top_n": 2, "return_documents": False})
                assert r.status_code == 200, r.text
                results = r.json()["results"]
                best = sorted(range(3), key=lambda i: -want[i])[:2]
                assert [x["index"] for x in results] == best and "document" not in results[0]
                for x in results:
                    assert abs(x["relevance_score"] - want[x["index"]]) < 1e-4
            for body in ({"queries": "what is the cat", "documents": DOCS},
                         {"text_1": "what is the cat", "text_2": DOCS}):
                r = await c.post("/v1/score", json=body)
                got = [d["score"] for d in r.json()["data"]]
                assert r.status_code == 200 and max(abs(a - b) for a, b in zip(got, want)) < 1e-4
            r = await c.post("/classify", json={"input": ["the cat", "a dog ran"]})
            data = r.json()["data"]
            assert r.status_code == 200 and len(data) == 2 and data[0]["num_classes"] == 3
            assert abs(sum(data[0]["probs"]) - 1) < 1e-5 and data[0]["label"].startswith("LABEL_")
            for route, body, why in (
                    ("/v1/score", {"text_1": ["a", "b"], "text_2": DOCS}, "as many as"),
                    ("/v1/score", {"text_1": "a"}, "give text_1 and text_2"),
                    ("/rerank", {"query": "a", "documents": []}, "documents"),
                    ("/rerank", {"query": "a", "documents": DOCS, "top_n": 0}, "top_n"),
                    ("/v1/embeddings", {"input": "the cat"}, "'classify'"),
                    ("/v1/completions", {"prompt": "the cat", "max_tokens": 2}, "'classify'")):
                r = await c.post(route, json=body)
                assert r.status_code == 400 and why in r.json()["error"]["message"], (route, r.text)
            assert model.llm.engine.kv.num_free_blocks == model.llm.engine.num_kv_blocks
            await v2_logits_and_metrics(c, model, path, ref)
        model.stop_engine()
    run(main())


async def v2_logits_and_metrics(c, model, path, ref) -> None:
    """v2: an FP32 `logits` tensor [N, num_labels] equal to transformers'; a generation
    parameter is a 400. Pooling requests count under vLLM's metric names, finished "stop"."""
    from prometheus_client import generate_latest
    from transformers import AutoTokenizer

    texts = ["the cat sat", "a red dog"]
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": texts}]}
    r = await c.post(f"/v2/models/{NAME}/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert (out["name"], out["datatype"], out["shape"]) == ("logits", "FP32", [2, 3])
    tok = AutoTokenizer.from_pretrained(path)
    with torch.inference_mode():
        want = ref(**tok(texts, return_tensors="pt", padding=True)).logits
    torch.testing.assert_close(torch.tensor(out["data"]).view(2, 3), want, atol=1e-4, rtol=1e-4)
    r = await c.post(f"/v2/models/{NAME}/infer", json={**body, "parameters": {"max_tokens": 3}})
    assert r.status_code == 400 and "max_tokens" in r.text
    text = generate_latest(model.test_registry).decode()
    # 3 routes x 3 documents + 2 x 3 scores + 2 classified + 2 through v2
    assert f'vllm:request_success_total{{finished_reason="stop",model_name="{NAME}"}} 19.0' \
        in text, text
    assert f'vllm:request_prompt_tokens_count{{model_name="{NAME}"}} 19.0' in text


@pytest.mark.parametrize("argv,runner,convert", [
    (["--task", "text_embedding"], "pooling", "embed"),
    (["--task", "sequence_classification"], "pooling", "classify"),
    (["--runner", "pooling", "--convert", "classify"], "pooling", "classify"),
    (["--runner", "generate"], "generate", "auto"),
    ([], "auto", "auto")])
def test_job_flags_vllm_and_kserve_spellings(argv, runner, convert):
    kwargs = engine_kwargs(parse_args(argv))
    assert (kwargs["runner"], kwargs["convert"]) == (runner, convert)


def test_model_id_serves_minilm_and_an_unknown_job_flag_is_refused(capsys):
    assert parse_args(["--model_id", "all-minilm-l6-v2"]).model_id == "all-minilm-l6-v2"
    with pytest.raises(SystemExit):
        parse_args(["--convert", "rerank"])
    assert "invalid choice" in capsys.readouterr().err
