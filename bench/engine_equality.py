"""The engine end to end on the GPU path, greedy against transformers (issue 32, item 1).

    python bench/engine_equality.py [--models llama,qwen3,gemma3,mixtral]
                                    [--scenarios basic,forks,beam,ngram,lora]
                                    [--dtype float32|bfloat16] [--json]

Tiny random checkpoints of each family (tests/helpers/tiny_models.py: Llama with Llama 3.1
rope scaling, Qwen3's q/k norms, Gemma 3's windows, local RoPE and soft-capping, Mixtral's
experts) are saved with a word-level tokenizer and served by `kserve_paged_engine.LLM` on the Triton
backend, forced: compiled on CUDA, in Triton's interpreter on CPU (this script sets
TRITON_INTERPRET=1 before anything imports Triton). Scenarios:

- `basic`: a small pool and a 16-token step budget (chunked prefill, preemption), prefix
  caching on and the prompts run twice (prefix hits; one prompt shares 9 blocks with another);
- `forks`: n=2 greedy samples, forked from a prompt that ends mid-block (copy-on-write);
- `beam`: beam search (width 2) against transformers' `num_beams=2`;
- `ngram`: n-gram speculation (3 drafts) on prompts whose answers repeat them;
- `lora`: a batch mixing two random PEFT adapters and the base (needs peft; Llama only);
- `graphs`: decode through the CUDA-graph runner's padded buffers (captured on CUDA; on CPU
  the recording stand-in replays the same forward).
- `host-tier`: `basic`'s pool with the host-memory KV tier under it (pinned slots and the side
  stream's copies on CUDA; forced on CPU, synchronous copies): evicted blocks come back from
  host memory and every preemption swaps through it (Llama and Qwen3: one KV group).

Every greedy continuation must equal transformers' fp32 `generate`; in bfloat16 (`--dtype`,
CUDA) the engine's tokens are held to agree with fp32 transformers' on at least `BF16_AGREE` of
positions before their first divergence is allowed (stated bound; tiny random models amplify
rounding). The last stdout line is a JSON object: per model and scenario, ok, seconds and what
was checked; exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def force_triton() -> None:
    """The Triton backend, interpreted without CUDA: before anything imports Triton (main's
    first act; importing this module changes nothing)."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ["KSERVE_PAGED_ATTENTION_BACKEND"] = "triton"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


MODELS = {"llama": "llama_gqa_llama3", "qwen3": "qwen3_qk_norm",
          "gemma3": "gemma3_window_local_rope", "mixtral": "mixtral_4x_top2"}
SCENARIOS = ("basic", "forks", "beam", "ngram", "lora", "graphs", "host-tier")
NEW = 6
POOL = 10  # blocks of 4 for `basic`: the three prompts cannot run at once
# Gemma 3's 4 layers are 4 KV groups; Mixtral's window (12) frees blocks as requests grow.
POOLS = {"gemma3": 40, "mixtral": 8}
BF16_AGREE = 0.5  # bf16: the greedy tokens before the first divergence, share of all


class Mismatch(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Mismatch(what)


class Model:
    """A saved tiny checkpoint with its tokenizer, the transformers reference and prompts."""

    def __init__(self, name: str, folder: Path, dtype: str) -> None:
        from tests.helpers.tiny_models import CONFIGS, VOCAB, save_checkpoint, save_tokenizer

        self.name, self.dtype = name, dtype
        self.path, self.ref = save_checkpoint(CONFIGS[MODELS[name]], folder)
        save_tokenizer(self.path)
        self.ref.generation_config.eos_token_id = None
        g = torch.Generator().manual_seed(11)
        self.prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (14, 23)]
        self.prompts.append(self.prompts[1][:20] + [5, 6])  # shares 5 full blocks with 1

    def expected(self, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
        with torch.inference_mode():
            # The mask given: generate would take the pad id (0) in a prompt for padding.
            return [self.ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                      max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                      pad_token_id=0)[0, len(p):].tolist() for p in prompts]

    def llm(self, **kw: Any):
        from kserve_paged_engine import LLM

        opts = dict(model=str(self.path), block_size=4, max_model_len=64, dtype=self.dtype,
                    num_kv_blocks=64)
        opts.update(kw)
        llm = LLM(**opts)
        check(llm.engine.runner.attention_backend == "triton",
              f"backend {llm.engine.runner.attention_backend}, not triton")
        return llm

    def same(self, got: list[list[int]], want: list[list[int]], what: str) -> None:
        if self.dtype == "float32":
            check(got == want, f"{what}: {got} != transformers {want}")
            return
        agree = sum(_prefix(a, b) for a, b in zip(got, want))
        total = sum(len(b) for b in want)
        check(agree >= BF16_AGREE * total, f"{what}: {agree}/{total} tokens agree in bf16")


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy(n: int = 1, new: int = NEW):
    from kserve_paged_engine import SamplingParams

    return SamplingParams(n=n, max_tokens=new, temperature=0.0, ignore_eos=True)


