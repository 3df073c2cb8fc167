"""Pooling with a LoRA adapter: a decoder embedding model (last-token pooling) serves an
adapter's requests next to the base model's in one batch, each equal to transformers + PEFT's
last hidden state for that adapter."""

from __future__ import annotations

import pytest
import torch

from kserve_paged_engine import LLM
from kserve_paged_engine.lora import LoRARequest
from kserve_paged_engine.pooling_params import PoolingParams
from tests.helpers.lora import make_adapter, tiny_base

PROMPTS = [list(range(100, 123)), [7, 8, 9, 10, 11] * 5, list(range(3000, 3011))]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-lora")
    tiny_base(root / "base")
    make_adapter(root / "base", root / "qv", seed=3, r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj", "down_proj"])
    return root / "base", root / "qv"


def peft_last_hidden(base, adapter, ids: list[int]) -> torch.Tensor:
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.inference_mode():
        out = model.eval()(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1].float()


def test_embeddings_with_and_without_an_adapter_equal_peft(folders):
    base, adapter = folders
    llm = LLM(model=str(base), dtype="float32", device="cpu", runner="pooling",
              enable_lora=True, max_lora_rank=8, num_kv_blocks=64, max_model_len=64,
              max_num_batched_tokens=16)
    lora = LoRARequest("qv", 1, str(adapter))
    raw = PoolingParams(task="embed", normalize=False)
    ids = []
    for i, prompt in enumerate(PROMPTS):  # each prompt with and without, in one batch
        for name, req in (("base", None), ("qv", lora)):
            rid = f"{name}-{i}"
            llm.engine.add_request(rid, prompt, pooling_params=raw, lora_request=req)
            ids.append(rid)
    outs = dict(zip(ids, llm._run(ids, use_tqdm=False)))
    for i, prompt in enumerate(PROMPTS):
        plain = peft_last_hidden(base, None, prompt)
        tuned = peft_last_hidden(base, adapter, prompt)
        assert not torch.allclose(plain, tuned, atol=1e-2)  # the adapter really changes it
        torch.testing.assert_close(outs[f"base-{i}"].pooled, plain, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(outs[f"qv-{i}"].pooled, tuned, atol=1e-4, rtol=1e-4)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
