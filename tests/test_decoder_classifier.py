"""Decoder sequence classifiers (Llama/Qwen `...ForSequenceClassification`: the decoder, then a
`score` head over the last token) through the engine against transformers' logits, on tiny
random configs, with prompts long enough to be computed over several steps."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_engine import LLM
from tests.helpers.tiny_models import CONFIGS, VOCAB, save_decoder_classifier

PROMPTS = [[(5 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(n)]
           for i, n in enumerate([1, 6, 19, 37])]


@pytest.mark.parametrize("family", ["qwen3_qk_norm", "llama_gqa_llama3", "qwen2_tied"])
def test_classifier_logits_equal_transformers(tmp_path, family):
    ref = save_decoder_classifier(CONFIGS[family], tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64,
              max_num_batched_tokens=16, max_model_len=64)
    assert llm.engine.job == "classify" and llm.engine.pooling.config.kind == "last"
    assert llm.engine.model.lm_head is None  # no vocabulary-sized head is kept
    outs = llm.classify(PROMPTS)
    with torch.inference_mode():
        for ids, out in zip(PROMPTS, outs):
            want = ref(input_ids=torch.tensor([ids])).logits[0].float()
            assert out.pooled.shape == (3,)
            torch.testing.assert_close(out.pooled, want, atol=1e-4, rtol=1e-4)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    with pytest.raises(ValueError, match="'classify'"):
        llm.embed([PROMPTS[1]])


def test_a_classifier_cannot_be_served_to_generate(tmp_path):
    save_decoder_classifier(CONFIGS["qwen3_qk_norm"], tmp_path)
    with pytest.raises(ValueError, match="cannot generate text"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16,
            max_model_len=32, runner="generate")


def test_start_up_dummy_steps_run_on_a_decoder_classifier(tmp_path):
    """The CUDA warm-up and the profile run's dummy steps (run here on CPU) skip the LM head a
    pooling model does not have, instead of failing at start-up."""
    from kserve_paged_engine.worker.profile_run import largest_step
    from kserve_paged_engine.worker.warmup import warm_up

    save_decoder_classifier(CONFIGS["qwen3_qk_norm"], tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=64,
              max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32)
    runner = llm.engine.runner
    warm_up(runner.model, runner.kv_caches, runner.max_blocks_per_seq, runner.device, "cpu",
            max_num_batched_tokens=16, max_num_seqs=4, max_model_len=32)
    largest_step(runner.model, torch.float32, runner.device, 16, 4, 16)()
