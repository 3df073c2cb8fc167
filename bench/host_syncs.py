"""Host reads of device values in one engine step on the GPU path (issue 32, item 4: one).

    python bench/host_syncs.py [--json]

Tiny Llama and Mixtral checkpoints (tests/helpers/tiny_models.py) served by `kserve_paged_engine.LLM` on the
Triton backend (compiled on CUDA; in Triton's interpreter on CPU, set here before Triton is
imported). For each case the engine steps until the case's step, and the device part of that
step (the executor's forward and the sampling pipeline) runs under
`tests.helpers.host_reads`, which counts every `.item()`, `.tolist()`, `bool(tensor)`, ... and
pageable `torch.tensor(list, device=)` the project's code makes, by call site. Cases: a prefill
step and a decode step of greedy requests, a decode step with an n=2 fork's copy-on-write, a
decode step of Mixtral (its routing), and a decode step of sampled requests (temperature,
top-p). The last stdout line is JSON: per case, the total and the sites.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = ("prefill", "decode", "fork", "moe", "sampled")


def force_triton() -> None:
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "triton"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def count_step(llm: Any, prompts: list[list[int]], params: Any, step: int) -> dict[str, Any]:
    """Add the requests, run `step` steps, count the reads of the next one's device part."""
    from tests.helpers.host_reads import HostReads, host_reads

    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(step):
        engine.step()
    total = HostReads()
    real_execute, real_run = engine.executor.execute, engine.sampling.run

    def counted(real):
        def call(*a, **kw):
            with host_reads() as reads:
                out = real(*a, **kw)
            total.sites.update(reads.sites)
            return out
        return call

    engine.executor.execute, engine.sampling.run = counted(real_execute), counted(real_run)
    try:
        engine.step()
    finally:
        engine.executor.execute, engine.sampling.run = real_execute, real_run
    # What comes after the counted step is not counted: aborting frees the blocks at once.
    engine.abort_request([f"r{i}" for i in range(len(prompts))])
    in_use = engine.stats()["kv_blocks_in_use"]
    assert not engine.has_unfinished_requests() and not in_use, f"{in_use} blocks in use"
    return {"total": total.total, "sites": dict(total.sites)}


def run(cases: list[str]) -> dict[str, Any]:
    from kserve_paged_engine import LLM, SamplingParams
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    out: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[3 + i for i in range(n)] for n in (3, 6, 9)]  # each ends mid-block
    with tempfile.TemporaryDirectory() as tmp:
        llms = {}
        for name, config in (("llama", "llama_gqa_llama3"), ("mixtral", "mixtral_4x_top2")):
            path, _ = save_checkpoint(CONFIGS[config], Path(tmp) / name)
            save_tokenizer(path)
            llms[name] = lambda path=path: LLM(model=str(path), block_size=4, num_kv_blocks=64,
                                               max_model_len=64)
        plans = {
            "prefill": ("llama", greedy, 0),
            "decode": ("llama", greedy, 1),
            "fork": ("llama", SamplingParams(n=2, max_tokens=4, temperature=0.0,
                                             ignore_eos=True), 1),
            "moe": ("mixtral", greedy, 1),
            "sampled": ("llama", SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9,
                                                seed=1, ignore_eos=True), 1),
        }
        for case in cases:
            model, params, step = plans[case]
            llm = llms[model]()
            assert llm.engine.runner.attention_backend == "triton"
            out[case] = count_step(llm, prompts, params, step)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = parser.parse_args(argv)
    force_triton()
    result = run(args.cases.split(","))
    if not args.json:
        for case in args.cases.split(","):
            print(f"{case}: {result[case]['total']}")
            for site, n in sorted(result[case]["sites"].items()):
                print(f"  {n:3}  {site}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
