"""Pooling requests through the engine (embeddings of a tiny random decoder) against
transformers' hidden states: last token, mean and CLS pooling, chunked prefill, Matryoshka
dimensions, normalisation, blocks freed, and the one-job rule."""

from __future__ import annotations

import json

import pytest
import torch

from kserve_paged_engine import LLM, SamplingParams
from kserve_paged_engine.model_executor.model_job import resolve_job
from kserve_paged_engine.model_executor.pooler import PoolerConfig, read_pooler_config
from kserve_paged_engine.pooling_params import PoolingParams, WrongJobError
from tests.helpers.tiny_models import CONFIGS, VOCAB, save_checkpoint, save_tokenizer

# Lengths 3..40 with a 16-token budget: the long ones are computed over several steps.
PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(n)]
           for i, n in enumerate([3, 9, 17, 40, 1, 23])]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, ref = save_checkpoint(CONFIGS["qwen3_qk_norm"], tmp_path_factory.mktemp("embed"))
    save_tokenizer(path)
    return path, ref


def reference_hidden(ref, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref.model(torch.tensor([ids])).last_hidden_state[0].float()


def make_llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=64,
               max_num_batched_tokens=16, max_model_len=64, **kw)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def test_last_token_embeddings_equal_transformers_and_free_their_blocks(checkpoint):
    path, ref = checkpoint
    llm = make_llm(path, runner="pooling")
    assert llm.engine.job == "embed"
    outs = llm.embed(PROMPTS)
    for ids, out in zip(PROMPTS, outs):
        want = torch.nn.functional.normalize(reference_hidden(ref, ids)[-1], dim=0)
        assert out.finished and out.pooled.shape == want.shape
        assert torch.allclose(out.pooled, want, atol=1e-4), ids
        assert abs(float(out.pooled.norm()) - 1.0) < 1e-5
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    assert not llm.engine.pooling.pools


def test_dimensions_cut_then_normalise_and_normalize_false_is_raw(checkpoint):
    path, ref = checkpoint
    llm = make_llm(path, runner="pooling", convert="embed")
    ids = PROMPTS[3]
    last = reference_hidden(ref, ids)[-1]
    cut = llm.embed([ids], PoolingParams(dimensions=8))[0].pooled
    assert cut.shape == (8,)
    assert torch.allclose(cut, torch.nn.functional.normalize(last[:8], dim=0), atol=1e-4)
    raw = llm.embed([ids], PoolingParams(normalize=False))[0].pooled
    assert torch.allclose(raw, last, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="exceeds the model's embedding size"):
        llm.embed([ids], PoolingParams(dimensions=65))


@pytest.mark.parametrize("mode,kind", [("pooling_mode_mean_tokens", "mean"),
                                       ("pooling_mode_cls_token", "cls")])
def test_sentence_transformers_pooling_from_the_folder(checkpoint, tmp_path, mode, kind):
    """modules.json + 1_Pooling/config.json as sentence-transformers writes them: the job is
    embed on auto, the pool is over every chunk of a prompt."""
    path, ref = checkpoint
    folder = tmp_path / "st"
    folder.mkdir()
    for f in path.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, mode: True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    llm = make_llm(folder)
    assert llm.engine.job == "embed" and llm.engine.pooling.config == PoolerConfig(kind, False)
    for ids, out in zip(PROMPTS, llm.embed(PROMPTS)):
        hidden = reference_hidden(ref, ids)
        want = hidden.mean(0) if kind == "mean" else hidden[0]
        assert cosine(out.pooled, want) >= 0.9999
        assert torch.allclose(out.pooled, want, atol=1e-3, rtol=1e-4)


def test_a_request_of_another_job_is_a_typed_error(checkpoint):
    path, _ = checkpoint
    embedder = make_llm(path, runner="pooling")
    with pytest.raises(WrongJobError, match="'embed'") as err:
        embedder.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    assert err.value.model_job == "embed" and err.value.asked == "generate"
    with pytest.raises(WrongJobError, match="'embed'"):
        embedder.classify([PROMPTS[0]])
    generator = make_llm(path)
    assert generator.engine.job == "generate"
    with pytest.raises(WrongJobError, match="'generate'"):
        generator.embed([PROMPTS[0]])
    assert not generator.engine.has_unfinished_requests()


def test_resolve_job_follows_vllm_runner_and_convert(tmp_path):
    assert resolve_job("auto", "auto", "LlamaForCausalLM", tmp_path) == "generate"
    assert resolve_job("pooling", "auto", "LlamaForCausalLM", tmp_path) == "embed"
    assert resolve_job("auto", "embed", "Qwen3ForCausalLM", tmp_path) == "embed"
    assert resolve_job("auto", "auto", "BertModel", tmp_path) == "embed"
    assert resolve_job("auto", "auto", "BertForSequenceClassification", tmp_path) == "classify"
    with pytest.raises(ValueError, match="cannot generate"):
        resolve_job("generate", "auto", "BertModel", tmp_path)
    with pytest.raises(ValueError, match="classification head"):
        resolve_job("pooling", "classify", "LlamaForCausalLM", tmp_path)
    (tmp_path / "modules.json").write_text("[]")
    assert resolve_job("auto", "auto", "LlamaForCausalLM", tmp_path) == "embed"


def test_unsupported_sentence_transformers_pooling_is_refused(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "p", "type": "sentence_transformers.models.Pooling"},
        {"path": "n", "type": "sentence_transformers.models.Normalize"}]))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_pooler_config(tmp_path, PoolerConfig("last", False))


@pytest.mark.parametrize("kwargs,match", [({"task": "generate"}, "pooling task"),
                                          ({"dimensions": 0}, "positive integer"),
                                          ({"task": "classify", "dimensions": 4}, "embeddings")])
def test_bad_pooling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)
