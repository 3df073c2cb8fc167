"""Child process of tests/test_warmup.py: a tiny Llama served on the Triton backend (Triton
interpreted without CUDA), the warm-up run, then requests served; prints JSON: the variants
the warm-up launched, those serving launched, and those serving launched that the warm-up had
not (which would be compiled while a request waits)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before anything imports Triton
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "triton"


def main() -> int:
    from engine import LLM, SamplingParams, startup
    from kernels.launches import counting
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path, _ = save_checkpoint(CONFIGS[sys.argv[1]], Path(tmp))
        save_tokenizer(path)
        llm = LLM(model=str(path), block_size=4, num_kv_blocks=64, max_model_len=48,
                  max_num_batched_tokens=16, max_num_seqs=4)
        engine = llm.engine
        report = startup.warm_up(engine.config, engine.runner)
        prompts = [[3 + i % 50 for i in range(n)] for n in (3, 21, 9, 30, 6)]
        with counting() as served:
            llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0,
                                                 ignore_eos=True), use_tqdm=False)
    missing = served.variants - report.variants
    print(json.dumps({"warmup": len(report.variants), "served": len(served.variants),
                      "launches": report.launches, "missing": [repr(v) for v in missing]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
