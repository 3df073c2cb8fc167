"""An int8 / fp8 KV cache served by the engine, on whichever backend this process resolves:
the test process (cpu) and the GPU-path worker (tests/helpers/gpu_path_worker.py: Triton,
interpreted without CUDA) call `serve` with the same arguments and compare the answers."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def serve(kv_cache_dtype: str) -> dict[str, Any]:
    """Greedy tokens and their log-probabilities for three prompts of a tiny Llama (block size
    4, a 10-token step budget: chunked prefill over partly filled blocks, and an n=2 fork that
    copies a block on write), plus the backend that served them."""
    import torch

    from kserve_paged_engine import LLM, SamplingParams
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path, _ = save_checkpoint(CONFIGS["llama_gqa_llama3"], Path(tmp))
        save_tokenizer(path)
        llm = LLM(model=str(path), block_size=4, num_kv_blocks=64, max_model_len=64,
                  kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=10, dtype="float32")
        prompts = [list(range(5, 23)), list(range(30, 37)), [3, 9, 27, 81 % 97, 50]]
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0,
                                n=2)
        with torch.inference_mode():
            outs = llm.generate(prompts, greedy, use_tqdm=False)
        return {"backend": llm.engine.runner.attention_backend,
                "tokens": [list(c.token_ids) for o in outs for c in o.outputs],
                "logprobs": [[next(iter(d.values())).logprob for d in c.logprobs]
                             for o in outs for c in o.outputs],
                "free": llm.stats()["kv_blocks_free"]}