def run_basic(m: Model) -> dict[str, Any]:
    """Chunked prefill, preemption under a small pool, prefix hits on the second run."""
    want = m.expected(m.prompts)
    pool = POOLS.get(m.name, POOL)
    llm = m.llm(num_kv_blocks=pool, max_num_batched_tokens=16)
    for _ in range(2):
        outs = llm.generate(m.prompts, greedy(), use_tqdm=False)
        m.same([o.outputs[0].token_ids for o in outs], want, "basic")
    stats = llm.stats()
    check(stats["prefix_cache_hits"] > 0, "no prefix hits")
    check(stats["num_preemptions"] > 0, "no preemption")
    free = stats["kv_blocks_free"]
    check(free == pool, f"blocks leaked: {free} free of {pool}")
    return {"prefix_cache_hits": stats["prefix_cache_hits"],
            "num_preemptions": stats["num_preemptions"]}


def run_forks(m: Model) -> dict[str, Any]:
    """n=2 greedy samples of a prompt ending mid-block: both equal transformers, and the shared
    last block was copied on write."""
    prompts = m.prompts[:2]  # 14 and 23 tokens: both end mid-block
    want = m.expected(prompts)
    llm = m.llm()
    outs = llm.generate(prompts, greedy(n=2), use_tqdm=False)
    for o, w in zip(outs, want):
        m.same([c.token_ids for c in o.outputs], [w, w], "forks")
    copies = llm.engine.kv.num_cow_copies
    check(copies > 0, "no copy-on-write")
    check(llm.stats()["kv_blocks_in_use"] == 0, "blocks still in use")
    return {"cow_copies": copies}


def run_beam(m: Model) -> dict[str, Any]:
    """Beam search (width 2, no EOS) against transformers' generate(num_beams=2)."""
    prompts = m.prompts[:2]
    llm = m.llm()
    outs = llm.beam_search(prompts, 2, NEW, ignore_eos=True)
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            ref = m.ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                 max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, num_beams=2, num_return_sequences=2,
                                 pad_token_id=0)
        want = [s[len(p):].tolist() for s in ref]
        m.same([c.token_ids for c in o.outputs], want, "beam")
    check(llm.stats()["kv_blocks_in_use"] == 0, "blocks still in use")
    return {"cow_copies": llm.engine.kv.num_cow_copies}


