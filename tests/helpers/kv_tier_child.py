"""A tier hit served by the engine on whichever backend this process resolves: the test
process (cpu) and the GPU-path worker (tests/helpers/gpu_path_worker.py: Triton, interpreted
without CUDA) call `serve` and compare the answers (tests/test_kv_tier.py)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

PROMPT = [(i * 37) % 90 + 3 for i in range(17)]  # 4 full blocks of 4 before its last token
FLOODS = [[(i * 53 + k * 11) % 90 + 3 for i in range(17)] for k in (1, 2)]


def serve() -> dict[str, Any]:
    """Greedy tokens of a prompt computed, then (its blocks evicted to the tier by two other
    prompts on a 12-block pool) restored (partly from the disk); the tier's hits and the backend."""
    import torch

    from kserve_paged_engine import LLM, SamplingParams
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], Path(tmp))
        save_tokenizer(path)
        tier = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
            "secondary_tiers": [{"type": "fs", "root_dir": str(Path(tmp) / "tier")}]}}
        llm = LLM(model=str(path), block_size=4, num_kv_blocks=12, max_model_len=32,
                  dtype="float32", max_num_seqs=1, kv_transfer_config=json.dumps(tier))
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

        def run(prompt: list[int]) -> list[int]:
            with torch.inference_mode():
                return list(llm.generate([prompt], greedy, use_tqdm=False)[0]
                            .outputs[0].token_ids)

        first = run(PROMPT)
        for p in FLOODS:
            run(p)
        restored = run(PROMPT)
        out = {"backend": llm.engine.runner.attention_backend, "first": first,
               "restored": restored, "hits": llm.stats()["kv_tier_block_hits"]}
        llm.engine.close()
        return out
