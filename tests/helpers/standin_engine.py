"""Engine steps on the stand-in CUDA device (tests/helpers/standin_cuda.py), each against the
same calls on the plain CPU engine.

Every scenario builds a tiny random checkpoint's `LLM(device="cuda")` under `StandinCuda`
(start-up as on a GPU: Triton backend, warm-up, decode graphs captured unless the scenario
runs eagerly), runs its requests with the steps strict (`mode.steps()`: a host read outside the
listed sync sites raises), and reports the stand-in's tokens, the CPU engine's tokens for the
same calls, every error the mode raised (the engine may have caught it and failed the
request) and the reads at the sync sites. Scenarios:

- `llama`: prefill and decode (graph replays, one with a padded row), an n=2 fork of a prompt ending mid-block
  (copy-on-write), seeded top-p/top-k sampling, beam search (width 2); then two planted bugs
  (a CPU tensor added to the step's ids, a `bincount` of them) that the mode must report;
- `ngram`: n-gram speculation, greedy and sampled (rejection sampling of the drafts);
- `moe`: Mixtral's routed experts, decode through captured graphs;
- `lora`: a batch of two random adapters and the base (eager: LoRA takes no graphs);
- `host-tier`: the host-memory KV tier under a small pool: preemptions swap out and in
  through it, and a second pass finds evicted prefixes there.

Run in the session's GPU-path worker (tests/helpers/gpu_path_worker.py: Triton interpreted):
`run(scenarios=[...])` answers one JSON-able dict per scenario.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCENARIOS = ("llama", "ngram", "moe", "lora", "host-tier")
# Small shapes: every kernel runs in Triton's interpreter, warm-up and capture included.
OPTS = dict(block_size=4, max_model_len=32, dtype="float32", num_kv_blocks=32,
            max_num_seqs=2, max_num_batched_tokens=16)
PROMPTS = [[5, 9, 13, 17, 21, 25], [30, 31, 32, 33, 34, 35, 36, 37, 38]]  # both end mid-block


def _params(**kw: Any) -> Any:
    from kserve_paged_engine import SamplingParams

    kw.setdefault("max_tokens", 4)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def _tokens(outs: list[Any]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _replays(llm: Any) -> dict[str, int]:
    graphs = llm.engine.runner.graphs
    return {str(k): v for k, v in graphs.used.items()} if graphs is not None else {}


Part = Callable[[Any], Any]  # one call on a scenario's LLM; its value is compared or checked


def _generate(prompts: list[list[int]], **kw: Any) -> Part:
    return lambda llm: _tokens(llm.generate(prompts, _params(**kw), use_tqdm=False))


LLAMA: dict[str, Part] = {
    "greedy": _generate(PROMPTS + [[40, 41, 42]], temperature=0.0),  # 3 rows: graph of 4
    "fork": _generate(PROMPTS[:1], n=2, temperature=0.0),
    "sampled": _generate(PROMPTS, temperature=0.8, top_p=0.9, top_k=20, seed=7),
    "beam": lambda llm: _tokens(llm.beam_search(PROMPTS, 2, 4, ignore_eos=True)),
    "cow_copies": lambda llm: llm.engine.kv.num_cow_copies,
}
# With the tiny Llama's weights: drafts proposed greedy, and drafts kept and rejected sampled.
NGRAM_PROMPT = [[19, 74, 10, 34, 17, 65, 59, 62, 85, 50, 28, 14]]
NGRAM: dict[str, Part] = {
    "greedy": _generate(NGRAM_PROMPT, max_tokens=8, temperature=0.0),
    "sampled": _generate(NGRAM_PROMPT, max_tokens=8, temperature=0.6, seed=3),
    "drafted": lambda llm: llm.stats().get("spec_decode_num_draft_tokens", 0),
}
MOE: dict[str, Part] = {"greedy": _generate(PROMPTS, temperature=0.0)}


def _planted(bug: Callable[[torch.Tensor], Any]) -> Part:
    """A greedy request with `bug(input_ids)` run before each forward of the model runner: the
    mode must report it, though the engine catches it and fails the request (a canary: the
    mode and this harness are not blind)."""
    def part(llm: Any) -> Any:
        from kserve_paged_engine.worker.model_runner import ModelRunner

        real = ModelRunner.forward

        def forward(self: Any, inputs: Any, block_copies: Any) -> Any:
            bug(inputs.input_ids)
            return real(self, inputs, block_copies)
        ModelRunner.forward = forward
        try:
            return _tokens(llm.generate(PROMPTS[:1], _params(temperature=0.0), use_tqdm=False))
        finally:
            ModelRunner.forward = real
    return part


PLANTED: dict[str, Part] = {
    "planted-mix": _planted(lambda ids: ids + torch.ones(ids.shape[0], dtype=ids.dtype)),
    "planted-read": _planted(torch.bincount),
}


def _lora_parts(adapters: dict[str, Path]) -> dict[str, Part]:
    from kserve_paged_engine.lora import LoRARequest

    reqs = [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
    return {"greedy": lambda llm: _tokens(llm.generate(
        PROMPTS + [PROMPTS[0]], _params(temperature=0.0), use_tqdm=False,
        lora_request=reqs + [None]))}


def _every_prefill_swaps(llm: Any) -> None:
    from kserve_paged_engine.core.kv_tier.measured_rate import MeasuredRate

    llm.engine.kv.tier.swaps.prefill = MeasuredRate(1.0, measured=True)


# Eight blocks of 4 for these: preemptions swap out and back in, the second pass hits the tier.
TIER_PROMPTS = [PROMPTS[0] + PROMPTS[1], PROMPTS[1] + PROMPTS[0], PROMPTS[1][:7] + [50, 51]]
TIER: dict[str, Part] = {
    "swaps": _every_prefill_swaps,
    "greedy": _generate(TIER_PROMPTS, temperature=0.0),
    "again": _generate(TIER_PROMPTS, temperature=0.0),  # evicted prefixes from the tier
    "copier": lambda llm: (type(llm.engine.kv_tier.copier).__name__,
                           llm.engine.kv_tier.host.is_pinned()),
    "stats": lambda llm: {k: llm.stats()[k] for k in (
        "kv_host_tier_block_hits", "num_preemptions", "kv_swap_outs", "kv_swap_ins")},
}


def _adapters(base: Path) -> dict[str, Path]:
    from tests.helpers.lora import make_adapter

    dirs = {"attn": base.parent / "adapter-attn", "mlp": base.parent / "adapter-mlp"}
    make_adapter(base, dirs["attn"], seed=1, r=4, lora_alpha=8,
                 target_modules=["q_proj", "v_proj"])
    make_adapter(base, dirs["mlp"], seed=2, r=8, lora_alpha=16,
                 target_modules=["gate_proj", "down_proj"])
    return dirs


CONFIGS_OF = {"llama": "llama_gqa_llama3", "ngram": "llama_gqa_llama3",
              "moe": "mixtral_4x_top2", "lora": "llama_gqa_llama3",
              "host-tier": "llama_gqa_llama3"}


def _plan(name: str, path: Path) -> tuple[dict[str, Any], dict[str, Part]]:
    """(LLM options, the parts) of a scenario over the checkpoint at `path`."""
    if name == "llama":
        return {"max_num_seqs": 4}, {**LLAMA, "replays": _replays, **PLANTED}
    if name == "moe":
        return {}, {**MOE, "replays": _replays}
    if name == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
        return {"speculative_config": spec, "enforce_eager": True}, NGRAM
    if name == "lora":
        return ({"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_seqs": 3},
                _lora_parts(_adapters(path)))
    if name == "host-tier":
        from kserve_paged_engine.config.kv_tier import KVTierConfig

        return ({"num_kv_blocks": 8, "max_num_batched_tokens": 8, "enforce_eager": True,
                 "max_num_seqs": 3, "kv_transfer_config": KVTierConfig(1 << 20)}, TIER)
    raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")


def _run_parts(llm: Any, parts: dict[str, Part], mode: Any = None,
               failures: _EngineFailures | None = None) -> dict[str, Any]:
    """Each part's value in order, or its error (the next part still runs); with a mode,
    each part's steps are strict, and the mode's errors and the requests the engine failed
    during it are kept."""
    out: dict[str, Any] = {}
    for name, part in parts.items():
        errors, failed = (len(mode.errors), len(failures.traces)) if mode else (0, 0)
        entry: dict[str, Any] = {}
        try:
            with mode.steps() if mode else contextlib.nullcontext():
                entry["value"] = part(llm)
        except Exception as exc:  # noqa: BLE001 - reported per part
            entry["error"] = f"{type(exc).__name__}: {exc}"
        if mode and len(mode.errors) > errors:
            entry["mode_errors"] = mode.errors[errors:]
        if failures and len(failures.traces) > failed:
            entry["engine_failures"] = failures.traces[failed:]
        out[name] = entry
    return out


def run_scenario(name: str, folder: Path) -> dict[str, Any]:
    """One scenario on the stand-in device and on CPU (see the module docstring)."""
    from kserve_paged_engine import LLM
    from tests.helpers.standin_cuda import StandinCuda
    from tests.helpers.tiny_models import CONFIGS, save_checkpoint, save_tokenizer

    path, _ = save_checkpoint(CONFIGS[CONFIGS_OF[name]], folder / "model")
    save_tokenizer(path)
    opts, parts = _plan(name, path)
    opts = {**OPTS, **opts, "model": str(path)}
    res: dict[str, Any] = {}
    t0 = time.monotonic()
    failures = _EngineFailures()
    logging.getLogger("kserve_paged_engine").addHandler(failures)
    mode = StandinCuda()
    try:
        with mode:
            llm = LLM(device="cuda", **opts)
            res["backend"] = llm.engine.runner.attention_backend
            res["parts"] = _run_parts(llm, parts, mode, failures)
            del llm
    except Exception:  # noqa: BLE001 - start-up failed: reported with the mode's errors
        res["startup"] = traceback.format_exc()[-3000:]
    finally:
        logging.getLogger("kserve_paged_engine").removeHandler(failures)
    res["errors"], res["reads"] = mode.errors, dict(mode.reads)
    res["engine_failures"] = failures.traces
    res["seconds"] = round(time.monotonic() - t0, 1)
    cpu_opts = dict(opts)
    if name == "host-tier":
        from kserve_paged_engine.config.kv_tier import KVTierConfig

        cpu_opts["kv_transfer_config"] = KVTierConfig(1 << 20, host_on_cpu=True)
    res["cpu"] = _run_parts(LLM(device="cpu", **cpu_opts), parts)
    return res


class _EngineFailures(logging.Handler):
    """The tracebacks the engine logs where it fails a request instead of raising."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.traces: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))[-2000:]
        self.traces.append(text)


def run(scenarios: list[str]) -> dict[str, Any]:
    """Each scenario's result (see `run_scenario`), by name. The attention backend is left to
    the device, as a server leaves it: Triton on the stand-in (flash-attn is not installed
    here), the CPU backend for the reference."""
    from kserve_paged_kernels import settings

    assert not torch.cuda.is_available(), "a real GPU is here: run the GPU path on it"
    name = settings.ATTENTION_BACKEND.name
    forced = os.environ.pop(name, None)
    out = {}
    try:
        for scenario in scenarios:
            with tempfile.TemporaryDirectory() as tmp:
                out[scenario] = run_scenario(scenario, Path(tmp))
    finally:
        if forced is not None:
            os.environ[name] = forced
    return out