def run_ngram(m: Model) -> dict[str, Any]:
    """n-gram speculation (3 drafts): greedy equal, some drafts accepted."""
    from tests.helpers.tiny_models import VOCAB

    # Every token of the vocabulary is in the first prompt, so whatever the random model
    # emits has a match to draft from.
    every = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [every, m.prompts[0]]
    want = m.expected(prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    llm = m.llm(speculative_config=spec, max_model_len=128, num_kv_blocks=160)  # Gemma: 4 groups
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    m.same([o.outputs[0].token_ids for o in outs], want, "ngram")
    stats = llm.stats()
    drafted = stats.get("spec_decode_num_draft_tokens", 0)
    check(drafted > 0, "no draft proposed")  # acceptance is up to the random model
    return {"drafted": drafted, "accepted": stats.get("spec_decode_num_accepted_tokens", 0)}


def run_lora(m: Model) -> dict[str, Any]:
    """One batch: two adapters (attention r4, MLP r8) and the base, against PEFT."""
    from kserve_paged_engine.lora import LoRARequest
    from tests.helpers.lora import make_adapter, peft_greedy

    adapters = {"attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                "mlp": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "down_proj"])}
    dirs = {}
    for i, (name, kw) in enumerate(adapters.items()):
        dirs[name] = m.path.parent / f"adapter-{name}"
        make_adapter(m.path, dirs[name], seed=i + 1, **kw)
    prompts = m.prompts[:2] + [m.prompts[0]]
    which = ["attn", "mlp", None]
    want = [peft_greedy(m.path, dirs[w] if w else None, [p], NEW)[0]
            for p, w in zip(prompts, which)]
    check(want[0] != want[2], "the adapter changes nothing")
    llm = m.llm(enable_lora=True, max_loras=2, max_lora_rank=8)
    reqs = [LoRARequest(w, i + 1, str(dirs[w])) if w else None for i, w in enumerate(which)]
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=reqs)
    m.same([o.outputs[0].token_ids for o in outs], want, "lora")
    return {"adapters": len(adapters)}


def run_graphs(m: Model) -> dict[str, Any]:
    """Decode through the graph runner's padded buffers (engine/kserve_paged_engine/worker/cuda_graphs.py): captured
    on CUDA, the recording stand-in elsewhere; three requests finishing at different steps
    replay sizes 4 (one padded row), 2 and 1."""
    from kserve_paged_engine.worker.cuda_graphs import CudaCapture, RecordReplay

    prompts = [p[:n] for p, n in zip(m.prompts, (6, 9, 3))]  # short: decode is the point
    news = [NEW, 3, NEW + 2]
    want = [m.expected([p], n)[0] for p, n in zip(prompts, news)]
    llm = m.llm(max_num_seqs=4, enforce_eager=True)
    capturer = CudaCapture() if torch.cuda.is_available() else RecordReplay()
    why = llm.engine.runner.capture_graphs(4, capturer)
    check(why is None, f"no graphs: {why}")
    outs = llm.generate(prompts, [greedy(new=n) for n in news], use_tqdm=False)
    m.same([o.outputs[0].token_ids for o in outs], want, "graphs")
    used = dict(llm.engine.runner.graphs.used)
    check(used.get(4, 0) > 0 and sum(used.values()) >= NEW + 1, f"replays {used}")
    return {"replays": used}


def run_host_tier(m: Model) -> dict[str, Any]:
    """`basic` over the host KV tier (engine/kserve_paged_engine/core/kv_tier/host.py): the second pass hits host
    memory, preemptions swap out and back in through it; nothing leaks."""
    from kserve_paged_engine.config.kv_tier import KVTierConfig
    from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate
    from kserve_paged_engine.worker.kv_host_copy import StreamCopier

    cuda = torch.cuda.is_available()
    want = m.expected(m.prompts)
    llm = m.llm(num_kv_blocks=POOL, max_num_batched_tokens=16,
                kv_transfer_config=KVTierConfig(1 << 20, host_on_cpu=not cuda))
    tier = llm.engine.kv_tier
    check(not cuda or (isinstance(tier.copier, StreamCopier) and tier.host.is_pinned()),
          "on CUDA: pinned slots and the stream copier")
    llm.engine.kv.tier.swaps.prefill = MeasuredRate(1.0, measured=True)  # every one swaps
    for _ in range(2):
        outs = llm.generate(m.prompts, greedy(), use_tqdm=False)
        m.same([o.outputs[0].token_ids for o in outs], want, "host-tier")
    s = llm.stats()
    check(s["kv_host_tier_block_hits"] > 0, "no host tier hits")
    check(s["num_preemptions"] > 0 and s["kv_swap_ins"] == s["kv_swap_outs"] > 0,
          f"swaps: {s['kv_swap_outs']} out, {s['kv_swap_ins']} in")
    check(s["kv_blocks_free"] == POOL and len(tier.slots) + len(tier.free) == tier.capacity_blocks,
          "blocks or slots leaked")
    return {k: s[k] for k in ("kv_host_tier_block_hits", "kv_host_tier_write_bytes",
                              "num_preemptions", "kv_swap_outs")}


RUNNERS = {"host-tier": run_host_tier, "graphs": run_graphs, "basic": run_basic, "forks": run_forks, "beam": run_beam, "ngram": run_ngram,
           "lora": run_lora}


def run(models: list[str], scenarios: list[str], dtype: str) -> dict[str, Any]:
    """Every scenario of every model; a failure is recorded, never raised."""
    import importlib.util

    out: dict[str, Any] = {"dtype": dtype, "device": "cuda" if torch.cuda.is_available()
                           else "cpu (Triton interpreted)", "results": {}}
    for name in models:
        with tempfile.TemporaryDirectory() as tmp:
            m = Model(name, Path(tmp) / "model", dtype)
            for sc in scenarios:
                key = f"{name}/{sc}"
                if sc == "lora" and (name != "llama" or importlib.util.find_spec("peft") is None):
                    out["results"][key] = {"ok": None, "skipped": "Llama with peft only"}
                    continue
                if sc == "host-tier" and name in ("gemma3", "mixtral"):
                    out["results"][key] = {"ok": None, "skipped": "windows: no KV tier"}
                    continue
                if sc == "graphs" and name == "gemma3":
                    out["results"][key] = {"ok": None, "skipped": "KV groups: decode is eager"}
                    continue
                t0 = time.monotonic()
                try:
                    res = {"ok": True, **RUNNERS[sc](m)}
                except Exception as exc:  # noqa: BLE001 - reported, the next scenario runs
                    res = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                           "trace": traceback.format_exc()[-2000:]}
                res["seconds"] = round(time.monotonic() - t0, 1)
                out["results"][key] = res
                print(f"{key}: {'ok' if res['ok'] else res['error']} ({res['seconds']} s)",
                      file=sys.stderr, flush=True)
    out["ok"] = all(r["ok"] is not False for r in out["results"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = parser.parse_args(argv)
    force_triton()
    torch.manual_seed(0)
    result = run(args.models.split(","), args.scenarios.split(","), args.dtype)
    if not args.json:
        for key, res in result["results"].items():
            print(f"{key:16} {res}")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
