"""The warm-up's coverage on the GPU path, for tests/test_warmup.py: a tiny model served on the
Triton backend (Triton interpreted without CUDA; the caller's process has set that up, as
tests/helpers/gpu_path_worker.py does), the warm-up run, then requests served. Returns the
variants the warm-up launched, those serving launched, and those serving launched that the
warm-up had not (which would be compiled while a request waits).

    python -m tests.helpers.warmup_child CONFIG   # alone: prints the JSON
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def served_variants(config: str) -> dict[str, Any]:
    from kserve_paged_engine import LLM, SamplingParams
    from kserve_paged_engine.frontend import startup
    from kserve_paged_kernels.launches import counting
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path, _ = save_checkpoint(CONFIGS[config], Path(tmp))
        save_tokenizer(path)
        llm = LLM(model=str(path), block_size=4, num_kv_blocks=64, max_model_len=48,
                  max_num_batched_tokens=16, max_num_seqs=4)
        engine = llm.engine
        assert engine.runner.attention_backend == "triton"
        report = startup.warm_up(engine.config, engine.runner)
        # Chunked prefill (21 and 30 tokens over 16-token steps), mixed steps, batched decode.
        prompts = [[3 + i % 50 for i in range(n)] for n in (3, 21, 9, 30, 6)]
        with counting() as served:
            llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                 ignore_eos=True), use_tqdm=False)
    missing = served.variants - report.variants
    return {"warmup": len(report.variants), "served": len(served.variants),
            "launches": report.launches, "missing": [repr(v) for v in missing]}


if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():  # before anything imports Triton
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "triton"
    print(json.dumps(served_variants(sys.argv[1])))
